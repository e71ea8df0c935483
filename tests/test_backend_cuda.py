"""The CUDA backend module's primitives against numpy (float64 references where sums are involved).

Skips where the module is not built; the GPU tests skip where no GPU is present.
"""

import numpy as np
import pytest

cuda = pytest.importorskip("needle.backend_ndarray.ndarray_backend_cuda")

has_gpu = cuda.device_count() > 0
gpu = pytest.mark.skipif(not has_gpu, reason="no CUDA GPU on this machine")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def to_device(x: np.ndarray):
    arr = cuda.Array(x.size)
    cuda.from_numpy(np.ascontiguousarray(x, dtype=np.float32).ravel(), arr)
    return arr


def to_host(arr, shape=None) -> np.ndarray:
    shape = (arr.size,) if shape is None else tuple(shape)
    return cuda.to_numpy(arr, shape, compact_strides(shape), 0)


def compact_strides(shape):
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def view_of(flat: np.ndarray, shape, strides, offset) -> np.ndarray:
    """The strided view by explicit index arithmetic, independent of the kernels' loop."""
    index = np.full(shape, offset, dtype=np.int64)
    for axis, (dim, stride) in enumerate(zip(shape, strides, strict=True)):
        steps = np.arange(dim).reshape([-1 if a == axis else 1 for a in range(len(shape))])
        index = index + steps * stride
    return flat[index]


def test_device_count_never_raises_and_validation_needs_no_gpu():
    count = cuda.device_count()
    assert isinstance(count, int) and count >= 0
    assert cuda.__device_name__ == "cuda" and cuda.__tile_size__ >= 1
    assert cuda.Array(0).size == 0  # an empty buffer allocates nothing
    with pytest.raises(ValueError, match="size"):
        cuda.Array(-1)
    with pytest.raises(ValueError, match="float32"):
        cuda.from_numpy(np.zeros(0, dtype=np.float64), cuda.Array(0))
    with pytest.raises(ValueError, match="reduce_size must be >= 1"):
        cuda.reduce_sum(cuda.Array(0), cuda.Array(0), 0)


@pytest.mark.skipif(has_gpu, reason="checks the no-GPU error path")
def test_allocation_without_gpu_raises():
    with pytest.raises(RuntimeError):
        cuda.Array(16)


@gpu
@pytest.mark.parametrize("size", [0, 1, 5, 1024, 100_003])
def test_roundtrip_and_fill(rng, size):
    x = rng.standard_normal(size).astype(np.float32)
    arr = to_device(x)
    assert arr.size == size
    np.testing.assert_array_equal(to_host(arr), x)
    cuda.fill(arr, 2.5)
    np.testing.assert_array_equal(to_host(arr), np.full(size, 2.5, dtype=np.float32))


@gpu
def test_strided_numpy_input_and_zero_dim_output(rng):
    x = rng.standard_normal((6, 8)).astype(np.float32)[:, ::2]  # not contiguous
    a = cuda.Array(x.size)
    cuda.from_numpy(x, a)
    np.testing.assert_array_equal(to_host(a), x.ravel())
    scalar = cuda.to_numpy(a, (), (), 5)
    assert scalar.shape == () and scalar == x.ravel()[5]


@gpu
def test_reused_buffers_never_alias_live_ones(rng):
    a, b = cuda.Array(1000), cuda.Array(1000)
    assert a.ptr() != b.ptr()
    x = rng.standard_normal(1000).astype(np.float32)
    cuda.from_numpy(x, b)
    del a
    c = cuda.Array(1000)  # may reuse a's memory, never b's
    assert c.ptr() != b.ptr()
    cuda.fill(c, -1.0)
    np.testing.assert_array_equal(to_host(b), x)
    np.testing.assert_array_equal(to_host(c), -np.ones(1000, dtype=np.float32))


