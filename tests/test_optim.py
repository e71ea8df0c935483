"""Optimisers, schedules and clipping against numpy re-implementations of their update rules."""
import math

import numpy as np
import pytest
from helpers import tensor

from needle import nn, optim


def quadratic_problem(device):
    """A Linear layer and a fixed loss whose gradients change with the weights."""
    np.random.seed(0)
    layer = nn.Linear(4, 3, device=device)
    X = np.random.randn(8, 4)
    T = np.random.randn(8, 3)

    def grads(W, b):
        """Gradients of mean((X W + b - T)^2) in numpy."""
        d = 2 * (X @ W + b - T) / T.size
        return X.T @ d, d.sum(0, keepdims=True)

    def step_needle(opt):
        opt.reset_grad()
        nn.MSELoss()(layer(tensor(X, device, False)), tensor(T, device, False)).backward()
        opt.step()

    return layer, grads, step_needle


def test_sgd_momentum_and_weight_decay_match_numpy(device):
    layer, grads, step = quadratic_problem(device)
    lr, momentum, wd = 0.1, 0.9, 0.01
    opt = optim.SGD(layer.parameters(), lr=lr, momentum=momentum, weight_decay=wd)
    params = [layer.weight.numpy().astype(np.float64), layer.bias.numpy().astype(np.float64)]
    u = [np.zeros_like(p) for p in params]
    for _ in range(5):
        step(opt)
        for i, g in enumerate(grads(*params)):
            g = g + wd * params[i]
            u[i] = momentum * u[i] + (1 - momentum) * g
            params[i] = params[i] - lr * u[i]
    np.testing.assert_allclose(layer.weight.numpy(), params[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(layer.bias.numpy(), params[1], rtol=1e-4, atol=1e-5)


def test_plain_sgd_is_gradient_descent(device):
    layer, grads, step = quadratic_problem(device)
    W, b = layer.weight.numpy().astype(np.float64), layer.bias.numpy().astype(np.float64)
    step(optim.SGD(layer.parameters(), lr=0.5))
    gW, gb = grads(W, b)
    np.testing.assert_allclose(layer.weight.numpy(), W - 0.5 * gW, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.bias.numpy(), b - 0.5 * gb, rtol=1e-5, atol=1e-6)


def test_adam_matches_numpy_with_bias_correction(device):
    layer, grads, step = quadratic_problem(device)
    lr, b1, b2, eps, wd = 0.01, 0.8, 0.9, 1e-8, 0.05
    opt = optim.Adam(layer.parameters(), lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
    params = [layer.weight.numpy().astype(np.float64), layer.bias.numpy().astype(np.float64)]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for t in range(1, 6):
        step(opt)
        for i, g in enumerate(grads(*params)):
            g = g + wd * params[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat, v_hat = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            params[i] = params[i] - lr * m_hat / (np.sqrt(v_hat) + eps)
    np.testing.assert_allclose(layer.weight.numpy(), params[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(layer.bias.numpy(), params[1], rtol=1e-4, atol=1e-5)


def test_optimisers_skip_parameters_without_gradients(device):
    used, unused = nn.Linear(2, 2, device=device), nn.Linear(2, 2, device=device)
    before = unused.weight.numpy().copy()
    opt = optim.Adam(used.parameters() + unused.parameters(), lr=0.1)
    used(tensor(np.ones((1, 2)), device)).sum().backward()
    opt.step()
    np.testing.assert_array_equal(unused.weight.numpy(), before)
    opt.reset_grad()
    assert all(p.grad is None for p in opt.params)


def test_learning_rate_schedules():
    opt = optim.SGD([], lr=1.0)
    step_lr = optim.StepLR(opt, step_size=2, gamma=0.5)
    seen = []
    for _ in range(5):
        step_lr.step()
        seen.append(opt.lr)
    assert seen == [1.0, 0.5, 0.5, 0.25, 0.25]
    opt = optim.SGD([], lr=0.1)
    cosine = optim.CosineLR(opt, total_steps=4, min_lr=0.01)
    expected = [0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * t / 4)) for t in (1, 2, 3, 4, 4)]
    got = []
    for _ in range(5):
        cosine.step()
        got.append(opt.lr)
    assert got == pytest.approx(expected)


def test_clip_grad_norm_scales_to_max_norm(device):
    a, b = nn.Parameter(tensor(np.zeros(3), device)), nn.Parameter(tensor(np.zeros(4), device))
    a.grad = tensor([3.0, 0.0, 4.0], device, False)
    b.grad = tensor([0.0, 12.0, 0.0, 0.0], device, False)
    assert optim.clip_grad_norm([a, b], max_norm=6.5) == pytest.approx(13.0)
    np.testing.assert_allclose(a.grad.numpy(), [1.5, 0, 2.0], rtol=1e-5)
    np.testing.assert_allclose(b.grad.numpy(), [0, 6.0, 0, 0], rtol=1e-5)
    assert optim.clip_grad_norm([a, b], max_norm=100.0) == pytest.approx(6.5, rel=1e-5)
    np.testing.assert_allclose(a.grad.numpy(), [1.5, 0, 2.0], rtol=1e-5)  # below: untouched
    a.grad = tensor([np.nan, 0.0, 0.0], device, False)
    with pytest.raises(FloatingPointError, match="non-finite"):
        optim.clip_grad_norm([a, b], 1.0)


def test_optimizer_state_round_trip_continues_identically(device):
    layer, _, step = quadratic_problem(device)
    opt = optim.Adam(layer.parameters(), lr=0.05)
    for _ in range(3):
        step(opt)
    saved_params, saved_state = layer.state_dict(), opt.state_dict()
    assert saved_state["t"] == 3 and sorted(saved_state) == [
        "beta1", "beta2", "eps", "lr", "m.0", "m.1", "num_params", "t", "v.0", "v.1",
        "weight_decay"]
    step(opt)
    after_one_more = layer.weight.numpy().copy()
    layer.load_state_dict(saved_params)
    fresh = optim.Adam(layer.parameters(), lr=0.05)
    fresh.load_state_dict(saved_state)
    step(fresh)
    np.testing.assert_allclose(layer.weight.numpy(), after_one_more, rtol=1e-6, atol=1e-7)


def test_optimizer_state_rejects_mismatch_and_changes_nothing(device):
    layer = nn.Linear(2, 3, device=device)
    opt = optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"'u.0' has shape \(3, 2\), parameter 0 has shape"):
        opt.load_state_dict({"lr": np.array(0.5), "u.0": np.zeros((3, 2), dtype=np.float32)})
    assert opt.lr == 0.1 and opt.u == {}
    with pytest.raises(KeyError, match="no entry 'u.7'"):
        opt.load_state_dict({"u.7": np.zeros((2, 3), dtype=np.float32)})
    with pytest.raises(KeyError, match="no setting 'beta9'"):
        opt.load_state_dict({"beta9": np.array(1.0)})
