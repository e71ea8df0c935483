"""GPipe: 2 stages x 4 micro-batches give the gradients of the unsplit model on the whole batch."""
import numpy as np
import pytest
from parallel_scripts.common import CPU, make_batches, make_stages, reference_gradients
from parallel_scripts.mpi_run import LAUNCHER, run_mpi

import needle as ndl
from needle import nn
from needle.parallel import Pipeline, gpipe_schedule


@pytest.mark.parametrize("stages, micro", [(1, 1), (2, 4), (3, 2), (4, 5)])
def test_schedule_runs_every_task_once_after_its_inputs(stages, micro):
    schedule = gpipe_schedule(stages, micro)
    assert len(schedule) == 2 * (stages + micro - 1)
    when = {}
    for tick, tasks in enumerate(schedule):
        assert len({t.stage for t in tasks}) == len(tasks)  # a stage does one thing per tick
        for task in tasks:
            assert task not in when
            when[task] = tick
    for s in range(stages):
        for m in range(micro):
            f, b = when[("F", s, m)], when[("B", s, m)]
            assert s == 0 or f > when[("F", s - 1, m)]
            assert s == stages - 1 or b > when[("B", s + 1, m)]
            assert b > max(t for (phase, _, _), t in when.items() if phase == "F")
    assert len(when) == 2 * stages * micro


@pytest.mark.parametrize(
    "batch, devices",
    [
        (8, (ndl.cpu(), ndl.cpu_numpy())),
        (10, (ndl.cpu(), ndl.cpu_numpy())),  # micro-batches of 3, 3, 2, 2 rows
        pytest.param(
            10,
            (ndl.cpu(), ndl.cuda()),
            marks=pytest.mark.skipif(not ndl.cuda().enabled(), reason="no CUDA GPU here"),
        ),
    ],
    ids=["even", "uneven", "cpu-cuda"],
)
def test_two_stages_four_micro_batches_match_unsplit(batch, devices):
    (x, y), = make_batches(1, batch)
    pipe = Pipeline(make_stages(seed=5), devices, micro_batches=4)
    loss = pipe.forward_backward(x, y, nn.SoftmaxLoss())
    expected = reference_gradients(seed=5, x=x, y=y, device=ndl.cpu())
    rtol = 1e-4 if ndl.cuda() in devices else 1e-5
    for p, e in zip(pipe.parameters(), expected, strict=True):
        np.testing.assert_allclose(p.grad.numpy(), e, rtol=rtol, atol=1e-6)
    model = nn.Sequential(*make_stages(seed=5))
    full = nn.SoftmaxLoss()(model(ndl.Tensor(x, device=CPU)), ndl.Tensor(y, device=CPU)).numpy()
    np.testing.assert_allclose(loss, full, rtol=1e-5)


@pytest.mark.skipif(LAUNCHER is None, reason="no MPI launcher (mpiexec/mpirun) found")
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",  # stage 0 on one GPU, stage 1 on the other
            marks=pytest.mark.skipif(
                not (ndl.cuda().enabled() and ndl.cuda().device_count() >= 2),
                reason="needs 2 CUDA GPUs",
            ),
        ),
    ],
)
def test_one_stage_per_rank_matches_unsplit(tmp_path, device):
    batch = 10
    run_mpi("pipeline_mpi.py", tmp_path, 4, batch, device)
    (x, y), = make_batches(1, batch)
    expected = reference_gradients(seed=0, x=x, y=y, device=ndl.cpu())
    got = []
    for r in range(2):
        grads = np.load(tmp_path / f"stage{r}.npz")
        got += [grads[f"arr_{i}"] for i in range(len(grads.files))]
    rtol = 1e-5 if device == "cpu" else 1e-4
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=rtol, atol=1e-6)
    losses = {float((tmp_path / f"loss{r}.txt").read_text()) for r in range(2)}
    assert len(losses) == 1


def test_bad_batches_are_refused():
    pipe = Pipeline(make_stages(seed=0), [ndl.cpu(), ndl.cpu()], micro_batches=4)
    x, y = np.zeros((3, 12), np.float32), np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="cannot make 4 micro-batches"):
        pipe.forward_backward(x, y, nn.SoftmaxLoss())
    with pytest.raises(ValueError, match="rows but targets have"):
        pipe.forward_backward(np.zeros((8, 12), np.float32), y, nn.SoftmaxLoss())
    with pytest.raises(ValueError, match="micro_batches must be at least 1"):
        Pipeline(make_stages(seed=0), [ndl.cpu(), ndl.cpu()], micro_batches=0)


def test_a_weight_tied_between_stages_is_one_parameter_with_both_gradients():
    """A weight two stages share (tied embeddings, say) was listed twice, so an optimiser
    refused the list; its gradient is the sum of both stages' contributions."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    y = np.array([0, 1, 2, 3, 0, 1], np.float32)
    first, last = nn.Linear(4, 4, device=CPU), nn.Linear(4, 4, device=CPU)
    last.weight = first.weight
    pipe = Pipeline([first, nn.Sequential(nn.Tanh(), last)], [CPU, CPU], micro_batches=3)
    assert [id(p) for p in pipe.parameters()] == [id(first.weight), id(first.bias),
                                                 id(last.bias)]
    pipe.forward_backward(x, y, nn.SoftmaxLoss())
    got = [p.grad.numpy() for p in pipe.parameters()]
    whole = nn.Sequential(first, nn.Tanh(), last)
    for p in whole.parameters():
        p.grad = None
    nn.SoftmaxLoss()(whole(ndl.Tensor(x, device=CPU)), ndl.Tensor(y, device=CPU)).backward()
    for g, p in zip(got, whole.parameters(), strict=True):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-5, atol=1e-6)
    ndl.optim.SGD(pipe.parameters(), lr=0.1).step()  # refused before: a parameter twice
