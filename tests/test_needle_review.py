"""Misuse and numerics of checkpoint, optim, remote offload, train's CLI and needle.parallel,
against independent references: PyTorch (float64), numpy, and single-process runs for MPI."""
import importlib.util
import os
import textwrap

import numpy as np
import pytest
from parallel_scripts.mpi_run import launch as launch_ranks

import needle as ndl
from needle import checkpoint, nn, optim, remote
from needle.parallel import DataParallel, find_launcher, launch
from needle.train import main as train_main
from needle.train import parse_args

CPU = ndl.cpu()


def small_model(seed: int) -> nn.Module:
    np.random.seed(seed)
    return nn.Sequential(nn.Linear(4, 6, device=CPU), nn.BatchNorm1d(6, device=CPU), nn.ReLU(),
                         nn.Linear(6, 3, device=CPU))


def batches(n: int, rows: int = 8, seed: int = 3):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((rows, 4)).astype(np.float32),
             rng.integers(0, 3, rows).astype(np.float32)) for _ in range(n)]


def train(model, opt, data) -> None:
    for x, y in data:
        opt.reset_grad()
        nn.SoftmaxLoss()(model(ndl.Tensor(x, device=CPU)), ndl.Tensor(y, device=CPU)).backward()
        opt.step()


def assert_same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# ---------------------------------------------------------------- checkpoint


@pytest.mark.parametrize("make_opt", [
    lambda p: optim.Adam(p, lr=0.01, weight_decay=0.01),
    lambda p: optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
], ids=["adam", "sgd-momentum"])
def test_resumed_training_is_bit_identical_to_uninterrupted(tmp_path, make_opt):
    data = batches(4)
    model = small_model(0)
    opt = make_opt(model.parameters())
    train(model, opt, data[:2])
    path = str(tmp_path / "ckpt.npz")
    checkpoint.save(path, model, opt)
    # a fresh model (other weights) whose optimiser has stale state of its own
    clone = small_model(1)
    clone_opt = make_opt(clone.parameters())
    train(clone, clone_opt, batches(3, seed=9))
    checkpoint.load(path, clone, clone_opt)
    assert_same_state(clone.state_dict(), model.state_dict())
    assert_same_state(clone_opt.state_dict(), opt.state_dict())
    train(model, opt, data[2:])
    train(clone, clone_opt, data[2:])
    assert_same_state(clone.state_dict(), model.state_dict())
    assert_same_state(clone_opt.state_dict(), opt.state_dict())


def test_loading_state_replaces_stale_optimizer_slots():
    """An Adam state saved before any step (t = 0, no moments) loaded into an Adam that has
    stepped must behave like a fresh Adam, not keep the old moments."""
    data = batches(3)
    model = small_model(0)
    start = model.state_dict()
    saved = optim.Adam(model.parameters(), lr=0.01).state_dict()
    used = optim.Adam(model.parameters(), lr=0.01)
    train(model, used, data[:2])
    model.load_state_dict(start)
    used.load_state_dict(saved)
    train(model, used, data[2:])
    fresh_model = small_model(0)
    train(fresh_model, optim.Adam(fresh_model.parameters(), lr=0.01), data[2:])
    assert_same_state(model.state_dict(), fresh_model.state_dict())


def test_loaded_learning_rate_is_not_truncated_to_an_int():
    opt = optim.SGD([], lr=1)
    opt.load_state_dict({"lr": np.array(0.25)})
    assert opt.lr == 0.25


def test_failed_optimizer_load_leaves_model_and_optimizer_unchanged(tmp_path):
    path = str(tmp_path / "adam.npz")
    source = small_model(0)
    adam = optim.Adam(source.parameters(), lr=0.01)
    train(source, adam, batches(1))
    checkpoint.save(path, source, adam)
    target = small_model(1)
    before = target.state_dict()
    sgd = optim.SGD(target.parameters(), lr=0.5, momentum=0.9)
    with pytest.raises(KeyError, match="SGD state has no entry 'm.0'"):
        checkpoint.load(path, target, sgd)
    assert_same_state(target.state_dict(), before)
    assert sgd.lr == 0.5 and sgd.u == {}


