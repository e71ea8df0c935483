"""Ops, from a review: logsumexp's gradient at +inf, Tensor ** numpy array, scatter_into_zeros
refusing a value of the wrong shape, linear's bias gradient; numpy and finite-difference
(float64) references, on every backend the framework tests use."""

import re

import numpy as np
import pytest
from helpers import numeric_grad, tensor

from needle import ops
from needle.ops.ops_nn import linear

INF = np.inf


def lse_grad_reference(z: np.ndarray, axes) -> np.ndarray:
    """d sum(logsumexp(z, axes)) / dz: softmax over each slice; where a slice holds +inf, the
    limit of softmax (1/count at its +inf entries, 0 elsewhere); 0 on an all -inf slice."""
    z = np.asarray(z, np.float64)
    top = z.max(axis=axes, keepdims=True)
    hits = z == INF
    count = hits.sum(axis=axes, keepdims=True)
    z_safe = np.where(count > 0, 0.0, z)  # slices holding +inf: their limit is taken below
    e = np.exp(z_safe - np.where(np.isfinite(top), top, 0.0))
    total = e.sum(axis=axes, keepdims=True)
    softmax = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    return np.where(count > 0, hits / np.maximum(count, 1), softmax)


LSE_ROWS = np.array([
    [0.5, -1.0, 2.0, 0.25],  # finite
    [1.0, INF, -INF, 3e38],  # one +inf (next to the largest finite float32)
    [INF, 3.0, INF, -2.0],  # two +inf
    [-INF, -INF, -INF, -INF],  # all -inf
    [-INF, 0.0, 1.0, -INF],  # finite, with -inf entries
])


@pytest.mark.parametrize("layout", ["rows", "columns", "two_axes", "whole"])
def test_logsumexp_gradient_at_plus_inf_is_the_limit_of_softmax(device, layout):
    # a slice whose maximum is +inf had NaN gradients (inf - inf in exp(z - lse))
    z_np, axes = {
        "rows": (LSE_ROWS, (1,)),
        "columns": (LSE_ROWS.T, (0,)),
        "two_axes": (LSE_ROWS.reshape(5, 2, 2), (1, 2)),
        "whole": (LSE_ROWS[1:3], None),  # one slice holding three +inf
    }[layout]
    z = tensor(z_np, device)
    lse = ops.logsumexp(z, axes)
    weights = np.linspace(0.5, 2.0, int(np.prod(lse.shape))).reshape(lse.shape)
    (lse * tensor(weights, device, False)).sum().backward()
    kept = np.max(z_np, axis=axes, keepdims=True).shape
    expected = lse_grad_reference(z_np, axes) * weights.reshape(kept)
    np.testing.assert_allclose(z.grad.numpy(), expected, rtol=1e-6, atol=0)
    with np.errstate(divide="ignore", over="ignore"):  # as float32: exp(3e38) = inf, log(0)
        np.testing.assert_allclose(lse.numpy(), np.log(np.exp(z_np).sum(axis=axes)), rtol=1e-6)


def test_logsumexp_gradient_of_slices_without_plus_inf_is_unchanged_beside_one(device):
    # slices without +inf get exactly what they get on their own (bit for bit), in particular
    # finite-difference softmax values for finite slices and 0 for the all -inf slice
    finite_rows = LSE_ROWS[[0, 3, 4]]
    alone = tensor(finite_rows, device)
    ops.logsumexp(alone, (1,)).sum().backward()
    mixed = tensor(LSE_ROWS, device)
    ops.logsumexp(mixed, (1,)).sum().backward()
    np.testing.assert_array_equal(mixed.grad.numpy()[[0, 3, 4]], alone.grad.numpy())
    expected = numeric_grad(lambda a: np.log(np.exp(a).sum(1)).sum(), [LSE_ROWS[[0]]], 0)
    np.testing.assert_allclose(alone.grad.numpy()[0], expected[0], rtol=1e-5)
    np.testing.assert_array_equal(alone.grad.numpy()[1], 0.0)


