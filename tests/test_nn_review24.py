"""Review 24 of needle's layers, optimisers and training CLI: each test failed before its fix."""
import csv
import json

import numpy as np
import pytest

import needle as ndl
from needle import nn, optim
from needle.train import main

CPU = ndl.cpu()


def test_clip_grad_norm_clips_a_finite_gradient_whose_float32_squares_overflow():
    """Entries of 1e20 are finite, but their float32 squares are inf: clipping refused them
    as "non-finite gradients", though an exploding gradient is what it is for."""
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(shape).astype(np.float32) * np.float32(1e20)
             for shape in ((3, 4), (5,))]
    params = [nn.Parameter(ndl.Tensor(np.zeros_like(g), device=CPU)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = ndl.Tensor(g, device=CPU)
    expected = np.sqrt(sum(np.square(g.astype(np.float64)).sum() for g in grads))

    assert optim.clip_grad_norm(params, 1.0) == pytest.approx(expected, rel=1e-6)
    clipped = [p.grad.numpy().astype(np.float64) for p in params]
    assert np.sqrt(sum(np.square(c).sum() for c in clipped)) == pytest.approx(1.0, rel=1e-5)
    for c, g in zip(clipped, grads, strict=True):  # the direction is kept
        np.testing.assert_allclose(c, g / expected, rtol=1e-5)


def test_clip_grad_norm_still_refuses_an_infinite_gradient():
    p = nn.Parameter(ndl.Tensor(np.zeros(3, dtype=np.float32), device=CPU))
    p.grad = ndl.Tensor(np.array([1.0, np.inf, 2.0], dtype=np.float32), device=CPU)
    with pytest.raises(FloatingPointError, match="non-finite"):
        optim.clip_grad_norm([p], 1.0)


def read_log(path):
    with open(path, newline="") as f:
        if path.endswith(".json"):
            return json.load(f)
        return [{k: int(v) if k == "epoch" else float(v) for k, v in row.items()}
                for row in csv.DictReader(f)]


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_resuming_with_the_same_log_keeps_the_epochs_logged_before(tmp_path, suffix):
    """The same command with --resume continues an interrupted run: its log held only the
    resumed epochs, the earlier ones overwritten."""
    log, ckpt = str(tmp_path / f"metrics{suffix}"), str(tmp_path / "run.npz")
    common = ["--data", "digits", "--model", "mlp", "--log", log, "--save", ckpt]
    first = main(common + ["--epochs", "2"])
    resumed = main(common + ["--epochs", "3", "--resume", ckpt])

    assert [row["epoch"] for row in resumed] == [3]
    rows = read_log(log)
    assert [row["epoch"] for row in rows] == [1, 2, 3]
    for row, expected in zip(rows, first + resumed, strict=True):
        assert row == pytest.approx(expected)


def test_resuming_drops_logged_epochs_the_checkpoint_does_not_hold(tmp_path):
    """Rows past the checkpoint's epochs (a longer earlier run) are replaced, not kept twice."""
    log, ckpt = str(tmp_path / "metrics.json"), str(tmp_path / "run.npz")
    common = ["--data", "digits", "--model", "mlp", "--log", log]
    main(common + ["--epochs", "1", "--save", ckpt])
    main(["--data", "digits", "--model", "mlp", "--epochs", "3", "--log", log])
    main(common + ["--epochs", "2", "--resume", ckpt])
    assert [row["epoch"] for row in read_log(log)] == [1, 2]


def test_resuming_refuses_a_log_it_cannot_continue_before_training(tmp_path):
    log, ckpt = tmp_path / "metrics.json", str(tmp_path / "run.npz")
    main(["--data", "digits", "--model", "mlp", "--epochs", "1", "--save", ckpt])
    before = (tmp_path / "run.npz").read_bytes()
    log.write_text("{not json")
    with pytest.raises(ValueError, match="--log .*metrics.json"):
        main(["--data", "digits", "--model", "mlp", "--epochs", "2", "--resume", ckpt,
              "--save", ckpt, "--log", str(log)])
    assert (tmp_path / "run.npz").read_bytes() == before  # no epoch was trained
    assert log.read_text() == "{not json"