VIEWS = [
    # (buffer size, shape, strides, offset)
    (24, (2, 3, 4), (12, 4, 1), 0),  # compact
    (24, (4, 3, 2), (1, 4, 12), 0),  # permuted
    (24, (3, 4), (0, 1), 8),  # broadcast row
    (30, (2, 2, 3), (15, 5, 1), 7),  # slice with offset
    (10, (5,), (-2,), 9),  # negative stride
    (7, (1, 1, 7), (0, 0, 1), 0),
    (2 * 6 * 6 * 3, (2, 4, 4, 3, 3, 3), (108, 18, 3, 18, 3, 1), 0),  # im2col windows
    (300_000, (500, 300), (1, 1000), 3),  # large transposed
]


@gpu
@pytest.mark.parametrize("size,shape,strides,offset", VIEWS)
def test_compact_and_strided_to_numpy(rng, size, shape, strides, offset):
    flat = rng.standard_normal(size).astype(np.float32)
    a = to_device(flat)
    expected = view_of(flat, shape, strides, offset)
    out = cuda.Array(int(np.prod(shape)))
    cuda.compact(a, out, shape, strides, offset)
    np.testing.assert_array_equal(to_host(out, shape), expected)
    np.testing.assert_array_equal(cuda.to_numpy(a, shape, strides, offset), expected)


def writes_each_element_once(view) -> bool:
    size, shape, strides, offset = view
    index = view_of(np.arange(size), shape, strides, offset)
    return np.unique(index).size == index.size


@gpu
@pytest.mark.parametrize(
    "size,shape,strides,offset", [v for v in VIEWS if writes_each_element_once(v)]
)
def test_setitem(rng, size, shape, strides, offset):
    base = rng.standard_normal(size).astype(np.float32)
    values = rng.standard_normal(shape).astype(np.float32)
    index = view_of(np.arange(size), shape, strides, offset)

    out = to_device(base)
    cuda.ewise_setitem(to_device(values), out, shape, strides, offset)
    expected = base.copy()
    expected[index] = values
    np.testing.assert_array_equal(to_host(out), expected)

    out = to_device(base)
    cuda.scalar_setitem(int(np.prod(shape)), 4.0, out, shape, strides, offset)
    expected = base.copy()
    expected[index] = 4.0
    np.testing.assert_array_equal(to_host(out), expected)


BINARY = {
    "add": np.add,
    "mul": np.multiply,
    "div": np.divide,
    "pow": np.power,
    "maximum": np.maximum,
    "eq": lambda x, y: (x == y).astype(np.float32),
    "ge": lambda x, y: (x >= y).astype(np.float32),
}
SCALAR_NAMES = {"pow": "scalar_power"}


def operands(rng, size):
    x = rng.uniform(0.5, 2.0, size).astype(np.float32)
    y = rng.uniform(-2.0, 2.0, size).astype(np.float32)
    y[::3] = x[::3]  # exercise eq/ge on ties
    return x, y


@gpu
@pytest.mark.parametrize("name", BINARY)
@pytest.mark.parametrize("size", [1, 7, 1029, 100_003])
def test_ewise_binary(rng, name, size):
    x, y = operands(rng, size)
    out = cuda.Array(size)
    cuda.fill(out, np.nan)
    getattr(cuda, f"ewise_{name}")(to_device(x), to_device(y), out)
    np.testing.assert_allclose(to_host(out), BINARY[name](x, y), rtol=2e-6, atol=1e-7)


