"""NDArray against numpy: view semantics (no copies), compaction, setitem, math, reductions."""

import operator
import warnings

import numpy as np
import pytest

import needle as ndl
from needle.backend_ndarray import NDArray

RNG = np.random.default_rng(1)


def nd(x: np.ndarray, device) -> NDArray:
    return NDArray(np.asarray(x, dtype=np.float32), device=device)


def random_shape(ndim: int) -> tuple[int, ...]:
    return tuple(int(d) for d in RNG.integers(1, 6, size=ndim))


def assert_view_of(view: NDArray, base: NDArray) -> None:
    assert view.handle is base.handle
    assert view.handle.ptr() == base.handle.ptr()


def test_roundtrip_and_zero_dim(device):
    for shape in [(), (1,), (3, 4), (2, 3, 4, 5)]:
        x = RNG.standard_normal(shape).astype(np.float32)
        a = nd(x, device)
        assert a.shape == shape and a.device == device and a.dtype == "float32"
        np.testing.assert_array_equal(a.numpy(), x)


@pytest.mark.parametrize("seed", range(3))
def test_reshape_is_a_view_when_contiguous(device, seed):
    shape = random_shape(3)
    x = RNG.standard_normal(shape).astype(np.float32)
    a = nd(x, device)
    b = a.reshape((-1,))
    assert_view_of(b, a)
    assert b.strides == (1,) and b.offset == 0
    np.testing.assert_array_equal(b.numpy(), x.reshape(-1))
    rows = a[1:] if shape[0] > 1 else a  # contiguous rows at an offset are still a view
    flat = rows.reshape((-1,))
    assert_view_of(flat, a)
    np.testing.assert_array_equal(flat.numpy(), x[1:].reshape(-1) if shape[0] > 1 else x.ravel())


def test_reshape_of_strided_view_copies_correctly(device):
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    a = nd(x, device).permute((1, 0))
    b = a.reshape((3, 8))
    assert b.handle is not a.handle
    np.testing.assert_array_equal(b.numpy(), x.T.reshape(3, 8))


def test_permute_broadcast_and_slices_are_views(device):
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    a = nd(x, device)

    p = a.permute((2, 0, 1))
    assert_view_of(p, a)
    assert p.shape == (4, 2, 3) and p.strides == (1, 12, 4)
    np.testing.assert_array_equal(p.numpy(), x.transpose(2, 0, 1))

    col = nd(RNG.standard_normal((3, 1)), device)
    wide = col.broadcast_to((2, 3, 5))
    assert_view_of(wide, col)
    assert wide.strides == (0, 1, 0)
    np.testing.assert_array_equal(wide.numpy(), np.broadcast_to(col.numpy(), (2, 3, 5)))

    s = a[1, ::2, 1:4:2]
    assert_view_of(s, a)
    assert s.shape == (2, 2) and s.strides == (8, 2) and s.offset == 12 + 1
    np.testing.assert_array_equal(s.numpy(), x[1, ::2, 1:4:2])

    r = a[:, ::-1, -1]
    assert_view_of(r, a)
    np.testing.assert_array_equal(r.numpy(), x[:, ::-1, -1])
    np.testing.assert_array_equal(a[..., 2].numpy(), x[..., 2])


@pytest.mark.parametrize("seed", range(4))
def test_random_strided_views_compact_like_numpy(device, seed):
    shape = random_shape(4)
    x = RNG.standard_normal(shape).astype(np.float32)
    a = nd(x, device)
    perm = tuple(RNG.permutation(4))
    index = tuple(
        slice(int(RNG.integers(0, shape[p])), shape[p], int(RNG.integers(1, 3))) for p in perm
    )
    view = a.permute(perm)[index]
    expected = x.transpose(perm)[index]
    compacted = view.compact()
    assert compacted.is_compact() and compacted.handle.size == expected.size
    np.testing.assert_array_equal(compacted.numpy(), expected)
    assert compacted.compact() is compacted


def test_as_strided_sliding_windows(device):
    x = np.arange(10, dtype=np.float32)
    a = nd(x, device)
    windows = a.as_strided((8, 3), (1, 1))
    assert_view_of(windows, a)
    np.testing.assert_array_equal(windows.numpy(), np.lib.stride_tricks.sliding_window_view(x, 3))


