"""Bad input raises a clear Python exception naming what was wrong; nothing reaches a backend."""

import numpy as np
import pytest

import needle as ndl
from needle import ops
from needle.backend_ndarray import NDArray


def t(shape, device):
    return ndl.Tensor(np.ones(shape, dtype=np.float32), device=device)


def nd(shape, device):
    return NDArray(np.ones(shape, dtype=np.float32), device=device)


def test_matmul_inner_dimensions(device):
    with pytest.raises(ValueError, match=r"inner dimensions.*\(2, 3\) @ \(4, 5\)"):
        t((2, 3), device) @ t((4, 5), device)
    with pytest.raises(ValueError, match=r"batch dimensions.*\(2, 3, 4\).*\(5, 4, 1\)"):
        nd((2, 3, 4), device) @ nd((5, 4, 1), device)
    with pytest.raises(ValueError, match=r">= 2-D.*\(3,\)"):
        nd((3,), device) @ nd((3, 2), device)


def test_elementwise_shape_mismatch(device):
    with pytest.raises(ValueError, match=r"add: shapes \(2, 3\) and \(3, 2\) differ"):
        t((2, 3), device) + t((3, 2), device)
    with pytest.raises(ValueError, match=r"multiply: shapes \(4,\) and \(1, 4\) differ"):
        nd((4,), device) * nd((1, 4), device)


def test_reshape_and_broadcast(device):
    with pytest.raises(ValueError, match=r"reshape array of shape \(2, 3\) into \(4, 2\)"):
        ops.reshape(t((2, 3), device), (4, 2))
    with pytest.raises(ValueError, match=r"reshape array of shape \(2, 3\) into \(4, -1\)"):
        nd((2, 3), device).reshape((4, -1))
    with pytest.raises(ValueError, match=r"broadcast shape \(2, 3\) to \(2, 4\)"):
        ops.broadcast_to(t((2, 3), device), (2, 4))
    with pytest.raises(ValueError, match=r"broadcast shape \(2, 3\) to \(3,\)"):
        nd((2, 3), device).broadcast_to((3,))


def test_axes_out_of_range(device):
    with pytest.raises(IndexError, match="axis 2 is out of range for 2 dimensions"):
        ops.summation(t((2, 3), device), axes=(2,))
    with pytest.raises(IndexError, match="axis -3 is out of range"):
        ops.max(t((2, 3), device), axes=-3)
    with pytest.raises(IndexError, match="axis 3 is out of range"):
        ops.transpose(t((2, 3, 4), device), (0, 3))
    with pytest.raises(IndexError, match="axis 4 is out of range"):
        ops.stack([t((2, 3), device)] * 2, axis=4)
    with pytest.raises(ValueError, match="not a permutation"):
        nd((2, 3), device).permute((0,))
    with pytest.raises(ValueError, match="repeated axis"):
        nd((2, 3), device).permute((0, 0))
    with pytest.raises(ValueError, match="transpose needs >= 2 dimensions"):
        ops.transpose(t((3,), device))


def test_indices_out_of_range(device):
    a = nd((2, 3), device)
    with pytest.raises(IndexError, match=r"index 3 is out of range for axis 1 of shape \(2, 3\)"):
        a[0, 3]
    with pytest.raises(IndexError, match=r"index -3 is out of range for axis 0"):
        t((2, 3), device)[-3]
    with pytest.raises(IndexError, match="too many indices"):
        a[0, 0, 0]
    with pytest.raises(TypeError, match="int, slice or Ellipsis"):
        a[[0, 1]]
    with pytest.raises(IndexError, match="outside a buffer of 6 elements"):
        a.as_strided((3, 3), (2, 2))


def test_setitem_shape_mismatch(device):
    a = nd((4, 4), device)
    with pytest.raises(ValueError, match=r"broadcast shape \(3,\) to \(2, 4\)"):
        a[:2] = nd((3,), device)


def test_only_float32(device):
    with pytest.raises(TypeError, match="float32 only.*float64"):
        ndl.Tensor(np.ones(3), device=device, dtype="float64")
    with pytest.raises(TypeError, match="float32 only.*int32"):
        NDArray(np.ones(3), device=device, dtype="int32")
    with pytest.raises(TypeError, match="float32 only"):
        ndl.Tensor(nd((2,), device), dtype="float16")
    with pytest.raises(TypeError, match="numpy dtype <U1"):
        ndl.Tensor(np.array(["a", "b"]), device=device)
    with pytest.raises(TypeError, match="complex128"):
        NDArray(np.ones(2, dtype=np.complex128), device=device)


def test_mixed_devices_and_tuple_shapes(device):
    other = ndl.cpu() if device == ndl.cpu_numpy() else ndl.cpu_numpy()
    with pytest.raises(ValueError, match="arrays on"):
        nd((2,), device) + nd((2,), other)
    with pytest.raises(ValueError, match=r"stack: shapes \[\(2, 3\), \(3, 2\)\] do not match"):
        ops.stack([t((2, 3), device), t((3, 2), device)], axis=0)
    with pytest.raises(ValueError, match="concatenate: shapes"):
        ops.concatenate([t((2, 3), device), t((3, 2), device)], axis=1)
    with pytest.raises(ValueError, match="at least one tensor"):
        ops.stack([], axis=0)


def test_conv_shapes(device):
    with pytest.raises(ValueError, match=r"\(1, 5, 5, 3\) and \(3, 3, 2, 4\)"):
        ops.conv(t((1, 5, 5, 3), device), t((3, 3, 2, 4), device))
    with pytest.raises(ValueError, match="larger than padded input"):
        ops.conv(t((1, 2, 2, 1), device), t((3, 3, 1, 1), device))
    with pytest.raises(ValueError, match="stride >= 1"):
        ops.conv(t((1, 5, 5, 1), device), t((3, 3, 1, 1), device), stride=0)


def test_backend_primitives_reject_bad_sizes(device):
    a, b, out = device.Array(4), device.Array(5), device.Array(4)
    with pytest.raises((ValueError, RuntimeError, IndexError)):
        device.ewise_add(a, b, out)
    with pytest.raises((ValueError, RuntimeError, IndexError)):
        device.matmul(a, out, device.Array(4), 2, 3, 2)
    with pytest.raises((ValueError, RuntimeError, IndexError)):
        device.reduce_sum(a, device.Array(3), 2)


def test_one_hot_labels_out_of_range(device):
    with pytest.raises(IndexError, match=r"labels must lie in \[0, 3\)"):
        device.one_hot(3, np.array([0, 3]))


def test_unavailable_device_says_so():
    if ndl.cuda().enabled():
        pytest.skip("this machine has a GPU: the cuda device is available")
    assert not hasattr(ndl.cuda(), "matmul")
    with pytest.raises(AttributeError, match="device cuda is not available here"):
        ndl.Tensor(np.ones(2), device=ndl.cuda())


def test_ops_take_tensors(device):
    with pytest.raises(TypeError, match="EWiseAdd takes tensors, got int 2"):
        ops.add(t((2,), device), 2)
    with pytest.raises(TypeError, match="MatMul takes tensors, got ndarray"):
        ops.matmul(t((2, 2), device), np.ones((2, 2)))
