"""Every op: forward against numpy (float64), gradient against finite differences of numpy."""

import numpy as np
import pytest

import needle as ndl
from needle import ops

RNG = np.random.default_rng(0)


def _tensor(x: np.ndarray, device, view: bool) -> ndl.Tensor:
    """A leaf tensor; with view=True the op sees a non-contiguous strided view of it."""
    if not view:
        return ndl.Tensor(x, device=device)
    if x.ndim >= 2:  # stored transposed, viewed back through a transpose op
        return ops.transpose(ndl.Tensor(np.swapaxes(x, -1, -2), device=device))
    padded = np.zeros((x.size * 2,))
    padded[::2] = x
    return ops.getitem(ndl.Tensor(padded, device=device), slice(None, None, 2))


def _numeric_grad(f, inputs: list[np.ndarray], weights: np.ndarray, eps: float = 1e-6):
    """Central differences of sum(f(*inputs) * weights) in float64."""
    grads = []
    for x in inputs:
        grad = np.zeros_like(x)
        for idx in np.ndindex(*x.shape):
            old = x[idx]
            x[idx] = old + eps
            up = np.sum(f(*inputs) * weights)
            x[idx] = old - eps
            down = np.sum(f(*inputs) * weights)
            x[idx] = old
            grad[idx] = (up - down) / (2 * eps)
        grads.append(grad)
    return grads


def check_op(device, fn, ref, inputs, *, view=False, tol=1e-4, grad_tol=2e-3):
    """fn(*tensors) matches ref(*arrays) forward, and its gradients match finite differences."""
    inputs = [np.asarray(x, dtype=np.float32).astype(np.float64) for x in inputs]
    tensors = [_tensor(x, device, view) for x in inputs]
    out = fn(*tensors)
    expected = ref(*inputs)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out.numpy(), expected, rtol=tol, atol=tol)

    weights = RNG.standard_normal(expected.shape)
    out.backward(ndl.Tensor(weights, device=device))
    for tensor, grad in zip(tensors, _numeric_grad(ref, inputs, weights), strict=True):
        leaf = tensor.inputs[0] if view else tensor
        got = leaf.grad.numpy()
        if view:
            got = np.swapaxes(got, -1, -2) if grad.ndim >= 2 else got[::2]
        np.testing.assert_allclose(got, grad, rtol=grad_tol, atol=grad_tol)


def randn(*shape):
    return RNG.standard_normal(shape)


def positive(*shape):
    return RNG.uniform(0.5, 2.0, shape)


@pytest.mark.parametrize("view", [False, True], ids=["compact", "view"])
@pytest.mark.parametrize(
    "fn, ref, make",
    [
        (ops.add, np.add, lambda: [randn(3, 4), randn(3, 4)]),
        (ops.multiply, np.multiply, lambda: [randn(2, 3, 4), randn(2, 3, 4)]),
        (ops.divide, np.divide, lambda: [randn(5, 3), positive(5, 3)]),
        (ops.power, np.power, lambda: [positive(4, 3), randn(4, 3)]),
        (lambda a, b: a - b, np.subtract, lambda: [randn(4, 2), randn(4, 2)]),
        (lambda a, b: a @ b, np.matmul, lambda: [randn(5, 3), randn(3, 4)]),
        (ops.matmul, np.matmul, lambda: [randn(2, 5, 3), randn(2, 3, 4)]),
        (ops.matmul, np.matmul, lambda: [randn(3, 2, 5, 3), randn(3, 4)]),
        (ops.matmul, np.matmul, lambda: [randn(5, 3), randn(2, 3, 4)]),
        (ops.matmul, np.matmul, lambda: [randn(2, 1, 2, 3), randn(3, 3, 2)]),
    ],
    ids=["add", "mul", "div", "pow", "sub", "matmul", "bmm", "bmm_2d", "2d_bmm", "bmm_bcast"],
)
def test_binary_ops(device, fn, ref, make, view):
    check_op(device, fn, ref, make(), view=view)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