def test_setitem_on_views(device):
    x = RNG.standard_normal((4, 5, 6)).astype(np.float32)
    a = nd(x, device)
    value = RNG.standard_normal((2, 2)).astype(np.float32)
    a[1, 1:5:2, ::3] = nd(value, device)
    x[1, 1:5:2, ::3] = value
    np.testing.assert_array_equal(a.numpy(), x)
    a[:, 0] = 7.5
    x[:, 0] = 7.5
    np.testing.assert_array_equal(a.numpy(), x)
    view = a.permute((2, 1, 0))[::2]  # writing through a view changes the base buffer
    view[0] = -1.0
    x.transpose(2, 1, 0)[::2][0] = -1.0
    np.testing.assert_array_equal(a.numpy(), x)
    row = nd(RNG.standard_normal((6,)), device)
    a[2] = row.broadcast_to((5, 6))
    x[2] = row.numpy()
    np.testing.assert_array_equal(a.numpy(), x)


@pytest.mark.parametrize(
    "name, fn",
    [
        ("add", lambda a, b: a + b),
        ("sub", lambda a, b: a - b),
        ("mul", lambda a, b: a * b),
        ("div", lambda a, b: a / b),
        ("pow", lambda a, b: (a * a + 0.5) ** b),
        ("maximum", lambda a, b: a.maximum(b) if isinstance(a, NDArray) else np.maximum(a, b)),
        ("eq", lambda a, b: a == b),
        ("ne", lambda a, b: a != b),
        ("ge", lambda a, b: a >= b),
        ("gt", lambda a, b: a > b),
        ("le", lambda a, b: a <= b),
        ("lt", lambda a, b: a < b),
    ],
)
def test_elementwise_and_scalar_ops(device, name, fn):
    x = RNG.standard_normal((4, 3)).astype(np.float32)
    y = RNG.standard_normal((3, 4)).astype(np.float32).T  # non-compact operand
    x[0, :3] = y[0, :3]  # some equal entries for the comparisons
    a, b = nd(x, device), nd(y.T, device).permute((1, 0))
    np.testing.assert_allclose(fn(a, b).numpy(), fn(x, y), rtol=1e-6)
    np.testing.assert_allclose(fn(a, 0.75).numpy(), fn(x, np.float32(0.75)), rtol=1e-6)


def test_unary_and_reverse_ops(device):
    x = RNG.uniform(0.1, 3.0, (5, 4)).astype(np.float32)
    a = nd(x, device)[::2]
    for got, expected in [
        (a.log(), np.log(x[::2])),
        (a.exp(), np.exp(x[::2])),
        (a.tanh(), np.tanh(x[::2])),
        (a.sqrt(), np.sqrt(x[::2])),
        (-a, -x[::2]),
        (2.0 - a, 2.0 - x[::2]),
        (2.0 / a, 2.0 / x[::2]),
        (3.0 + a, 3.0 + x[::2]),
    ]:
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5)


