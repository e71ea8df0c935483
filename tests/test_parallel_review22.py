"""needle.parallel review 22: a local_fraction that is not a number is refused on every rank at
once; the pipeline on 3 ranks matches one process, refuses needle.no_grad() on every rank, and
names the stages when their shapes do not fit.

Every case launches tests/parallel_scripts/review22.py under `mpiexec` (bounded by
mpi_run.TIMEOUT_S, the process group killed on expiry); the ranks' communicators give up after
review22.TIMEOUT_S, so a rank left waiting shows as a TimeoutError or a slow refusal.
"""
import json
import time

import numpy as np
import pytest
from parallel_scripts.mpi_run import LAUNCHER, SCRIPTS, launch, run_mpi
from parallel_scripts.review22 import SGD_STEPS, TIMEOUT_S, batches, make_optimizer, make_stages

import needle as ndl
from needle import nn

pytestmark = pytest.mark.skipif(LAUNCHER is None, reason="no MPI launcher or no mpi4py")
PROMPT_S = TIMEOUT_S / 2  # a refusal that took longer waited for a peer


def _reports(tmp_path, name: str, nprocs: int) -> list[dict]:
    return [json.loads((tmp_path / f"{name}{r}.json").read_text()) for r in range(nprocs)]


def test_a_local_fraction_that_is_not_a_number_is_refused_on_every_rank_at_once(tmp_path):
    run_mpi("review22.py", "fraction", tmp_path)
    reports = _reports(tmp_path, "fraction", 2)
    own = {"string": "str '0.5'", "tensor": "Tensor needle.Tensor([0.5])", "bool": "bool True"}
    for name, given in own.items():
        expected = [
            f"ValueError: local_fraction must be a number in [0, 1], got {given}; "
            "no gradient was synchronised",
            "ValueError: local_fraction lies outside [0, 1] on another of the 2 ranks; "
            "no gradient was synchronised",
        ]
        for r, report in enumerate(reports):
            assert report[name]["outcome"] == expected[r], (name, r)
            assert report[name]["seconds"] < PROMPT_S, (name, r, report[name])
    # no rank was left behind: the next step synchronises, identically
    assert [report["good"]["outcome"] for report in reports] == ["returned", "returned"]
    assert reports[0]["grads"] == reports[1]["grads"]


def _one_process_reference() -> tuple[list[float], list[np.ndarray]]:
    """The same stages as one model, trained on the same batches in this process."""
    model = nn.Sequential(*make_stages())
    opt = make_optimizer(model.parameters())
    losses = []
    for x, y in batches(SGD_STEPS + 1):
        opt.reset_grad()
        loss = nn.SoftmaxLoss()(model(ndl.Tensor(x, device=ndl.cpu())),
                                ndl.Tensor(y, device=ndl.cpu()))
        losses.append(loss.numpy().item())
        loss.backward()
        opt.step()
    return losses, [p.numpy() for p in model.parameters()]


def test_pipeline_on_three_ranks_matches_one_process_and_refuses_no_grad_everywhere(tmp_path):
    run_mpi("review22.py", "pipeline", tmp_path, nprocs=3)
    reports = _reports(tmp_path, "pipeline", 3)
    losses, params = _one_process_reference()
    for r, report in enumerate(reports):
        assert report["ranks"]["outcome"] == "ValueError: 2 stages need 2 ranks, got 3", r
        assert report["no_grad"]["outcome"] == (
            "RuntimeError: Pipeline.forward_backward computes gradients; call it outside "
            "needle.no_grad()"
        ), r
        assert report["no_grad"]["seconds"] < PROMPT_S, r
        np.testing.assert_allclose(report["losses"], losses, rtol=1e-5, err_msg=f"rank {r}")
    assert reports[1]["params"] == []  # the middle stage (Tanh) has none
    got = [np.array(p) for report in reports for p in report["params"]]
    assert len(got) == len(params)
    for g, e in zip(got, params, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_stages_whose_shapes_do_not_fit_are_named_and_the_job_ends(tmp_path):
    start = time.monotonic()
    code, output = launch(SCRIPTS / "review22.py", "mismatch", tmp_path, cwd=SCRIPTS)
    elapsed = time.monotonic() - start
    assert code != 0, output
    assert elapsed < 60, output  # rank 0's own timeout: the abort must come first
    message = (
        "pipeline stage 1 failed in the forward of micro-batch 0 on an input of shape (3, 16) "
        "from stage 0: ValueError: Linear expects input of shape (..., 20), got (3, 16)"
    )
    assert (tmp_path / "mismatch1.txt").read_text() == f"RuntimeError: {message}", output
    assert message in output
    assert not (tmp_path / "mismatch0.txt").exists()  # rank 0 was waiting, not failing
