"""Data parallelism on 2 MPI ranks reproduces single-process full-batch training."""
import json
import os

import numpy as np
import pytest
from parallel_scripts.common import make_model, train_reference
from parallel_scripts.mpi_run import LAUNCHER, run_mpi

import needle as ndl
from needle.parallel import launch_command, launch_env, nccl_available, plan_buckets

STEPS = 3
HAS_TWO_GPUS = ndl.cuda().enabled() and ndl.cuda().device_count() >= 2
TWO_GPUS = pytest.mark.skipif(not HAS_TWO_GPUS, reason="needs 2 CUDA GPUs")
TWO_GPUS_NCCL = pytest.mark.skipif(
    not (HAS_TWO_GPUS and nccl_available()), reason="needs 2 CUDA GPUs and CuPy with NCCL"
)


@pytest.mark.skipif(LAUNCHER is None, reason="no MPI launcher (mpiexec/mpirun) found")
@pytest.mark.parametrize(
    "batch, bucket_mb, offload, device",
    [
        (8, 4.0, "local", "cpu"),  # one bucket, even shards
        (7, 1e-6, "local", "cpu"),  # a bucket per parameter, shards of 4 and 3 rows
        (8, 0.001, "offload", "cpu"),  # 2 buckets; matmuls through needle.remote's offload
        pytest.param(7, 1e-6, "local", "cuda", marks=TWO_GPUS_NCCL),  # NCCL, buckets on GPU
        pytest.param(7, 1e-6, "local", "cuda-mpi", marks=TWO_GPUS),  # staged through host
    ],
    ids=[
        "one-bucket-even",
        "bucket-per-param-uneven",
        "offloaded-matmuls",
        "nccl-two-gpus",
        "mpi-two-gpus",
    ],
)
def test_two_ranks_match_full_batch_training(tmp_path, batch, bucket_mb, offload, device):
    run_mpi("dp_train.py", tmp_path, STEPS, batch, bucket_mb, offload, device)
    expected = train_reference(seed=0, steps=STEPS, batch=batch)
    tol = {"rtol": 1e-5, "atol": 1e-6} if device == "cpu" else {"rtol": 1e-4, "atol": 1e-5}
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    for r, weights in enumerate(ranks):
        got = [weights[f"arr_{i}"] for i in range(len(weights.files))]
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(g, e, err_msg=f"rank {r}", **tol)
    for name in ranks[0].files:
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name])
    offloaded = [int((tmp_path / f"offloaded{r}.txt").read_text()) for r in range(2)]
    # per step, 3 Linear layers: 3 matmuls forward, 2 each backward (the input is a needle
    # Tensor, which requires grad by default)
    assert offloaded == ([STEPS * 9] * 2 if offload == "offload" else [0, 0])
    # The script then tries bad input: every rank must refuse it, naming what was wrong.
    for r in range(2):
        refusals = json.loads((tmp_path / f"refusals{r}.json").read_text())
        assert "rank 1 has parameters" in refusals["replicas"]
        hint = "; every rank needs a row (a data set's last batch: DataLoader(..., " \
            "drop_last=True) skips it)"
        assert refusals["shard"] == "a batch of shape (1, 3) cannot be split over 2 ranks" + hint
        assert refusals["fraction"] == "a batch of 1 rows cannot be split over 2 ranks" + hint
        assert refusals["weight"] == "local_fraction must lie in [0, 1], got 1.5"
        # NaN in rank 1's batch only: both ranks refuse the summed gradients, naming them
        assert refusals["nan"].startswith(
            "non-finite gradients (NaN or inf on some rank) for parameters [0, 1, 2, 3, 4, 5]"
        )
        assert refusals["unchecked_nan_grads"]  # with check_finite=False


def test_buckets_cover_every_parameter_once_in_backward_order():
    params = make_model(seed=0).parameters()
    sizes = [int(np.prod(p.shape)) for p in params]
    buckets = plan_buckets(params, bucket_bytes=4 * 200)
    flat = [p for b in buckets for p in b.params]
    assert [id(p) for p in flat] == [id(p) for p in reversed(params)]
    for b in buckets:
        assert b.size == sum(int(np.prod(p.shape)) for p in b.params)
        assert b.offsets == list(np.cumsum([0] + [int(np.prod(p.shape)) for p in b.params])[:-1])
    # Every bucket but the last reaches the size bound, and none overshoots by a whole parameter.
    for b in buckets[:-1]:
        last = int(np.prod(b.params[-1].shape))
        assert b.size * 4 >= 800 and (b.size - last) * 4 < 800
    assert sum(b.size for b in buckets) == sum(sizes)
    assert len(plan_buckets(params, bucket_bytes=1 << 30)) == 1


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="bucket size must be positive"):
        plan_buckets(make_model(seed=0).parameters(), bucket_bytes=0)


def test_launcher_refuses_zero_processes():
    with pytest.raises(ValueError, match="number of processes must be at least 1, got 0"):
        launch_command(0, "train.py", [])


def test_launch_env_lets_open_mpi_run_as_root_unbound_and_keeps_what_is_set():
    env = launch_env({"PATH": "/bin", "OMPI_MCA_hwloc_base_binding_policy": "core"})
    assert env["PATH"] == "/bin"
    assert env["OMPI_MCA_hwloc_base_binding_policy"] == "core"  # the caller's choice wins
    assert launch_env({})["OMPI_MCA_hwloc_base_binding_policy"] == "none"
    as_root = os.geteuid() == 0
    assert ("OMPI_ALLOW_RUN_AS_ROOT" in env) == as_root
    assert ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM" in env) == as_root


def test_launch_env_drops_what_an_open_mpi_singleton_left_in_the_parent():
    """The variables Open MPI 4.1 set in a process that used mpi4py without mpiexec (taken from
    one on the GPU hosts): inherited, they made the next mpiexec exit 1 silently, so every
    parallel test after one that initialised MPI in-process failed there. The user's own MCA
    settings stay."""
    singleton = {"OMPI_MCA_ess": "singleton", "OMPI_MCA_orte_ess_num_procs": "1",
                 "OMPI_MCA_orte_launch": "1", "OMPI_MCA_pmix": "^s1,s2,cray,isolated",
                 "OMPI_APP_CTX_NUM_PROCS": "1", "ORTE_SCHIZO_DETECTION": "ORTE",
                 "PMIX_RANK": "0", "PMIX_NAMESPACE": "2032074753",
                 "PMIX_SERVER_URI21": "2032074752.0;tcp4://127.0.0.1:44201"}
    mine = {"PATH": "/bin", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader"}
    env = launch_env({**singleton, **mine})
    assert not set(singleton) & set(env)
    assert {key: env[key] for key in mine} == mine
    assert launch_env({"PMIX_RANK": "3", **mine})["PMIX_RANK"] == "3"  # not a singleton's
