"""Review 24 of autograd, ops and NDArray: numpy interop of Tensors, dtype arguments given as
numpy types, the numpy backend's floating-point error state, and the fused linear op's input
rank. References are numpy itself, on both CPU backends."""

import numpy as np
import pytest

import needle as ndl
from needle.backend_ndarray import NDArray
from needle.ops import ops_nn
from tests.helpers import tensor

CPU_DEVICES = [pytest.param(ndl.cpu_numpy(), id="numpy"), pytest.param(ndl.cpu(), id="cpu")]


@pytest.mark.parametrize("device", CPU_DEVICES)
def test_numpy_reads_a_tensor_as_its_float32_values(device):
    """np.asarray(t) made an object array of 0-d Tensors: np.mean crashed and
    np.testing.assert_allclose raised 'bad operand type for abs()'; float(loss) was refused, so
    np.mean of a list of losses failed too."""
    values = np.array([[1.5, -2.0], [3.25, 4.0]], dtype=np.float32)
    t = tensor(values, device)
    array = np.asarray(t)
    assert array.dtype == np.float32
    np.testing.assert_array_equal(array, values)
    assert np.mean(t) == np.mean(values)
    np.testing.assert_allclose(t[1], values[1])
    losses = [tensor(1.0, device), tensor(2.5, device)]  # per-batch losses, then their mean
    assert np.mean(losses) == 1.75 and float(losses[1]) == 2.5


@pytest.mark.parametrize("device", CPU_DEVICES)
def test_numpy_reads_a_lazy_tensor_without_changing_its_graph(device, monkeypatch):
    from needle import autograd

    monkeypatch.setattr(autograd, "LAZY_MODE", True)
    x = tensor([1.0, 2.0], device)
    y = x * x
    np.testing.assert_array_equal(np.asarray(y, dtype=np.float64), [1.0, 4.0])
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 4.0])


@pytest.mark.parametrize("device", CPU_DEVICES)
@pytest.mark.parametrize("dtype", [np.float32, np.dtype("float32"), "float32", None])
def test_tensor_of_a_tensor_or_ndarray_takes_float32_however_named(device, dtype):
    """Tensor(ndarray_or_tensor, dtype=np.float32) refused float32 ('float32 only, got dtype
    <class 'numpy.float32'>'), so nn.Linear(..., dtype=np.float32) and init.*(dtype=np.float32)
    failed, while Tensor(numpy_array, dtype=np.float32) worked."""
    values = np.array([1.0, 2.0], dtype=np.float32)
    for source in (NDArray(values, device=device), tensor(values, device)):
        np.testing.assert_array_equal(ndl.Tensor(source, dtype=dtype).numpy(), values)
    assert ndl.init.zeros(2, 3, device=device, dtype=dtype).shape == (2, 3)
    layer = ndl.nn.Linear(3, 2, device=device, dtype=dtype)
    assert layer(ndl.init.ones(4, 3, device=device)).shape == (4, 2)


@pytest.mark.parametrize("device", CPU_DEVICES)
def test_tensor_of_an_ndarray_still_refuses_other_dtypes(device):
    source = NDArray(np.ones(2, dtype=np.float32), device=device)
    for dtype in (np.float64, "float16", np.int32):
        with pytest.raises(TypeError, match="float32 only"):
            ndl.Tensor(source, dtype=dtype)


@pytest.mark.parametrize("device", CPU_DEVICES)
def test_matmul_overflow_and_inf_follow_ieee_under_numpy_raise_mode(device):
    """The numpy backend's elementwise ops ignore numpy's error state (inf and NaN as IEEE gives
    them, as the C++ does) but its matmul did not: under np.errstate(all='raise') an inf
    operand raised FloatingPointError on the numpy backend only."""
    a = np.array([[np.inf, 1.0], [1e30, 1e30]], dtype=np.float32)
    b = np.array([[0.0, 1.0], [1e30, 2.0]], dtype=np.float32)
    with np.errstate(all="ignore"):
        expected = a @ b
    with np.errstate(all="raise"):
        got = (NDArray(a, device=device) @ NDArray(b, device=device)).numpy()
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("device", CPU_DEVICES)
def test_fused_linear_refuses_operands_that_are_not_matrices(device):
    """linear(x, w) of a 3-D x (or w) ran forward, then backward failed deep inside with
    'permute: (1, 0) is not a permutation of 3 axes'; nn.Linear flattens to (batch, in)."""
    x = tensor(np.ones((2, 3, 4)), device)
    w = tensor(np.ones((4, 5)), device)
    with pytest.raises(ValueError, match=r"x \(batch, in\)"):
        ops_nn.linear(x, w)
    with pytest.raises(ValueError, match=r"x \(batch, in\)"):
        ops_nn.linear(x[0], tensor(np.ones((3, 4, 5)), device))


def test_an_array_written_into_a_broadcast_view_is_refused(device):
    """The positions of a broadcast view share memory: which value landed was the backend's
    race (the last write on cpu, any on cuda), where numpy refuses (its view is read-only).
    A scalar lands the same everywhere and is still taken."""
    a = NDArray(np.zeros((1, 4), np.float32), device=device)
    view = a.broadcast_to((3, 4))
    with pytest.raises(ValueError, match="broadcast view"):
        view[:, :] = NDArray(np.arange(12, dtype=np.float32).reshape(3, 4), device=device)
    np.testing.assert_array_equal(a.numpy(), np.zeros((1, 4), np.float32))
    view[:, :] = 5.0
    np.testing.assert_array_equal(a.numpy(), np.full((1, 4), 5, np.float32))