def test_tensor_to_the_power_of_a_numpy_array(device):
    # t ** ndarray computed the power, then backward raised numpy's "truth value of an array
    # is ambiguous"; as t * ndarray, the array is a constant operand of t's shape
    x_np = np.array([[0.7, 1.3, 2.0], [0.0, 0.0, 1.5]])
    p_np = np.array([[2.0, -1.5, 0.5], [2.0, 0.0, 3.0]])
    x = tensor(x_np, device)
    y = x**p_np
    np.testing.assert_allclose(y.numpy(), x_np**p_np, rtol=1e-6)
    weights = np.array([[1.0, -2.0, 0.5], [3.0, 1.0, -1.0]])
    (y * tensor(weights, device, False)).sum().backward()
    expected = numeric_grad(lambda a: np.sum(a**p_np * weights), [x_np], 0)
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-5, atol=1e-6)
    # the same gradient for t as with the exponent as a Tensor (which also gets one)
    x2, p = tensor(x_np, device), tensor(p_np, device)
    (x2**p * tensor(weights, device, False)).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), x2.grad.numpy())
    assert p.grad is not None
    # a 0-d array is a scalar, as for the other operators; a wrong shape is refused as by *
    z = tensor([1.5, 2.0], device)
    (z ** np.array(3.0)).sum().backward()
    np.testing.assert_allclose(z.grad.numpy(), [3 * 1.5**2, 12.0], rtol=1e-6)
    with pytest.raises(ValueError, match="shapes"):
        z * np.ones(3)
    with pytest.raises(ValueError, match="shapes"):
        z ** np.ones(3)


def test_scatter_into_zeros_refuses_a_value_of_another_shape(device):
    # NDArray's setitem broadcast a (1, 2) value over the (2, 2) slice: silently wrong data
    idxs = (slice(1, 4, 2), slice(None, None, 3))
    for shape in [(1, 2), (2,), (2, 1), (4,), (2, 2, 1)]:
        with pytest.raises(ValueError, match=re.escape(str(shape)) + r".*\(2, 2\)"):
            ops.scatter_into_zeros(tensor(np.ones(shape), device), (4, 6), idxs)
    value = np.array([[1.0, 2.0], [3.0, 4.0]])
    expected = np.zeros((4, 6))
    expected[1:4:2, ::3] = value
    got = ops.scatter_into_zeros(tensor(value, device), (4, 6), idxs).numpy()
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("bias_shape", [(3,), (1, 3)])
def test_linear_bias_gradient_has_the_bias_shape(device, bias_shape):
    # a (3,) bias got a (1, 3) gradient, which an optimizer step then refused or broadcast
    rng = np.random.default_rng(0)
    x_np, w_np = rng.standard_normal((4, 2)), rng.standard_normal((2, 3))
    b_np = rng.standard_normal(bias_shape)
    weights = rng.standard_normal((4, 3))
    x, w, b = tensor(x_np, device), tensor(w_np, device), tensor(b_np, device)
    out = linear(x, w, b)
    np.testing.assert_allclose(out.numpy(), x_np @ w_np + b_np, rtol=1e-5, atol=1e-6)
    (out * tensor(weights, device, False)).sum().backward()
    assert b.grad.shape == bias_shape
    for i, leaf in enumerate((x, w, b)):
        expected = numeric_grad(lambda a, c, d: np.sum((a @ c + d) * weights),
                                [x_np, w_np, b_np], i)
        np.testing.assert_allclose(leaf.grad.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_a_number_or_array_to_the_power_of_a_tensor(device):
    # Tensor had no __rpow__: 2.0 ** t raised "unsupported operand type(s) for ** or pow()"
    t_np = np.array([[-1.5, 0.0, 0.5], [1.0, 2.25, 3.0]])
    base_np = np.array([[2.0, 3.0, 0.5], [1.5, 4.0, 1.0]])
    weights = np.array([[1.0, -2.0, 0.5], [3.0, 1.0, -1.0]])
    for base in (2.0, np.float64(0.75), base_np):
        t = tensor(t_np, device)
        y = base ** t
        np.testing.assert_allclose(y.numpy(), np.power(base, t_np), rtol=1e-6)
        (y * tensor(weights, device, False)).sum().backward()
        expected = numeric_grad(lambda a, b=base: np.sum(np.power(b, a) * weights), [t_np], 0)
        np.testing.assert_allclose(t.grad.numpy(), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="shapes"):
        np.ones(3) ** tensor(t_np, device)


def test_a_number_or_array_divided_by_a_tensor_is_one_division(device):
    # c / t was t ** -1 * c: rounded twice (3 / 7 gave 0.42857146, numpy 0.42857143) and
    # overflowed to inf for subnormal t
    t_np = np.array([[7.0, -3.0, 0.1], [1e-3, 2.5, -11.0]], np.float32)
    weights = np.array([[1.0, -2.0, 0.5], [3.0, 1.0, -1.0]])
    for c in (3.0, np.float32(-0.7), np.arange(1, 7, dtype=np.float32).reshape(2, 3)):
        t = tensor(t_np, device)
        y = c / t
        np.testing.assert_array_equal(y.numpy(), np.float32(c) / t_np)
        (y * tensor(weights, device, False)).sum().backward()
        expected = numeric_grad(lambda a, c=c: np.sum(np.divide(c, a) * weights),
                                [t_np.astype(np.float64)], 0)
        np.testing.assert_allclose(t.grad.numpy(), expected, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="shapes"):
        np.ones(3) / tensor(t_np, device)
