"""NDArray edge cases found in review, each against numpy on every backend: cached copies of
views after a write from that view, odd indices, empty views, setitem values, scalar / array,
shapes, numpy interop."""

import warnings

import numpy as np
import pytest

from needle.backend_ndarray import NDArray

RNG = np.random.default_rng(21)


def nd(x, device) -> NDArray:
    return NDArray(np.asarray(x, dtype=np.float32), device=device)


def test_a_view_copied_while_setitem_read_it_is_not_stale_afterwards(device):
    """a[...] = a.T reads a.T (caching its compact copy), then writes a: a later kernel read of
    that same view must see the written values, not the copy cached before the write."""
    x = np.arange(9, dtype=np.float32).reshape(3, 3)
    a = nd(x, device)
    transposed = a.permute((1, 0))
    a[...] = transposed
    x[...] = x.T.copy()
    np.testing.assert_array_equal(a.numpy(), x)
    np.testing.assert_array_equal((transposed + 0.0).numpy(), x.T)
    np.testing.assert_array_equal(transposed.compact().numpy(), x.T)


def test_odd_indices_are_refused_clearly(device):
    a = nd(np.arange(12).reshape(3, 4), device)
    with pytest.raises(TypeError, match="bool"):  # numpy adds an axis; this used to pick row 1
        a[True]
    with pytest.raises(TypeError, match="bool"):
        a[0, False]
    with pytest.raises(TypeError, match="None.*not supported.*reshape"):
        a[None]
    with pytest.raises(IndexError, match="single Ellipsis"):
        a[..., 0, ...]
    np.testing.assert_array_equal(a[np.int64(-1), ::-3].numpy(), np.arange(8, 12)[::-3])


def test_empty_views_with_an_offset_read_back(device):
    """An integer index into an array with an empty axis gives an empty view whose offset lies
    past the (empty) buffer: it still reads back as an empty array."""
    x = np.zeros((3, 0, 2), np.float32)
    a = nd(x, device)
    for index in [(slice(None), slice(None), 1), (2, slice(None), 1), (1, Ellipsis)]:
        view = a[index]
        assert view.shape == x[index].shape
        np.testing.assert_array_equal(view.numpy(), x[index])
        np.testing.assert_array_equal(view.compact().numpy(), x[index])
        np.testing.assert_array_equal((view + 1.0).numpy(), x[index] + 1)


def test_setitem_into_an_empty_view_still_checks_the_value(device):
    a = nd(np.zeros((2, 4)), device)
    with pytest.raises(ValueError, match=r"broadcast shape \(3,\) to \(0, 4\)"):
        a[0:0] = nd(np.ones(3), device)
    with pytest.raises(ValueError, match="could not convert"):  # numpy's error too
        a[2:] = "x"
    a[0:0] = nd(np.ones(4), device)  # broadcastable: a no-op, as in numpy
    a[0:0] = 5.0
    np.testing.assert_array_equal(a.numpy(), np.zeros((2, 4)))


def test_setitem_values_like_numpy(device):
    """Leading size-1 axes of the value are dropped, and lists are values, as in numpy."""
    x = np.zeros((3, 4), np.float32)
    a = nd(x, device)
    row = RNG.standard_normal((1, 4)).astype(np.float32)
    a[1] = nd(row, device)
    x[1] = row
    a[2, 1:3] = row[:, :2].reshape(1, 1, 2)  # a numpy value too
    x[2, 1:3] = row[:, :2].reshape(1, 1, 2)
    a[0] = [1, 2, 3, 4]
    x[0] = [1, 2, 3, 4]
    np.testing.assert_array_equal(a.numpy(), x)
    listed = np.float32([1, 2, 3, 4])
    np.testing.assert_array_equal((a[1] + [1, 2, 3, 4]).numpy(), x[1] + listed)
    np.testing.assert_array_equal((a[1] - [1, 2, 3, 4]).numpy(), x[1] - listed)
    with pytest.raises(ValueError, match=r"broadcast shape \(2, 4\) to \(4,\)"):
        a[0] = nd(np.ones((2, 4)), device)


def test_scalar_divided_by_an_array_matches_numpy_exactly(device):
    """c / a divides; as (1 / a) * c it rounded twice (an ulp off numpy, e.g. 3 / 7)."""
    x = np.array([7.0, 3.0, 49.0, -11.0, 0.0, np.inf, 1e-3, 6.5], np.float32)
    a = nd(x, device)
    with np.errstate(all="ignore"):
        for c in (3.0, -2.5, 1e-3, 0.0):
            np.testing.assert_array_equal((c / a).numpy(), np.float32(c) / x, err_msg=str(c))
        y = RNG.standard_normal(8).astype(np.float32)
        np.testing.assert_array_equal((y / a).numpy(), y / x)


def test_fill_and_setitem_beyond_float32_range_are_quiet_infinities(device):
    """Like the C++ backend: a value past float32's range stores inf, without a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(device.full((2,), 1e39).numpy(), [np.inf, np.inf])
        a = nd(np.zeros((2, 2)), device)
        a[0, 1] = -1e39
        a[1] = 1e39
        a[:, 0].fill(1e39)
    np.testing.assert_array_equal(a.numpy(), [[np.inf, -np.inf], [np.inf, np.inf]])


def test_one_hot_refuses_labels_that_are_not_whole_numbers(device):
    np.testing.assert_array_equal(device.one_hot(3, np.array([2.0, 0.0])).numpy(),
                                  np.eye(3)[[2, 0]])
    with pytest.raises(ValueError, match="whole numbers.*1.5"):
        device.one_hot(3, np.array([0.0, 1.5]))
    with pytest.raises(ValueError, match="whole numbers.*nan"):
        device.one_hot(3, np.array([np.nan, 1.0]))


def test_shapes_are_integers(device):
    a = nd(np.arange(12), device)
    np.testing.assert_array_equal(a.reshape(12).numpy(), np.arange(12))  # an int, as numpy
    np.testing.assert_array_equal(a.reshape((np.int64(3), -1)).numpy(),
                                  np.arange(12).reshape(3, 4))
    with pytest.raises(TypeError, match="integer"):
        a.reshape((2.5, 4.8))  # was truncated to (2, 4) and reported as that
    with pytest.raises(TypeError, match="integer"):
        device.zeros(2.5)  # was 2 elements
    with pytest.raises(TypeError, match="integer"):
        a.broadcast_to((2.0, 12))


def test_matmul_takes_numpy_arrays_and_refuses_other_operands(device):
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    y = RNG.standard_normal((4, 2)).astype(np.float32)
    np.testing.assert_allclose((nd(x, device) @ y).numpy(), x @ y, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="matmul.*float"):
        nd(x, device) @ 2.0


def test_numpy_conversion_of_an_ndarray(device):
    """np.asarray(a) is a.numpy(); it used to build an object array of 0-d NDArrays."""
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    a = nd(x, device)
    got = np.asarray(a[:, ::-1])
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, x[:, ::-1])
    np.testing.assert_array_equal(np.asarray(a, dtype=np.float64), x.astype(np.float64))
    np.testing.assert_array_equal(NDArray([a[1], a[0]], device=device).numpy(), x[::-1])
    with pytest.raises(ValueError, match="copy"):
        np.asarray(a, copy=False)


def test_flip_of_no_axes_is_a_copy(device):
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    a = nd(x, device)
    flipped = a.flip(())
    assert flipped.handle is not a.handle
    flipped[0, 0] = 100.0
    np.testing.assert_array_equal(a.numpy(), x)