@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1, (0, 1), (0, 2), (1, 2), (0, 1, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions(device, axis, keepdims):
    x = RNG.standard_normal((3, 4, 5)).astype(np.float32)
    a = nd(x.transpose(1, 0, 2).copy(), device).permute((1, 0, 2))
    np.testing.assert_allclose(
        a.sum(axis, keepdims).numpy(), x.sum(axis, keepdims=keepdims), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(a.max(axis, keepdims).numpy(), x.max(axis, keepdims=keepdims))


@pytest.mark.parametrize(
    "a_shape, b_shape",
    [
        ((1, 1), (1, 1)),
        ((7, 5), (5, 9)),
        ((33, 17), (17, 65)),
        ((64, 1), (1, 3)),
        ((2, 7, 5), (2, 5, 3)),
        ((3, 2, 4, 5), (5, 6)),
        ((4, 5), (2, 5, 3)),
        ((2, 1, 3, 4), (5, 4, 2)),
    ],
)
def test_matmul(device, a_shape, b_shape):
    x = RNG.standard_normal(a_shape).astype(np.float32)
    y = RNG.standard_normal(b_shape).astype(np.float32)
    got = (nd(x, device) @ nd(y, device)).numpy()
    np.testing.assert_allclose(got, x.astype(np.float64) @ y, rtol=1e-4, atol=1e-4)


def test_matmul_of_transposed_views(device):
    x = RNG.standard_normal((6, 4)).astype(np.float32)
    y = RNG.standard_normal((3, 6)).astype(np.float32)
    got = nd(x, device).permute((1, 0)) @ nd(y, device).permute((1, 0))
    np.testing.assert_allclose(got.numpy(), x.T @ y.T, rtol=1e-5, atol=1e-5)


def test_flip_and_pad(device):
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    a = nd(x, device)
    for axes in [(0,), (1, 2), (0, 1, 2)]:
        np.testing.assert_array_equal(a.flip(axes).numpy(), np.flip(x, axes))
    np.testing.assert_array_equal(a[:, 1:].flip((1,)).numpy(), np.flip(x[:, 1:], 1))
    pads = ((0, 0), (1, 2), (3, 0))
    np.testing.assert_array_equal(a.pad(pads).numpy(), np.pad(x, pads))


def test_device_constructors(device):
    np.testing.assert_array_equal(device.zeros(2, 3).numpy(), np.zeros((2, 3)))
    np.testing.assert_array_equal(device.ones((3,)).numpy(), np.ones(3))
    np.testing.assert_array_equal(device.full((2, 2), 4.5).numpy(), np.full((2, 2), 4.5))
    labels = np.array([2, 0, 1, 2])
    np.testing.assert_array_equal(device.one_hot(3, labels).numpy(), np.eye(3)[labels])
    samples = device.randn(200, 50).numpy()
    assert samples.shape == (200, 50) and abs(samples.mean()) < 0.05 and 0.9 < samples.std() < 1.1
    uniform = device.rand(1000).numpy()
    assert uniform.min() >= 0 and uniform.max() < 1 and 0.45 < uniform.mean() < 0.55
    assert device.empty((4, 0)).shape == (4, 0)
    np.testing.assert_array_equal(
        ndl.backend_ndarray.full((2,), 3.0, device=device).numpy(), [3, 3]
    )


def test_copy_between_devices(device):
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    a = nd(x, ndl.cpu_numpy())[:, 1:]
    moved = a.to(device)
    assert moved.device == device
    np.testing.assert_array_equal(moved.numpy(), x[:, 1:])
    back = moved.to(ndl.cpu_numpy())
    np.testing.assert_array_equal(back.numpy(), x[:, 1:])
    copy = NDArray(moved)
    assert copy.handle is not moved.handle
    np.testing.assert_array_equal(copy.numpy(), x[:, 1:])


def test_kernel_reads_of_a_view_copy_it_once_until_a_write(device):
    x = RNG.standard_normal((4, 3)).astype(np.float32)
    a = nd(x, device)
    view = a.permute((1, 0))
    first = view._compact_read()
    assert view._compact_read() is first  # read twice (forward, backward): copied once
    a[0, 0] = 42.0  # a write to the base buffer invalidates the copy
    x[0, 0] = 42.0
    second = view._compact_read()
    assert second is not first
    np.testing.assert_array_equal(second.numpy(), x.T)
    second[1, 1] = -5.0  # so does a write into the copy itself
    third = view._compact_read()
    assert third is not second
    np.testing.assert_array_equal(third.numpy(), x.T)
    other_view = a[1:].permute((1, 0))  # views of one buffer share the write counter
    other_view._compact_read()
    view[2] = 0.0
    x[:, 2] = 0.0
    np.testing.assert_array_equal(other_view._compact_read().numpy(), x[1:].T)


def test_compact_and_reshape_copies_are_never_shared(device):
    """Like numpy's copies: a write into one never shows in another."""
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    view = nd(x, device).permute((1, 0))
    cached = view._compact_read()
    mine = view.compact()
    assert mine is cached  # a kernel's cached copy is handed over, not copied again
    mine[0, 0] = 7.0
    np.testing.assert_array_equal(view._compact_read().numpy(), x.T)
    c1, c2 = view.compact(), view.compact()
    r1, r2 = view.reshape((6,)), view.reshape((6,))
    c1[0, 0] = -1.0
    r1[0] = 99.0
    np.testing.assert_array_equal(c2.numpy(), x.T)
    np.testing.assert_array_equal(r2.numpy(), x.T.ravel())
    np.testing.assert_array_equal(view.numpy(), x.T)


def test_comparisons_with_nan_match_numpy(device):
    x = np.array([np.nan, 1.0, 2.0, -np.inf, np.inf], np.float32)
    y = np.array([1.0, np.nan, 2.0, -np.inf, 0.0], np.float32)
    a, b = nd(x, device), nd(y, device)
    for op in (operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne):
        np.testing.assert_array_equal(op(a, b).numpy(), op(x, y), err_msg=op.__name__)
        np.testing.assert_array_equal(op(a, 1.5).numpy(), op(x, 1.5), err_msg=op.__name__)


def test_truth_value_and_len_follow_numpy(device):
    assert not nd([0.0], device) and nd([[2.0]], device)
    assert not (ndl.Tensor([0.0], device=device) == 1.0)
    with pytest.raises(ValueError, match="ambiguous"):
        bool(nd([0.0, 0.0], device))
    with pytest.raises(TypeError, match="0-d"):
        len(nd(np.float32(3.0), device))
    assert len(nd(np.zeros((3, 2)), device)) == 3


def test_numpy_arrays_as_operands(device):
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    y = RNG.standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_allclose((nd(x, device) * y).numpy(), x * y, rtol=1e-6)
    a = nd(np.zeros((2, 3)), device)
    a[:, 1:] = y[:, 1:]
    np.testing.assert_array_equal(a.numpy()[:, 1:], y[:, 1:])
    with pytest.raises(ValueError, match="differ"):
        nd(x, device) + y[:1]


@pytest.mark.parametrize("a_shape, b_shape", [((2, 3, 0), (0, 4)), ((2, 3, 0), (2, 0, 4))])
def test_matmul_with_empty_inner_dimension(device, a_shape, b_shape):
    got = (nd(np.ones(a_shape), device) @ nd(np.ones(b_shape), device)).numpy()
    np.testing.assert_array_equal(got, np.ones(a_shape) @ np.ones(b_shape))


def test_allow_tf32_uses_the_tensor_core_path_only_where_it_exists(device):
    x = RNG.standard_normal((64, 96)).astype(np.float32)
    y = RNG.standard_normal((96, 32)).astype(np.float32)
    a, b = nd(x, device), nd(y, device)
    exact = (a @ b).numpy()
    with ndl.backend_ndarray.allow_tf32():
        fast = (a @ b).numpy()
    reference = x.astype(np.float64) @ y
    if hasattr(device.mod, "matmul_tf32"):  # 10-bit mantissa inputs: about 1e-3 relative
        np.testing.assert_allclose(fast, reference, rtol=0, atol=5e-3 * np.abs(reference).max())
    else:
        np.testing.assert_array_equal(fast, exact)


def test_setitem_from_an_overlapping_view_of_the_same_buffer(device):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = nd(x, device)
    a[::-1] = a
    np.testing.assert_array_equal(a.numpy(), x[::-1])
    a[:, 1:] = a[:, :-1]
    expected = x[::-1].copy()
    expected[:, 1:] = expected[:, :-1].copy()
    np.testing.assert_array_equal(a.numpy(), expected)


def test_special_values_follow_ieee_without_warnings(device):
    """log(0), x/0, overflowing products and sums give numpy's IEEE values on every backend,
    quietly (the numpy backend used to emit RuntimeWarnings where the C++ ones did not)."""
    x = np.array([0.0, -1.0, 3e38, -3e38, 2.0], dtype=np.float32)
    a = nd(x, device)
    with np.errstate(all="ignore"):
        expected = [np.log(x), x / np.float32(0), x * x, np.sqrt(x), np.exp(x * 100),
                    x + x, np.sum(x[2:3].repeat(2))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = [a.log(), a / 0.0, a * a, a ** 0.5, (a * 100.0).exp(), a + a,
               nd(x[2:3].repeat(2), device).sum()]
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-6)