def test_unreadable_or_foreign_checkpoints_are_refused_clearly(tmp_path):
    model = small_model(0)
    state = {f"model/{k}": v for k, v in model.state_dict().items()}
    npy = tmp_path / "array.npy"
    np.save(npy, np.zeros(3))
    with pytest.raises(ValueError, match="not a readable needle checkpoint .*npy"):
        checkpoint.load(str(npy), model)
    np.savez(tmp_path / "text.npz", **{**state, "model/0.weight": np.array(["x"])})
    with pytest.raises(ValueError, match="'model/0.weight' holds <U1, not numbers"):
        checkpoint.load(str(tmp_path / "text.npz"), model)
    np.savez(tmp_path / "lr.npz", **state, **{"optimizer/lr": np.array([0.1, 0.2])})
    opt = optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="setting 'lr' is not a number"):
        checkpoint.load(str(tmp_path / "lr.npz"), model, opt)
    np.savez(tmp_path / "neg.npz", **state, **{"optimizer/lr": np.array(-0.1)})
    with pytest.raises(ValueError, match=r"lr must lie in \[0.0, inf\), got -0.1"):
        checkpoint.load(str(tmp_path / "neg.npz"), model, opt)
    assert opt.lr == 0.1
    full = tmp_path / "full.npz"
    checkpoint.save(str(full), model)
    data = full.read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable needle checkpoint"):
        checkpoint.load(str(tmp_path / "cut.npz"), model)


def test_save_into_a_missing_folder_names_the_folder(tmp_path):
    target = tmp_path / "no" / "such" / "ckpt.npz"
    with pytest.raises(FileNotFoundError, match=f"folder {tmp_path / 'no' / 'such'} does not"):
        checkpoint.save(str(target), small_model(0))
    assert not (tmp_path / "no").exists()


def test_interrupted_save_keeps_the_old_checkpoint_and_leaves_no_temporary(tmp_path,
                                                                             monkeypatch):
    path = str(tmp_path / "ckpt.npz")
    old = small_model(0)
    checkpoint.save(path, old)
    real_savez = np.savez

    def dies_midway(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.np, "savez", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(path, small_model(1))
    monkeypatch.setattr(checkpoint.np, "savez", real_savez)
    assert os.listdir(tmp_path) == ["ckpt.npz"]
    restored = small_model(2)
    checkpoint.load(path, restored)
    assert_same_state(restored.state_dict(), old.state_dict())


def test_concurrent_saves_to_one_path_do_not_collide(tmp_path, monkeypatch):
    """Two savers of one path (data-parallel ranks, say), the second starting while the first
    writes: both finish and the file holds the last one renamed into place, whole."""
    path = str(tmp_path / "ckpt.npz")
    first, second = small_model(0), small_model(1)
    real_savez = np.savez
    calls = []

    def interleaved(f, **arrays):
        calls.append(1)
        if len(calls) == 1:
            checkpoint.save(path, second)  # the other saver runs while this one writes
        real_savez(f, **arrays)

    monkeypatch.setattr(checkpoint.np, "savez", interleaved)
    checkpoint.save(path, first)
    monkeypatch.setattr(checkpoint.np, "savez", real_savez)
    restored = small_model(2)
    checkpoint.load(path, restored)
    assert_same_state(restored.state_dict(), first.state_dict())
    assert os.listdir(tmp_path) == ["ckpt.npz"]


# ---------------------------------------------------------------- optim


def _needle_run(make_opt, W0, b0, X, T, steps):
    """Squared error of X W + b, plus a parameter given an explicit zero gradient and one that
    never gets a gradient."""
    W = nn.Parameter(ndl.Tensor(W0, device=CPU))
    b = nn.Parameter(ndl.Tensor(b0, device=CPU))
    z = nn.Parameter(ndl.Tensor(np.ones(3, np.float32), device=CPU))
    never = nn.Parameter(ndl.Tensor(np.ones(2, np.float32), device=CPU))
    opt = make_opt([W, b, z, never])
    x, t = ndl.Tensor(X, device=CPU), ndl.Tensor(T, device=CPU)
    for _ in range(steps):
        opt.reset_grad()
        y = ndl.ops.matmul(x, W) + ndl.ops.broadcast_to(b.reshape((1, 3)), T.shape)
        ((y - t) ** 2).sum().backward()
        z.grad = ndl.Tensor(np.zeros(3, np.float32), device=CPU)
        opt.step()
    return [p.numpy() for p in (W, b, z, never)]


def _torch_run(torch, make_opt, W0, b0, X, T, steps):
    W, b = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (W0, b0))
    z = torch.ones(3, dtype=torch.float64, requires_grad=True)
    never = torch.ones(2, dtype=torch.float64, requires_grad=True)
    opt = make_opt(torch, [W, b, z, never])
    x, t = torch.tensor(X, dtype=torch.float64), torch.tensor(T, dtype=torch.float64)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        ((x @ W + b - t) ** 2).sum().backward()
        z.grad = torch.zeros(3, dtype=torch.float64)
        opt.step()
    return [p.detach().numpy() for p in (W, b, z, never)]


