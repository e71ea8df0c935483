"""Ops and autograd, from a review: edge cases of existing ops checked against numpy and
finite differences (float64 references), on every backend the framework tests use."""

import numpy as np
import pytest
from helpers import numeric_grad, tensor

import needle as ndl
from needle import ops


def test_negative_tuple_index_gets_its_gradient(device):
    # parts[-1] of a split had a zero gradient: backward matched entry -1 to no position
    x_np = np.arange(6.0).reshape(3, 2)
    x = tensor(x_np, device)
    parts = ops.split(x, 0)
    loss = (parts[-1] * 2.0).sum() + (parts[2] * 3.0).sum() + (parts[-3] * 5.0).sum()
    loss.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [[5.0, 5.0], [0.0, 0.0], [5.0, 5.0]])
    np.testing.assert_array_equal(parts[-1].numpy(), x_np[2])


def test_bad_tuple_indices_are_refused(device):
    parts = ops.split(tensor(np.ones((3, 2)), device), 0)
    with pytest.raises(IndexError, match="out of range"):
        parts[-4]
    with pytest.raises(IndexError, match="out of range"):
        parts[3]
    with pytest.raises(TypeError, match="int"):
        parts[0:2]


def test_power_gradients_at_zero_base_and_zero_exponent(device):
    # d/db a**b at a = 0 (b > 0) is 0 and d/da a**b at b = 0 is 0; both were 0 * inf = NaN
    a_np, b_np = np.array([0.0, 0.0, 2.0, 1.5]), np.array([2.0, 0.0, 0.0, 1.5])
    a, b = tensor(a_np, device), tensor(b_np, device)
    (a**b).sum().backward()
    np.testing.assert_allclose(a.grad.numpy(), [0.0, 0.0, 0.0, 1.5 * 1.5**0.5], rtol=1e-6)
    np.testing.assert_allclose(b.grad.numpy(), [0.0, 0.0, np.log(2.0), 1.5**1.5 * np.log(1.5)],
                               rtol=1e-6)
    # elsewhere unchanged: finite differences of the float64 function
    a_np, b_np = np.array([0.7, 1.3, 2.0]), np.array([-1.2, 0.4, 2.5])
    a, b = tensor(a_np, device), tensor(b_np, device)
    (a**b).sum().backward()
    for i, got in enumerate((a.grad, b.grad)):
        expected = numeric_grad(lambda x, y: np.sum(x**y), [a_np, b_np], i)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5)


def test_backward_takes_numbers_and_arrays_as_out_grad(device):
    x = tensor([1.0, 2.0, 3.0], device)
    (x * x).sum().backward(2.0)
    np.testing.assert_allclose(x.grad.numpy(), [4.0, 8.0, 12.0])
    x.backward(np.array([1.0, 0.5, 0.25]))  # a leaf keeps a Tensor, not the numpy array
    assert isinstance(x.grad, ndl.Tensor) and x.grad.device == device
    np.testing.assert_array_equal(x.grad.numpy(), [1.0, 0.5, 0.25])
    with pytest.raises(ValueError, match=r"\(2,\).*\(3,\)"):
        (x * x).backward([1.0, 2.0])
    with pytest.raises(ValueError, match=r"\(\).*\(3,\)"):
        (x * x).backward(1.0)  # a number stands for a scalar output only
    other = ndl.cpu_numpy() if device != ndl.cpu_numpy() else ndl.cpu()
    with pytest.raises(ValueError, match="out_grad on"):
        (x * x).backward(tensor([1.0, 1.0, 1.0], other))


@pytest.mark.parametrize("a, b", [(1e-30, 1e-25), (1e30, 1e20), (-3e-15, 1e-20)])
def test_divide_gradient_for_tiny_and_huge_divisors(device, a, b):
    # -a / b**2 went through b * b, which is 0 or inf in float32 for these divisors
    x, y = tensor([a], device), tensor([b], device)
    (x / y).backward(tensor([1.0], device))
    np.testing.assert_allclose(x.grad.numpy(), [1 / b], rtol=1e-6)
    np.testing.assert_allclose(y.grad.numpy(), [-a / b**2], rtol=1e-6)


def test_logsumexp_gradient_of_an_all_minus_inf_slice_is_zero(device):
    # as log(0 + 0 * exp(x)) in a log-semiring recursion: the slice [-inf, -inf] had NaN
    # gradients (-inf - -inf), which NaN-poisoned every gradient flowing through it
    z_np = np.array([[-np.inf, -np.inf, -np.inf], [-np.inf, 0.0, 1.0], [1e30, 1e30, -2.0]])
    z = tensor(z_np, device)
    lse = ops.logsumexp(z, axes=(1,))
    np.testing.assert_array_equal(lse.numpy()[0], -np.inf)
    weights = np.array([1.0, 2.0, 3.0])
    (lse * tensor(weights, device, False)).sum().backward()
    finite = np.exp(z_np[1:] - z_np[1:].max(1, keepdims=True))
    expected = np.vstack([np.zeros((1, 3)), finite / finite.sum(1, keepdims=True)])
    np.testing.assert_allclose(z.grad.numpy(), expected * weights[:, None], rtol=1e-6)
    # finite values: finite differences of the float64 function, reduced over two axes
    x_np = np.random.default_rng(0).standard_normal((2, 3, 2))
    x = tensor(x_np, device)
    ops.logsumexp(x, axes=(0, -1)).sum().backward()
    expected = numeric_grad(lambda a: np.log(np.exp(a).sum((0, 2))).sum(), [x_np], 0)
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-5)