@pytest.mark.parametrize("view", [False, True], ids=["compact", "view"])
@pytest.mark.parametrize(
    "fn, ref, make",
    [
        (lambda a: ops.add_scalar(a, 1.5), lambda x: x + 1.5, randn),
        (lambda a: ops.mul_scalar(a, -2.5), lambda x: x * -2.5, randn),
        (lambda a: ops.divide_scalar(a, 4.0), lambda x: x / 4.0, randn),
        (lambda a: ops.power_scalar(a, 3), lambda x: x**3, randn),
        (lambda a: ops.power_scalar(a, 0.5), np.sqrt, positive),
        (lambda a: 2.0 / a, lambda x: 2.0 / x, positive),
        (lambda a: 1.0 - a, lambda x: 1.0 - x, randn),
        (ops.negate, np.negative, randn),
        (ops.log, np.log, positive),
        (ops.exp, np.exp, randn),
        (ops.relu, lambda x: np.maximum(x, 0), randn),
        (ops.tanh, np.tanh, randn),
        (ops.sigmoid, _sigmoid, randn),
        (ops.sqrt, np.sqrt, positive),
    ],
    ids=[
        "add_s", "mul_s", "div_s", "pow3", "pow_half", "rdiv", "rsub",
        "neg", "log", "exp", "relu", "tanh", "sigmoid", "sqrt",
    ],
)  # fmt: skip
def test_unary_ops(device, fn, ref, make, view):
    check_op(device, fn, ref, [make(3, 5)], view=view)


@pytest.mark.parametrize("view", [False, True], ids=["compact", "view"])
@pytest.mark.parametrize(
    "fn, ref, shape",
    [
        (ops.transpose, lambda x: np.swapaxes(x, -1, -2), (3, 4, 5)),
        (lambda a: ops.transpose(a, (0, 2)), lambda x: np.swapaxes(x, 0, 2), (3, 4, 5)),
        (lambda a: ops.reshape(a, (6, 2)), lambda x: x.reshape(6, 2), (3, 4)),
        (lambda a: ops.reshape(a, (2, -1, 3)), lambda x: x.reshape(2, -1, 3), (3, 4)),
        (lambda a: ops.broadcast_to(a, (2, 3, 4)), lambda x: np.broadcast_to(x, (2, 3, 4)), (3, 1)),
        (lambda a: ops.broadcast_to(a, (3, 4)), lambda x: np.broadcast_to(x, (3, 4)), (1, 4)),
        (lambda a: ops.summation(a), lambda x: np.sum(x), (3, 4)),
        (lambda a: ops.summation(a, 1), lambda x: np.sum(x, 1), (3, 4, 2)),
        (lambda a: ops.summation(a, (0, 2)), lambda x: np.sum(x, (0, 2)), (3, 4, 2)),
        (lambda a: a.sum((1,), keepdims=True), lambda x: x.sum(1, keepdims=True), (3, 4, 2)),
        (lambda a: ops.max(a, 1), lambda x: np.max(x, 1), (3, 4, 2)),
        (lambda a: ops.max(a), lambda x: np.max(x), (3, 4)),
        (lambda a: ops.max(a, (0, 2), keepdims=True), lambda x: x.max((0, 2), keepdims=True),
         (3, 4, 2)),
        (lambda a: ops.logsumexp(a, (1,)), lambda x: np.log(np.exp(x).sum(1)), (3, 4, 2)),
        (lambda a: ops.logsumexp(a), lambda x: np.log(np.exp(x).sum()), (3, 4)),
        (lambda a: ops.logsumexp(a, (0, 2)), lambda x: np.log(np.exp(x).sum((0, 2))), (3, 4, 2)),
        (lambda a: a[1:3, ::2], lambda x: x[1:3, ::2], (4, 5)),
        (lambda a: a[2, 1:], lambda x: x[2, 1:], (4, 5)),
        (lambda a: a[::-1, -1], lambda x: x[::-1, -1], (4, 5)),
        (lambda a: ops.flip(a, (0, 2)), lambda x: np.flip(x, (0, 2)), (2, 3, 4)),
        (lambda a: ops.dilate(a, (0, 1), 2), None, (2, 3)),
        (lambda a: ops.undilate(a, (1,), 1), lambda x: x[:, ::2], (3, 6)),
    ],
    ids=[
        "transpose", "transpose02", "reshape", "reshape-1", "bcast_lead", "bcast",
        "sum_all", "sum1", "sum02", "sum_keep", "max1", "max_all", "max_keep",
        "lse1", "lse_all", "lse02", "getitem_slices", "getitem_int", "getitem_neg",
        "flip", "dilate", "undilate",
    ],
)  # fmt: skip
def test_shape_ops(device, fn, ref, shape, view):
    if ref is None:  # dilate: zeros inserted after every entry along axes 0 and 1

        def ref(x):
            out = np.zeros((x.shape[0] * 3, x.shape[1] * 3))
            out[::3, ::3] = x
            return out

    check_op(device, fn, ref, [randn(*shape)], view=view)