@pytest.mark.parametrize("ours, theirs", [
    (lambda p: optim.Adam(p, lr=0.01),
     lambda torch, p: torch.optim.Adam(p, lr=0.01)),
    (lambda p: optim.Adam(p, lr=0.003, beta1=0.5, beta2=0.9, eps=1e-3, weight_decay=0.1),
     lambda torch, p: torch.optim.Adam(p, lr=0.003, betas=(0.5, 0.9), eps=1e-3, weight_decay=0.1)),
    (lambda p: optim.SGD(p, lr=0.01, weight_decay=0.2),
     lambda torch, p: torch.optim.SGD(p, lr=0.01, weight_decay=0.2)),
], ids=["adam", "adam-wd-betas", "sgd-wd"])
def test_optimisers_match_pytorch_over_several_steps(ours, theirs):
    torch = pytest.importorskip("torch")  # the bench extra, not the test one
    rng = np.random.default_rng(0)
    W0 = rng.standard_normal((5, 3)).astype(np.float32)
    b0 = rng.standard_normal(3).astype(np.float32)
    X = rng.standard_normal((7, 5)).astype(np.float32)
    T = rng.standard_normal((7, 3)).astype(np.float32)
    got = _needle_run(ours, W0, b0, X, T, steps=6)
    expected = _torch_run(torch, theirs, W0, b0, X, T, steps=6)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[3], np.ones(2))  # no gradient, never touched


@pytest.mark.parametrize("make, message", [
    (lambda p: optim.SGD(p, lr=-0.1), r"lr must lie in \[0.0, inf\), got -0.1"),
    (lambda p: optim.SGD(p, lr=float("nan")), "lr must lie in .*got nan"),
    (lambda p: optim.SGD(p, momentum=1.0), r"momentum must lie in \[0.0, 1.0\), got 1.0"),
    (lambda p: optim.SGD(p, momentum=-0.5), "momentum must lie in"),
    (lambda p: optim.SGD(p, weight_decay=-1), "weight_decay must lie in"),
    (lambda p: optim.Adam(p, beta1=1.0), r"beta1 must lie in \[0.0, 1.0\), got 1.0"),
    (lambda p: optim.Adam(p, beta2=1.5), "beta2 must lie in"),
    (lambda p: optim.Adam(p, eps=0.0), r"eps must lie in \(0.0, inf\), got 0.0"),
    (lambda p: optim.Adam(p + p), "more than once"),
], ids=["neg-lr", "nan-lr", "momentum-1", "neg-momentum", "neg-wd", "beta1-1", "beta2-1.5",
        "eps-0", "duplicate"])
def test_bad_hyperparameters_are_refused_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make(nn.Linear(2, 2, device=CPU).parameters())