@gpu
@pytest.mark.parametrize("name", BINARY)
@pytest.mark.parametrize("size", [5, 4099])
def test_scalar_binary(rng, name, size):
    x, _ = operands(rng, size)
    val = float(x[size // 2])  # a value that also occurs in x, for eq/ge
    out = cuda.Array(size)
    getattr(cuda, SCALAR_NAMES.get(name, f"scalar_{name}"))(to_device(x), val, out)
    expected = BINARY[name](x, np.float32(val))
    np.testing.assert_allclose(to_host(out), expected, rtol=2e-6, atol=1e-7)


@gpu
@pytest.mark.parametrize(
    "name,fn", [("log", np.log), ("exp", np.exp), ("tanh", np.tanh), ("sqrt", np.sqrt)]
)
@pytest.mark.parametrize("size", [3, 65_537])
def test_ewise_unary(rng, name, fn, size):
    x = rng.uniform(0.01, 5.0, size).astype(np.float32)
    out = cuda.Array(size)
    getattr(cuda, f"ewise_{name}")(to_device(x), out)
    np.testing.assert_allclose(to_host(out), fn(x), rtol=2e-6, atol=1e-7)


@gpu
def test_maximum_propagates_nan_like_numpy():
    x = np.array([1.0, np.nan, 3.0, np.nan], dtype=np.float32)
    y = np.array([np.nan, 2.0, 1.0, np.nan], dtype=np.float32)
    out = cuda.Array(4)
    cuda.ewise_maximum(to_device(x), to_device(y), out)
    np.testing.assert_array_equal(to_host(out), np.maximum(x, y))
    groups = cuda.Array(2)
    cuda.reduce_max(to_device(x), groups, 2)
    np.testing.assert_array_equal(to_host(groups), np.max(x.reshape(2, 2), axis=1))


@gpu
@pytest.mark.parametrize("groups,size", [(1000, 1), (300, 7), (64, 300), (3, 10_000), (2, 70_001)])
def test_reductions(rng, groups, size):
    x = rng.standard_normal(groups * size).astype(np.float32)
    a = to_device(x)
    out = cuda.Array(groups)
    cuda.reduce_sum(a, out, size)
    ref = x.reshape(groups, size).astype(np.float64)
    bound = 1e-6 * np.abs(ref).sum(axis=1) + 1e-7
    assert np.all(np.abs(to_host(out) - ref.sum(axis=1)) <= bound)
    cuda.reduce_max(a, out, size)
    np.testing.assert_array_equal(to_host(out), x.reshape(groups, size).max(axis=1))


def relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


MATMUL_SHAPES = [
    (1, 1, 1),
    (3, 5, 7),
    (64, 64, 64),
    (129, 65, 257),  # not multiples of any tile, p % 4 != 0
    (200, 31, 96),  # n % 4 != 0
    (1536, 64, 1536),  # enough blocks for the large tile
    (1537, 33, 1531),  # large tile with ragged edges everywhere
    (1540, 36, 1532),  # large tile, 16-byte loads, ragged M and N, a partial K slice
    (5, 2000, 3),  # long inner dimension
    (17, 33, 65),  # odd everywhere
    (300, 4, 8),  # inner dimension shorter than one K slice
    (260, 36, 516),  # aligned rows, a partial K slice, ragged M and N tiles
    (1000, 1000, 1000),  # many full tiles plus ragged edges on every side
]


def run_matmul(fn, rng, m, n, p, operand_rounding):
    """Relative (Frobenius) error of `fn` against a float64 product, after checking every
    element against the worst-case bound for operands rounded (or truncated) with relative error
    `operand_rounding` and a float32 sum of n terms: |C - AB| <= (2 rounding + n 2^-24) |A| |B|
    to first order."""
    a = rng.standard_normal((m, n)).astype(np.float32)
    b = rng.standard_normal((n, p)).astype(np.float32)
    out = cuda.Array(m * p)
    cuda.fill(out, np.nan)  # every element must be written
    fn(to_device(a), to_device(b), out, m, n, p)
    got = to_host(out, (m, p))
    assert np.isfinite(got).all()
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = a64 @ b64
    bound = (2.2 * operand_rounding + (n + 2) * 2.0**-24) * (np.abs(a64) @ np.abs(b64))
    worst = np.unravel_index(np.argmax(np.abs(got - ref) - bound), ref.shape)
    assert abs(got[worst] - ref[worst]) <= bound[worst], f"C{worst}: {got[worst]} vs {ref[worst]}"
    return relative_error(got, ref)


@gpu
@pytest.mark.parametrize("m,n,p", MATMUL_SHAPES)
def test_matmul_float32(rng, m, n, p):
    assert run_matmul(cuda.matmul, rng, m, n, p, operand_rounding=0.0) < 1e-5


# On Hopper every shape takes the TMA/wgmma kernel: B transposed into scratch (A too, padded,
# where n % 4 != 0), a ring of K slices shared across each persistent block's tiles.
TF32_SHAPES = MATMUL_SHAPES + [
    (1, 4, 4),  # one element's row, K and N far below one box
    (700, 4097, 651),  # padded A, odd N, ragged everything, many K slices
    (129, 2052, 260),  # more K slices than ring stages, partial last slice, ragged M and N
    (2200, 40, 2100),  # 128 x 256 tiles, more than one per multiprocessor: the ring crosses tiles
    (1100, 100, 2000),  # 128 x 128 tiles, more than one per multiprocessor
]


@gpu
@pytest.mark.parametrize("m,n,p", TF32_SHAPES)
def test_matmul_tf32_is_tensor_core_precision(rng, m, n, p):
    # 2^-10: 10 mantissa bits, truncated (the Hopper kernel's shared-memory operand) or rounded
    err = run_matmul(cuda.matmul_tf32, rng, m, n, p, operand_rounding=2.0**-10)
    assert err < 2e-3
    if n >= 16:  # TF32 keeps 10 mantissa bits: visibly coarser than float32
        assert err > 1e-5


@gpu
@pytest.mark.parametrize("fn", [cuda.matmul, cuda.matmul_tf32])
def test_matmul_output_aliasing_an_input(rng, fn):
    x = rng.standard_normal((40, 40)).astype(np.float32)
    y = rng.standard_normal((40, 40)).astype(np.float32)
    a, b = to_device(x), to_device(y)
    fn(a, b, a, 40, 40, 40)
    np.testing.assert_allclose(to_host(a, (40, 40)), x @ y, rtol=1e-2, atol=1e-2)


@gpu
def test_matmul_with_empty_inner_dimension_gives_zeros():
    out = cuda.Array(6)
    cuda.fill(out, np.nan)
    cuda.matmul(cuda.Array(0), cuda.Array(0), out, 2, 0, 3)
    np.testing.assert_array_equal(to_host(out), np.zeros(6, dtype=np.float32))


@gpu
def test_bad_arguments_raise():
    a = cuda.Array(12)
    with pytest.raises(ValueError, match="from_numpy"):
        cuda.from_numpy(np.zeros(5, dtype=np.float32), a)
    with pytest.raises(IndexError):
        cuda.compact(a, cuda.Array(12), (3, 4), (4, 1), 1)  # runs one past the end
    with pytest.raises(IndexError):
        cuda.to_numpy(a, (4,), (-1,), 2)  # runs before the start
    with pytest.raises(ValueError):
        cuda.compact(a, cuda.Array(5), (3, 4), (4, 1), 0)  # out has the wrong size
    with pytest.raises(ValueError):
        cuda.compact(a, cuda.Array(1), (1,) * 13, (0,) * 13, 0)  # too many dimensions
    with pytest.raises(ValueError, match="elements"):
        cuda.ewise_add(a, cuda.Array(3), cuda.Array(12))
    with pytest.raises(ValueError, match="elements"):
        cuda.scalar_mul(a, 2.0, cuda.Array(11))
    with pytest.raises(ValueError, match="out has 15"):
        cuda.matmul(a, a, cuda.Array(15), 4, 3, 4)
    with pytest.raises(ValueError, match=">= 0"):
        cuda.matmul_tf32(a, a, a, -4, 3, 4)
    with pytest.raises(ValueError, match="expected"):
        cuda.matmul(a, a, a, 1 << 40, 1 << 40, 1)  # m * n overflows
    with pytest.raises(ValueError, match="reduce_size must be >= 1"):
        cuda.reduce_max(a, cuda.Array(2), 0)
    with pytest.raises(ValueError, match="reduce_size"):
        cuda.reduce_sum(a, cuda.Array(2), 5)
    with pytest.raises(ValueError, match="size is 3"):
        cuda.scalar_setitem(3, 1.0, a, (2, 2), (2, 1), 0)
    np.testing.assert_array_equal(cuda.to_numpy(a, (1,), (1,), 11).shape, (1,))  # still usable