def test_logsumexp_is_stable(device):
    x = np.array([[1000.0, 1000.0], [-1000.0, -1001.0]], dtype=np.float32)
    got = ops.logsumexp(ndl.Tensor(x, device=device), axes=(1,)).numpy()
    np.testing.assert_allclose(got, [1000 + np.log(2), -1000 + np.log1p(np.exp(-1))], rtol=1e-6)


def test_logsumexp_of_infinite_slices(device):
    x = np.array([[-np.inf, -np.inf], [np.inf, 0.0], [3e38, 3e38], [0.0, 0.0]], np.float32)
    got = ops.logsumexp(ndl.Tensor(x, device=device), axes=(1,)).numpy()
    np.testing.assert_allclose(got, np.logaddexp.reduce(x.astype(np.float64), axis=1), rtol=1e-6)


def test_sigmoid_keeps_precision_for_negative_inputs(device):
    x = np.array([-80, -30, -20, -17, -15, -10, -1, 0, 1, 10, 30, 80], np.float32)
    got = ops.sigmoid(ndl.Tensor(x, device=device)).numpy()
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-x.astype(np.float64))), rtol=1e-6)
    t = ndl.Tensor(x[1:], device=device, requires_grad=True)
    ops.log(ops.sigmoid(t)).sum().backward()  # d/dx log sigmoid(x) = 1 - sigmoid(x)
    np.testing.assert_allclose(t.grad.numpy(), 1 / (1 + np.exp(x[1:].astype(np.float64))),
                               rtol=1e-5, atol=1e-7)


def test_power_zero_has_zero_gradient_at_zero(device):
    t = ndl.Tensor(np.array([0.0, 2.0], np.float32), device=device, requires_grad=True)
    (t**0).sum().backward()
    np.testing.assert_array_equal(t.grad.numpy(), [0.0, 0.0])


def test_transpose_names_its_two_axes_rule():
    with pytest.raises(ValueError, match="transpose swaps two axes"):
        ops.transpose(ndl.Tensor(np.zeros((2, 3, 4), np.float32)), (2, 0, 1))


def test_max_gradient_splits_ties(device):
    x = ndl.Tensor(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]]), device=device)
    ops.max(x, axes=(1,)).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [[0, 0.5, 0.5], [1, 0, 0]])


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_stack_and_split(device, axis):
    arrays = [randn(3, 4) for _ in range(3)]
    check_op(
        device,
        lambda *ts: ops.stack(ts, axis),
        lambda *xs: np.stack(xs, axis),
        arrays,
    )
    x = randn(2, 3, 4)
    weights = [randn(*np.delete(x.shape, axis % 3)) for _ in range(x.shape[axis])]
    t = ndl.Tensor(x, device=device)
    parts = ops.split(t, axis)
    assert len(parts) == x.shape[axis]
    total = None
    for part, expected, w in zip(parts, np.moveaxis(x, axis, 0), weights, strict=True):
        np.testing.assert_allclose(part.numpy(), expected, rtol=1e-6)
        term = (part * ndl.Tensor(w, device=device)).sum()
        total = term if total is None else total + term
    total.backward()
    np.testing.assert_allclose(t.grad.numpy(), np.stack(weights, axis), rtol=1e-6)


def test_split_gradient_when_only_some_parts_are_used(device):
    t = ndl.Tensor(randn(4, 3), device=device)
    parts = ops.split(t, 0)
    (parts[1] * 2.0 + parts[3]).sum().backward()
    expected = np.zeros((4, 3))
    expected[1], expected[3] = 2.0, 1.0
    np.testing.assert_allclose(t.grad.numpy(), expected)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concatenate(device, axis):
    shapes = [(2, 3), (2, 3), (2, 3)]
    shapes = [tuple(s + i if ax == axis % 2 else s for ax, s in enumerate(sh))
              for i, sh in enumerate(shapes)]  # fmt: skip
    check_op(
        device,
        lambda *ts: ops.concatenate(ts, axis),
        lambda *xs: np.concatenate(xs, axis),
        [randn(*s) for s in shapes],
    )


def _conv_reference(x, w, stride, padding):
    """Direct NHWC convolution in float64, one kernel offset at a time."""
    x = np.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    k = w.shape[0]
    h_out = (x.shape[1] - k) // stride + 1
    w_out = (x.shape[2] - k) // stride + 1
    out = np.zeros((x.shape[0], h_out, w_out, w.shape[3]))
    for i in range(k):
        for j in range(k):
            patch = x[:, i : i + stride * h_out : stride, j : j + stride * w_out : stride, :]
            out += patch @ w[i, j]
    return out