def test_other_misuse_is_refused():
    layer = nn.Linear(2, 2, device=CPU)
    with pytest.raises(TypeError, match="not a single Tensor"):
        optim.SGD(layer.weight)  # would iterate rows (copies): a silent no-op optimiser
    with pytest.raises(TypeError, match=r"params\[1\] is a ndarray"):
        optim.SGD([layer.weight, np.ones(2)])
    with pytest.raises(ValueError, match="step_size must be at least 1"):
        optim.StepLR(optim.SGD([]), step_size=0)
    with pytest.raises(ValueError, match="total_steps must be at least 1"):
        optim.CosineLR(optim.SGD([]), total_steps=0)
    layer.weight.grad = ndl.Tensor(np.full((2, 2), 3.0, np.float32), device=CPU)
    for bad in (-1.0, 0.0, float("nan")):
        with pytest.raises(ValueError, match="max_norm must be positive"):
            optim.clip_grad_norm([layer.weight], bad)
    np.testing.assert_array_equal(layer.weight.grad.numpy(), np.full((2, 2), 3.0))


# ---------------------------------------------------------------- remote offload


class Executor:
    """Returns `fn(a, b)` for each product: a deliberately wrong executor."""

    def __init__(self, fn):
        self.fn = fn

    def matmul(self, a, b):
        return self.fn(a, b)


def test_offload_refuses_results_of_the_wrong_shape():
    a = ndl.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3), device=CPU)
    b = ndl.Tensor(np.ones((3, 4), np.float32), device=CPU)
    with remote.offload(Executor(lambda x, y: (x @ y).T)):  # same size, other shape
        with pytest.raises(ValueError, match=r"shape \(4, 2\) for a product of shape \(2, 4\)"):
            ndl.ops.matmul(a, b)
    a3 = ndl.Tensor(np.ones((2, 2, 3), np.float32), device=CPU)
    b3 = ndl.Tensor(np.ones((2, 3, 2), np.float32), device=CPU)
    with remote.offload(Executor(lambda x, y: (x @ y)[..., None])):
        with pytest.raises(ValueError, match=r"for a product of shape \(2, 2, 2\)"):
            ndl.ops.matmul(a3, b3)


def test_offload_of_broadcast_batches_matches_numpy():
    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((2, 1, 3, 4)).astype(np.float32)
    b_np = rng.standard_normal((3, 4, 5)).astype(np.float32)
    executor = remote.LocalExecutor()
    with remote.offload(executor):
        out = ndl.ops.matmul(ndl.Tensor(a_np, device=CPU), ndl.Tensor(b_np, device=CPU))
    assert executor.calls == 1
    expected = a_np.astype(np.float64) @ b_np.astype(np.float64)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_offload_arguments_are_checked_on_entry():
    with pytest.raises(TypeError, match="has no matmul"):
        with remote.offload(object()):
            pass
    with pytest.raises(ValueError, match="min_flops must be a non-negative number, got nan"):
        with remote.offload(remote.LocalExecutor(), min_flops=float("nan")):
            pass
    assert remote.active_offload() is None


# ---------------------------------------------------------------- train CLI


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "0"], "argument --epochs: must be positive, got 0"),
    (["--batch-size", "-3"], "argument --batch-size: must be positive, got -3"),
    (["--clip", "-1"], "argument --clip: must be positive, got -1"),
    (["--bptt", "0"], "argument --bptt: must be positive"),
    (["--save", "/nonexistent-dir/x.npz"], "--save: folder /nonexistent-dir does not exist"),
    (["--log", "/nonexistent-dir/m.csv"], "--log: folder /nonexistent-dir does not exist"),
])
def test_cli_refuses_bad_arguments_before_training(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_bad_optimizer_settings():
    with pytest.raises(ValueError, match="lr must lie in"):
        train_main(["--epochs", "1", "--lr", "-0.001"])
    with pytest.raises(ValueError, match="momentum must lie in"):
        train_main(["--epochs", "1", "--optimizer", "sgd", "--momentum", "1.5"])


# ---------------------------------------------------------------- parallel


def test_data_parallel_bucket_size_is_validated_and_tiny_sizes_work():
    from parallel_scripts.common import make_batches, make_model, reference_gradients

    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="bucket_mb must be positive"):
            DataParallel(make_model(seed=0), bucket_mb=bad)
    x, y = make_batches(1, 5)[0]
    model = DataParallel(make_model(seed=0), bucket_mb=1e-7)  # once 0 bytes: refused
    loss = nn.SoftmaxLoss()(model(ndl.Tensor(x, device=CPU)), ndl.Tensor(y, device=CPU))
    model.backward(loss, model.local_fraction(len(x)))
    for p, expected in zip(model.parameters(), reference_gradients(0, x, y), strict=True):
        np.testing.assert_array_equal(p.grad.numpy(), expected)  # world of one: same bytes


