"""Tensor semantics and reverse-mode autodiff: graph order, accumulation, depth, no_grad."""

import numpy as np
import pytest
from helpers import tensor

import needle as ndl
from needle import autograd, ops

RNG = np.random.default_rng(2)


def test_topo_sort_puts_inputs_first_and_visits_each_node_once(device):
    a, b = tensor([1.0], device), tensor([2.0], device)
    c = a * b
    d = c + a
    e = d * c  # diamond: c reaches e directly and through d
    order = autograd.find_topo_sort([e])
    assert len(order) == len({id(n) for n in order}) == 5
    position = {id(n): i for i, n in enumerate(order)}
    for node in order:
        for inp in node.inputs:
            assert position[id(inp)] < position[id(node)]


def test_gradients_accumulate_over_every_use(device):
    x_np = RNG.standard_normal((3, 4)).astype(np.float32)
    x = tensor(x_np, device)
    y = (x * x + x * 3.0 - x / 2.0).sum()
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * x_np + 2.5, rtol=1e-5)


def test_composite_gradient_matches_finite_differences(device):
    """A small softmax-regression step: matmul, broadcast bias, relu, logsumexp, mean."""
    x_np = RNG.standard_normal((5, 4))
    w_np = RNG.standard_normal((4, 3))
    b_np = RNG.standard_normal((1, 3))

    def loss_np(w, b):
        h = np.maximum(x_np @ w + b, 0)
        return np.mean(np.log(np.exp(h).sum(1)) - h[:, 0])

    x, w, b = tensor(x_np, device, False), tensor(w_np, device), tensor(b_np, device)
    h = ops.relu(x @ w + ops.broadcast_to(b, (5, 3)))
    loss = (ops.logsumexp(h, (1,)) - ops.reshape(h[:, 0], (5,))).sum() / 5.0
    np.testing.assert_allclose(loss.numpy(), loss_np(w_np, b_np), rtol=1e-5)
    loss.backward()
    assert x.grad is None
    eps = 1e-6
    for param, value in [(w, w_np), (b, b_np)]:
        numeric = np.zeros_like(value)
        for idx in np.ndindex(*value.shape):
            old = value[idx]
            value[idx] = old + eps
            up = loss_np(w_np, b_np)
            value[idx] = old - eps
            down = loss_np(w_np, b_np)
            value[idx] = old
            numeric[idx] = (up - down) / (2 * eps)
        np.testing.assert_allclose(param.grad.numpy(), numeric, rtol=1e-3, atol=1e-4)


def test_deep_graph_needs_no_recursion(device):
    x = tensor([1.0, 2.0], device)
    y = x
    for _ in range(20000):
        y = y + 1.0
    y.sum().backward()
    np.testing.assert_array_equal(y.numpy(), [20001.0, 20002.0])
    np.testing.assert_array_equal(x.grad.numpy(), [1.0, 1.0])


def test_lazy_mode_defers_and_realizes_deep_graphs(device, monkeypatch):
    monkeypatch.setattr(autograd, "LAZY_MODE", True)
    x = tensor([1.0, -1.0], device)
    y = x
    for _ in range(5000):
        y = y * 1.0 + 1.0
    assert y.cached_data is None
    np.testing.assert_array_equal(y.numpy(), [5001.0, 4999.0])
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [1.0, 1.0])


def test_backward_defaults_to_ones_and_checks_shape(device):
    x_np = RNG.standard_normal((2, 3)).astype(np.float32)
    x = tensor(x_np, device)
    (x * x).backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * x_np, rtol=1e-6)
    with pytest.raises(ValueError, match=r"\(3,\).*\(2, 3\)"):
        (x * x).backward(tensor(np.ones(3), device))


def test_repeated_backward_recomputes_rather_than_accumulates(device):
    x = tensor([3.0], device)
    y = x * x
    y.backward()
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), [6.0])


def test_grads_are_detached_and_kept_on_leaves_only(device):
    x = tensor([1.0, 2.0], device)
    square = x * x
    square.sum().backward()
    assert x.grad.op is None and not x.grad.requires_grad
    assert square.grad is None  # inner adjoints are freed during backward, as in PyTorch


def test_no_grad_records_nothing(device):
    x = tensor([1.0, 2.0], device)
    with ndl.no_grad():
        y = x * 2.0 + x
    assert y.op is None and y.inputs == () and not y.requires_grad
    np.testing.assert_array_equal(y.numpy(), [3.0, 6.0])
    z = x * 2.0
    assert z.requires_grad and z.op is not None