@pytest.mark.parametrize(
    "x_shape, k, c_out, stride, padding",
    [
        ((2, 5, 5, 3), 3, 4, 1, 0),
        ((2, 5, 5, 3), 3, 2, 1, 1),
        ((1, 6, 6, 2), 3, 2, 2, 1),
        ((2, 7, 7, 2), 3, 3, 2, 0),
        ((1, 8, 8, 1), 5, 2, 3, 2),
        ((1, 4, 4, 2), 1, 3, 1, 0),
        ((1, 4, 4, 2), 2, 2, 1, 3),
    ],
)
def test_conv(device, x_shape, k, c_out, stride, padding):
    check_op(
        device,
        lambda a, b: ops.conv(a, b, stride=stride, padding=padding),
        lambda a, b: _conv_reference(a, b, stride, padding),
        [randn(*x_shape), randn(k, k, x_shape[3], c_out)],
    )


def test_conv_on_strided_input(device):
    x, w = randn(2, 6, 6, 3), randn(3, 3, 3, 2)
    stored = ndl.Tensor(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), device=device)
    viewed = ops.transpose(stored, (1, 2))
    out = ops.conv(viewed, ndl.Tensor(w, device=device), padding=1)
    np.testing.assert_allclose(out.numpy(), _conv_reference(x, w, 1, 1), rtol=1e-4, atol=1e-4)


def test_tuple_used_whole_and_by_entries(device):
    x_np, w = randn(3, 2), randn(3, 2)
    x = ndl.Tensor(x_np, device=device)
    parts = ops.split(x, 0)
    whole = ops.stack(parts, 0)  # the tuple itself feeds stack
    loss = (whole * ndl.Tensor(w, device=device)).sum() + (parts[1] * 3.0).sum()
    loss.backward()
    expected = w.copy()
    expected[1] += 3.0
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-6)


def test_scatter_into_zeros(device):
    def ref(x):
        out = np.zeros((4, 6))
        out[1:4:2, ::3] = x
        return out

    check_op(
        device,
        lambda a: ops.scatter_into_zeros(a, (4, 6), (slice(1, 4, 2), slice(None, None, 3))),
        ref,
        [randn(2, 2)],
    )


@pytest.mark.parametrize("seed", range(6))
def test_random_broadcast_reduce_chains(device, seed):
    """Random shapes: broadcast a to a random larger shape, combine with b, reduce random axes."""
    rng = np.random.default_rng(100 + seed)
    ndim = int(rng.integers(1, 5))
    full = tuple(int(d) for d in rng.integers(1, 5, size=ndim))
    small = tuple(1 if rng.random() < 0.5 else d for d in full)[int(rng.integers(0, ndim)) :]
    axes = tuple(int(i) for i in np.flatnonzero(rng.random(ndim) < 0.5)) or None

    def fn(a, b):
        return ops.summation(ops.broadcast_to(a, full) * b + b, axes)

    def ref(a, b):
        return np.sum(np.broadcast_to(a, full) * b + b, axis=axes)

    check_op(device, fn, ref, [rng.standard_normal(small), rng.standard_normal(full)])


def test_relu_gradient_is_zero_at_and_below_zero(device):
    x = ndl.Tensor(np.array([-1.0, 0.0, 1e-30, 2.0]), device=device)
    ops.relu(x).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [0.0, 0.0, 1.0, 1.0])


def _kernel_grad_reference(x, g, k, stride, padding):
    x = np.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    h_out, w_out = g.shape[1:3]
    out = np.zeros((k, k, x.shape[3], g.shape[3]))
    for i in range(k):
        for j in range(k):
            patch = x[:, i : i + stride * h_out : stride, j : j + stride * w_out : stride, :]
            out[i, j] = np.einsum("nhwc,nhwo->co", patch, g)
    return out


@pytest.mark.parametrize("stride, padding", [(1, 1), (2, 0)])
def test_conv_kernel_grad_op_and_its_second_derivatives(device, stride, padding):
    """The kernel gradient is an op; its own gradient (conv's 2nd derivative) is checked too."""
    from needle.ops.ops_conv import ConvKernelGrad

    x, k = randn(2, 5, 5, 2), 3
    h_out = (5 + 2 * padding - k) // stride + 1
    check_op(
        device,
        lambda a, g: ConvKernelGrad(stride, padding, (k, k))(a, g),
        lambda a, g: _kernel_grad_reference(a, g, k, stride, padding),
        [x, randn(2, h_out, h_out, 3)],
    )