def test_launcher_cli_refuses_bad_arguments(capsys, tmp_path):
    with pytest.raises(SystemExit):
        launch.main(["-n", "0", __file__])
    assert "number of processes must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch.main(["-n", "2", str(tmp_path / "missing.py")])
    assert "no script" in capsys.readouterr().err


NEEDS_MPI = pytest.mark.skipif(find_launcher() is None or importlib.util.find_spec("mpi4py")
                               is None, reason="no MPI launcher or no mpi4py")


@NEEDS_MPI
def test_a_rank_that_dies_aborts_the_job_instead_of_hanging(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(textwrap.dedent("""
        from mpi4py import MPI
        if MPI.COMM_WORLD.rank == 1:
            raise RuntimeError("rank 1 gives up")
        MPI.COMM_WORLD.Barrier()  # rank 0 waits here for a rank that is gone
    """))
    code, output = launch_ranks(script)
    assert code != 0
    assert "rank 1 gives up" in output


DP_SCRIPT = """
import sys
import numpy as np
import needle as ndl
from needle import nn
from needle.parallel import DataParallel

out, CPU = sys.argv[1], ndl.cpu()
rng = np.random.default_rng(1)
x = rng.standard_normal((5, 4)).astype(np.float32)
y = np.array([0, 1, 2, 1, 0], np.float32)
np.random.seed(0)
mlp = DataParallel(nn.Sequential(nn.Linear(4, 6, device=CPU), nn.Tanh(),
                                 nn.Linear(6, 3, device=CPU)), bucket_mb=1e-6)
xl, yl = mlp.shard(x), mlp.shard(y)  # 3 rows and 2 rows
loss = nn.SoftmaxLoss()(mlp(ndl.Tensor(xl, device=CPU)), ndl.Tensor(yl, device=CPU))
mlp.backward(loss, mlp.local_fraction(len(x)))
norm = DataParallel(nn.BatchNorm1d(4, device=CPU))  # the wrapped module is the BatchNorm
h = norm(ndl.Tensor(xl, device=CPU))
norm.backward((h * h).sum() / len(xl), norm.local_fraction(len(x)))
np.savez(f"{out}/rank{mlp.comm.rank}.npz", *[p.grad.numpy() for p in mlp.parameters()],
         norm.module.running_mean.numpy(), norm.module.running_var.numpy())
"""


@NEEDS_MPI
def test_two_ranks_with_uneven_shards_match_one_process(tmp_path):
    script = tmp_path / "dp.py"
    script.write_text(DP_SCRIPT)
    code, output = launch_ranks(script, tmp_path)
    assert code == 0, output
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    got = [[f[f"arr_{i}"] for i in range(len(f.files))] for f in ranks]
    for name in ranks[0].files:
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name])
    # single process: the whole batch through the same model
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = np.array([0, 1, 2, 1, 0], np.float32)
    np.random.seed(0)
    mlp = nn.Sequential(nn.Linear(4, 6, device=CPU), nn.Tanh(), nn.Linear(6, 3, device=CPU))
    nn.SoftmaxLoss()(mlp(ndl.Tensor(x, device=CPU)), ndl.Tensor(y, device=CPU)).backward()
    for g, p in zip(got[0][:4], mlp.parameters(), strict=True):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-5, atol=1e-6)
    # running statistics: momentum 0.1 from (0, 1); the mean of the whole batch, and the
    # shard-weighted biased variances (see docs/parallel.md)
    shards = np.array_split(x.astype(np.float64), 2)
    var = sum(len(s) / len(x) * s.var(axis=0) for s in shards)
    np.testing.assert_allclose(got[0][4], 0.1 * x.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[0][5], 0.9 + 0.1 * var, rtol=1e-5, atol=1e-6)