def test_constants_do_not_build_a_graph(device):
    a = tensor([1.0, 2.0], device, requires_grad=False)
    b = ops.exp(a) + a
    assert not b.requires_grad and b.op is None
    x = tensor([1.0, 2.0], device)
    (b * x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.exp([1.0, 2.0]) + [1.0, 2.0], rtol=1e-6)
    assert a.grad is None


def test_detach_and_data(device):
    x = tensor([1.0, 2.0], device)
    y = x * 3.0
    d = y.detach()
    assert d.op is None and not d.requires_grad
    np.testing.assert_array_equal(d.numpy(), [3.0, 6.0])
    assert y.data.op is None
    x.data = tensor([5.0, 6.0], device, requires_grad=False)
    np.testing.assert_array_equal(x.numpy(), [5.0, 6.0])
    assert x.requires_grad


def test_comparisons_give_constant_masks(device):
    x_np = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    y_np = np.array([3.0, 2.0, 1.0], dtype=np.float32)
    x, y = tensor(x_np, device), tensor(y_np, device)
    for got, expected in [
        (x == y, x_np == y_np),
        (x != y, x_np != y_np),
        (x >= y, x_np >= y_np),
        (x > y, x_np > y_np),
        (x <= 2.0, x_np <= 2.0),
        (x < 2.0, x_np < 2.0),
    ]:
        assert not got.requires_grad and got.op is None
        np.testing.assert_array_equal(got.numpy(), expected.astype(np.float32))


def test_tensor_api_matches_numpy(device):
    a_np = RNG.standard_normal((2, 3)).astype(np.float32)
    b_np = RNG.uniform(0.5, 1.5, (2, 3)).astype(np.float32)
    a, b = tensor(a_np, device), tensor(b_np, device)
    assert a.shape == (2, 3) and a.dtype == "float32" and a.device == device
    assert a.ndim == 2 and len(a) == 2
    cases = [
        (a + b, a_np + b_np), (a - b, a_np - b_np), (a * b, a_np * b_np), (a / b, a_np / b_np),
        (b**a, b_np**a_np), (a**2, a_np**2), (-a, -a_np), (1.0 + a, 1.0 + a_np),
        (1.0 - a, 1.0 - a_np), (2.0 * a, 2.0 * a_np), (2.0 / b, 2.0 / b_np), (a - 1.0, a_np - 1),
        (a @ b.transpose(), a_np @ b_np.T), (a.sum(), a_np.sum()), (a.sum(0), a_np.sum(0)),
        (a.sum((1,), keepdims=True), a_np.sum(1, keepdims=True)), (a.max(1), a_np.max(1)),
        (a.reshape(3, 2), a_np.reshape(3, 2)), (a.reshape((6,)), a_np.reshape(6)),
        (a.transpose((0, 1)), a_np.T),
        (a.broadcast_to((4, 2, 3)), np.broadcast_to(a_np, (4, 2, 3))),
        (a[1], a_np[1]), (a[:, 1:], a_np[:, 1:]), (np.float32(2) - a, 2 - a_np),
        (np.float64(3) * a, 3 * a_np),
    ]  # fmt: skip
    for got, expected in cases:
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_tensor_construction_and_device_transfer(device):
    x_np = RNG.standard_normal((2, 2)).astype(np.float32)
    on_numpy = ndl.Tensor(x_np, device=ndl.cpu_numpy())
    moved = ndl.Tensor(on_numpy, device=device)
    assert moved.device == device
    np.testing.assert_array_equal(moved.numpy(), x_np)
    from_ints = ndl.Tensor(np.array([1, 2, 3]), device=device)  # labels: converted to float32
    np.testing.assert_array_equal(from_ints.numpy(), [1.0, 2.0, 3.0])
    from_list = ndl.Tensor([[1.5, 2.5]], device=device)
    assert from_list.shape == (1, 2)
    from_ndarray = ndl.Tensor(device.ones(2, 2), device=device)
    np.testing.assert_array_equal(from_ndarray.numpy(), np.ones((2, 2)))


def test_tensor_tuple_ops(device):
    a, b = tensor([1.0, 2.0], device), tensor([3.0], device)
    t = ops.make_tuple(a, b)
    assert len(t) == 2
    first, second = t
    assert first is a and second is b
    s = ops.split(tensor(np.arange(6).reshape(3, 2), device), 0)
    np.testing.assert_array_equal((s + s)[2].numpy(), [8.0, 10.0])
