"""Data parallelism on 2 MPI ranks: allreduce overlapped with backward, BatchNorm statistics
synchronised."""
import json

import numpy as np
import pytest
from parallel_scripts.common import make_batches
from parallel_scripts.mpi_run import LAUNCHER, run_mpi

import needle as ndl
from needle.parallel import nccl_available

STEPS, BATCH, MOMENTUM = 3, 7, 0.1  # BatchNorm1d's default momentum
MODES = ("on", "off", "plain")
UNUSED = 2  # parameters 0 and 1 (a Linear that forward never calls) get no gradient
HAS_TWO_GPUS = ndl.cuda().enabled() and ndl.cuda().device_count() >= 2


@pytest.fixture(
    scope="module",
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not (HAS_TWO_GPUS and nccl_available()), reason="needs 2 CUDA GPUs and CuPy"
            ),
        ),
    ],
)
def ranks(request, tmp_path_factory):
    """What both ranks saved after training with a bucket per parameter, in every mode."""
    if LAUNCHER is None:
        pytest.skip("no MPI launcher (mpiexec/mpirun) found")
    out = tmp_path_factory.mktemp(request.param)
    run_mpi("dp_overlap.py", out, STEPS, BATCH, 1e-6, request.param)
    return request.param, {
        (mode, r): (
            np.load(out / f"{mode}{r}.npz"),
            json.loads((out / f"{mode}{r}.json").read_text()),
        )
        for mode in MODES
        for r in range(2)
    }


def test_buckets_start_during_backward_in_order_as_soon_as_full(ranks):
    _, saved = ranks
    for r in range(2):
        log = saved[("on", r)][1]
        n = log["buckets"]  # one per parameter: parameter i is in bucket n - 1 - i
        steps = _split_steps(log["events"])
        assert len(steps) == STEPS
        for events in steps:
            # the statistics go first, then every bucket once, in bucket order
            starts = [e[1] for e in events if e[0] == "start"]
            assert starts == ["stats", *range(n)]
            # Replay the rule "start bucket k once buckets 0..k are packed" on the observed
            # order in which gradients became ready (DataParallel's hook runs before the
            # recording one, so the starts a gradient triggers come just before its "ready");
            # the buckets of the unused parameters, and so all after them, start after backward.
            packed, expected = set(), []
            for i in [e[1] for e in events if e[0] == "ready"]:
                packed.add(n - 1 - i)
                started = sum(1 for e in expected if e[0] == "start")
                while started < n and started in packed:
                    expected.append(["start", started])
                    started += 1
                expected.append(["ready", i])
            started = sum(1 for e in expected if e[0] == "start")
            expected += [["start", k] for k in range(started, n)]
            assert events[1:] == expected, f"rank {r}"
            assert started == n - UNUSED  # every bucket of a used parameter left during backward
            # overlap happened: the first bucket left before the last gradient was ready
            last_ready = max(i for i, e in enumerate(events) if e[0] == "ready")
            assert events.index(["start", 0]) < last_ready


def test_without_overlap_buckets_start_after_backward(ranks):
    _, saved = ranks
    for r in range(2):
        for mode in ("off", "plain"):
            log = saved[(mode, r)][1]
            for events in _split_steps(log["events"]):
                ready = [e[1] for e in events if e[0] == "ready"]
                assert sorted(ready) == list(range(UNUSED, log["buckets"]))
                last_ready = max(i for i, e in enumerate(events) if e[0] == "ready")
                # with a plain loss.backward(), even the statistics wait for sync_gradients
                stats_at = 0 if mode == "off" else last_ready + 1
                assert events.index(["start", "stats"]) == stats_at
                after = [e for e in events[last_ready + 1 :] if e != ["start", "stats"]]
                assert after == [["start", k] for k in range(log["buckets"])], mode


def test_overlap_changes_no_result_and_ranks_stay_identical(ranks):
    device, saved = ranks
    reference = saved[("off", 0)][0]
    for mode in MODES:
        for r in range(2):
            got = saved[(mode, r)][0]
            for name in reference.files:
                np.testing.assert_array_equal(got[name], saved[(mode, 0)][0][name], err_msg=name)
                if device == "cpu":  # same packed bytes, same sums
                    np.testing.assert_array_equal(got[name], reference[name], err_msg=name)
                else:
                    np.testing.assert_allclose(got[name], reference[name], rtol=1e-5, atol=1e-6)
    # the unused layer's zero gradients left its weights where the broadcast put them
    for mode in MODES:
        got = saved[(mode, 0)][0]
        np.testing.assert_array_equal(got["arr_0"], got["unused_start"])


def test_batchnorm_statistics_are_those_of_the_global_batch(ranks):
    """The BatchNorm sees the raw input, so its statistics follow from the data alone: the
    running mean tracks the global batch mean, the variance the shard-weighted mean of the
    shards' (biased) variances."""
    _, saved = ranks
    mean, var = np.zeros(12), np.ones(12)
    local_mean = np.zeros(12)  # what rank 0 would hold without synchronisation
    for x, _ in make_batches(STEPS, BATCH):
        shards = np.array_split(x.astype(np.float64), 2)
        weights = [len(s) / len(x) for s in shards]
        mean = (1 - MOMENTUM) * mean + MOMENTUM * x.mean(0)
        var = (1 - MOMENTUM) * var + MOMENTUM * sum(
            w * s.var(0) for w, s in zip(weights, shards, strict=True)
        )
        local_mean = (1 - MOMENTUM) * local_mean + MOMENTUM * shards[0].mean(0)
    assert np.abs(local_mean - mean).max() > 1e-2  # the test data tells the two apart
    for mode in MODES:
        for r in range(2):
            got = saved[(mode, r)][0]
            np.testing.assert_allclose(got["running_mean"], mean, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got["running_var"], var, rtol=1e-5, atol=1e-6)


def _split_steps(events: list) -> list[list]:
    steps: list[list] = []
    for event in events:
        if event == ["step"]:
            steps.append([])
        else:
            steps[-1].append(event)
    return steps
