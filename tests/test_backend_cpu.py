"""The C++ CPU backend's primitives, called directly, checked against numpy."""

import numpy as np
import pytest

cpu = pytest.importorskip("needle.backend_ndarray.ndarray_backend_cpu")

RNG = np.random.default_rng(2024)
PARALLEL_SIZE = 1_100_003  # above the module's OpenMP threshold (2**20), and odd


def to_array(x: np.ndarray):
    out = cpu.Array(x.size)
    cpu.from_numpy(np.ascontiguousarray(x, dtype=np.float32), out)
    return out


def flat(a) -> np.ndarray:
    return cpu.to_numpy(a, (a.size,), (1,), 0)


def view_indices(shape, strides, offset) -> np.ndarray:
    """Buffer index of every element of a strided view, computed independently of the module."""
    grids = np.indices(shape, dtype=np.int64) if shape else np.zeros((0,), dtype=np.int64)
    idx = np.full(shape, offset, dtype=np.int64)
    for d, stride in enumerate(strides):
        idx += grids[d] * stride
    return idx


def random_view(rng, distinct: bool):
    """A random in-bounds view: permuted, stepped, reversed, broadcast (unless distinct)."""
    ndim = int(rng.integers(1, 5))
    base_shape = tuple(int(s) for s in rng.integers(1, 7, size=ndim))
    strides = [int(np.prod(base_shape[d + 1 :])) for d in range(ndim)]
    offset, shape = 0, []
    for d in range(ndim):
        step = int(rng.integers(1, 3))
        start = int(rng.integers(0, base_shape[d]))
        length = len(range(start, base_shape[d], step))
        if rng.random() < 0.25:  # reversed axis: negative stride from the last selected element
            offset += (start + (length - 1) * step) * strides[d]
            strides[d] *= -step
        else:
            offset += start * strides[d]
            strides[d] *= step
        shape.append(length)
        if not distinct and rng.random() < 0.25:
            shape[d], strides[d] = int(rng.integers(1, 4)), 0  # broadcast axis
    perm = rng.permutation(ndim)
    shape = tuple(shape[p] for p in perm)
    strides = tuple(strides[p] for p in perm)
    return int(np.prod(base_shape)), shape, strides, offset


def test_module_attributes_and_array():
    assert cpu.__device_name__ == "cpu"
    assert isinstance(cpu.__tile_size__, int) and cpu.__tile_size__ >= 1
    a, b = cpu.Array(10), cpu.Array(0)
    assert (a.size, b.size) == (10, 0)
    assert a.ptr() != 0 and a.ptr() % 64 == 0
    assert a.ptr() != cpu.Array(10).ptr()
    with pytest.raises(ValueError, match="size"):
        cpu.Array(-1)
    with pytest.raises(MemoryError):
        cpu.Array(1 << 62)  # 2**64 bytes: the byte count must not wrap around


def test_fill_and_numpy_round_trip():
    x = RNG.standard_normal(37).astype(np.float32)
    a = to_array(x)
    np.testing.assert_array_equal(flat(a), x)
    np.testing.assert_array_equal(cpu.to_numpy(a, (37, 1), (1, 0), 0), x.reshape(37, 1))
    assert cpu.to_numpy(a, (), (), 5).shape == ()
    assert cpu.to_numpy(a, (), (), 5) == x[5]
    strided = RNG.standard_normal((6, 8)).astype(np.float32)[:, ::2]  # not contiguous
    b = cpu.Array(strided.size)
    cpu.from_numpy(strided, b)
    np.testing.assert_array_equal(flat(b), strided.reshape(-1))
    cpu.fill(a, 2.5)
    np.testing.assert_array_equal(flat(a), np.full(37, 2.5, np.float32))


def test_from_numpy_rejects_bad_input():
    with pytest.raises(ValueError, match="float32"):
        cpu.from_numpy(np.zeros(4, dtype=np.float64), cpu.Array(4))
    with pytest.raises(ValueError, match="elements"):
        cpu.from_numpy(np.zeros(5, dtype=np.float32), cpu.Array(4))
    with pytest.raises(TypeError):
        cpu.from_numpy(np.zeros(4, dtype=np.float32), np.zeros(4, dtype=np.float32))


@pytest.mark.parametrize("seed", range(40))
def test_compact_random_views(seed):
    rng = np.random.default_rng(seed)
    size, shape, strides, offset = random_view(rng, distinct=False)
    base = rng.standard_normal(size).astype(np.float32)
    out = cpu.Array(int(np.prod(shape)))
    cpu.compact(to_array(base), out, shape, strides, offset)
    expected = base[view_indices(shape, strides, offset)]
    np.testing.assert_array_equal(flat(out), expected.reshape(-1))
    np.testing.assert_array_equal(cpu.to_numpy(to_array(base), shape, strides, offset), expected)


@pytest.mark.parametrize("seed", range(40))
def test_setitem_random_views(seed):
    rng = np.random.default_rng(1000 + seed)
    size, shape, strides, offset = random_view(rng, distinct=True)
    base = rng.standard_normal(size).astype(np.float32)
    values = rng.standard_normal(shape).astype(np.float32)
    idx = view_indices(shape, strides, offset)

    out = to_array(base)
    cpu.ewise_setitem(to_array(values), out, shape, strides, offset)
    expected = base.copy()
    expected[idx] = values
    np.testing.assert_array_equal(flat(out), expected)

    out = to_array(base)
    cpu.scalar_setitem(values.size, -3.0, out, shape, strides, offset)
    expected = base.copy()
    expected[idx] = -3.0
    np.testing.assert_array_equal(flat(out), expected)


def test_setitem_from_its_own_buffer():
    x = np.arange(12, dtype=np.float32)
    a = to_array(x)
    cpu.ewise_setitem(a, a, (3, 4), (-4, -1), 11)  # a[::-1] = a
    np.testing.assert_array_equal(flat(a), x[::-1])


@pytest.mark.parametrize(
    "shape, axes",
    [
        ((300, 400), (1, 0)),  # transpose, tiles with ragged edges
        ((5, 33, 17), (0, 2, 1)),  # a batch of transposes
        ((4, 5, 6, 7), (0, 3, 1, 2)),  # NHWC -> NCHW: the spatial axes merge
        ((4, 5, 6, 7), (0, 2, 3, 1)),  # NCHW -> NHWC
        ((3, 20, 20, 32), (0, 3, 1, 2)),  # a batch of 32 x 400 transposes in whole tiles
        ((6, 7, 8), (2, 1, 0)),
    ],
)
def test_permuted_copies_match_numpy(shape, axes):
    x = RNG.standard_normal(shape).astype(np.float32)
    compact_strides = [int(np.prod(shape[d + 1 :])) for d in range(len(shape))]
    view_shape = tuple(shape[d] for d in axes)
    out = cpu.Array(x.size)
    cpu.compact(to_array(x), out, view_shape, tuple(compact_strides[d] for d in axes), 0)
    np.testing.assert_array_equal(flat(out), x.transpose(axes).reshape(-1))


@pytest.mark.parametrize(
    "shape, strides, offset, error, message",
    [
        ((3, 4), (4, 1), 1, IndexError, "outside"),  # last element one past the end
        ((3, 4), (4, 1), -1, IndexError, "outside"),  # negative offset
        ((3, 4), (-4, 1), 0, IndexError, "outside"),  # negative stride walks before the start
        ((2, 2), (4, 100), 0, IndexError, "outside"),  # stride past the end
        ((2, 2), (1 << 62, 1 << 62), 0, IndexError, "overflow"),
        ((3, 4), (4,), 0, ValueError, "dims"),  # strides/shape length differ
        ((-1, 4), (4, 1), 0, ValueError, ">= 0"),
    ],
)
def test_views_out_of_range_raise(shape, strides, offset, error, message):
    a = to_array(np.arange(12, dtype=np.float32))
    numel = max(int(np.prod(shape)), 0)
    with pytest.raises(error, match=message):
        cpu.compact(a, cpu.Array(numel), shape, strides, offset)
    with pytest.raises(error, match=message):
        cpu.ewise_setitem(cpu.Array(numel), a, shape, strides, offset)
    with pytest.raises(error, match=message):
        cpu.scalar_setitem(numel, 1.0, a, shape, strides, offset)
    with pytest.raises(error, match=message):
        cpu.to_numpy(a, shape, strides, offset)
    np.testing.assert_array_equal(flat(a), np.arange(12, dtype=np.float32))  # untouched


def test_view_size_mismatch_raises():
    a = to_array(np.arange(12, dtype=np.float32))
    with pytest.raises(ValueError, match="out has 5"):
        cpu.compact(a, cpu.Array(5), (3, 4), (4, 1), 0)
    with pytest.raises(ValueError, match="source has 5"):
        cpu.ewise_setitem(cpu.Array(5), a, (3, 4), (4, 1), 0)
    with pytest.raises(ValueError, match="size is 5"):
        cpu.scalar_setitem(5, 0.0, a, (3, 4), (4, 1), 0)


BINARY = {
    "add": np.add,
    "mul": np.multiply,
    "div": np.divide,
    "pow": np.power,
    "maximum": np.maximum,
    "eq": lambda x, y: np.equal(x, y).astype(np.float32),
    "ge": lambda x, y: np.greater_equal(x, y).astype(np.float32),
}
SCALAR_NAME = {"pow": "scalar_power"}
UNARY = {"log": np.log, "exp": np.exp, "tanh": np.tanh, "sqrt": np.sqrt}


def operands(name: str, size: int):
    if name == "pow":
        return RNG.uniform(0.1, 3.0, size), RNG.uniform(-2.0, 2.0, size)
    if name in ("eq", "ge", "maximum"):  # small integers, so ties occur
        return RNG.integers(-3, 4, size), RNG.integers(-3, 4, size)
    if name == "div":
        return RNG.standard_normal(size), RNG.uniform(0.5, 2.0, size) * RNG.choice([-1, 1], size)
    return RNG.standard_normal(size), RNG.standard_normal(size)


@pytest.mark.parametrize("size", [1, 17, PARALLEL_SIZE])
@pytest.mark.parametrize("name", BINARY)
def test_binary_ops(name, size):
    x, y = (v.astype(np.float32) for v in operands(name, size))
    out = cpu.Array(size)
    getattr(cpu, f"ewise_{name}")(to_array(x), to_array(y), out)
    np.testing.assert_allclose(flat(out), BINARY[name](x, y), rtol=2e-6, atol=0)

    val = float(y[0])
    getattr(cpu, SCALAR_NAME.get(name, f"scalar_{name}"))(to_array(x), val, out)
    np.testing.assert_allclose(flat(out), BINARY[name](x, np.float32(val)), rtol=2e-6, atol=0)


@pytest.mark.parametrize("size", [1, 17, PARALLEL_SIZE])
@pytest.mark.parametrize("name", UNARY)
def test_unary_ops(name, size):
    x = RNG.standard_normal(size).astype(np.float32)
    if name in ("log", "sqrt"):
        x = np.abs(x) + np.float32(1e-3)
    out = cpu.Array(size)
    getattr(cpu, f"ewise_{name}")(to_array(x), out)
    np.testing.assert_allclose(flat(out), UNARY[name](x), rtol=2e-6, atol=1e-7)


def test_nan_propagation_matches_numpy():
    x = np.array([np.nan, 1.0, 2.0, np.nan], dtype=np.float32)
    y = np.array([0.0, np.nan, 1.0, np.nan], dtype=np.float32)
    out = cpu.Array(4)
    cpu.ewise_maximum(to_array(x), to_array(y), out)
    np.testing.assert_array_equal(flat(out), np.maximum(x, y))
    cpu.ewise_eq(to_array(x), to_array(y), out)
    np.testing.assert_array_equal(flat(out), np.equal(x, y).astype(np.float32))
    red = cpu.Array(2)
    cpu.reduce_max(to_array(y), red, 2)
    np.testing.assert_array_equal(flat(red), y.reshape(2, 2).max(axis=1))


def test_unary_ops_outside_their_domain_match_numpy():
    x = np.array([-1.0, 0.0, 4.0, np.nan, np.inf], dtype=np.float32)
    out = cpu.Array(x.size)
    with np.errstate(all="ignore"):
        for name, reference in UNARY.items():
            getattr(cpu, f"ewise_{name}")(to_array(x), out)
            np.testing.assert_allclose(flat(out), reference(x), rtol=2e-6, err_msg=name)


@pytest.mark.parametrize("op", ["ewise_add", "ewise_eq", "ewise_pow"])
def test_binary_size_mismatch_raises(op):
    with pytest.raises(ValueError, match="elements"):
        getattr(cpu, op)(cpu.Array(3), cpu.Array(4), cpu.Array(3))
    with pytest.raises(ValueError, match="elements"):
        getattr(cpu, op)(cpu.Array(3), cpu.Array(3), cpu.Array(2))


@pytest.mark.parametrize("op", ["scalar_mul", "scalar_ge"])
def test_scalar_size_mismatch_raises(op):
    with pytest.raises(ValueError, match="elements"):
        getattr(cpu, op)(cpu.Array(3), 1.0, cpu.Array(4))
    with pytest.raises(ValueError, match="elements"):
        cpu.ewise_exp(cpu.Array(3), cpu.Array(4))


@pytest.mark.parametrize(
    "groups, reduce_size", [(1, 1), (5, 1), (1, 7), (13, 9), (3, PARALLEL_SIZE), (PARALLEL_SIZE, 3)]
)
def test_reductions(groups, reduce_size):
    x = RNG.standard_normal((groups, reduce_size)).astype(np.float32)
    out = cpu.Array(groups)
    cpu.reduce_max(to_array(x), out, reduce_size)
    np.testing.assert_array_equal(flat(out), x.max(axis=1))
    cpu.reduce_sum(to_array(x), out, reduce_size)
    exact = x.astype(np.float64).sum(axis=1)
    bound = 1e-6 * np.abs(x).astype(np.float64).sum(axis=1) + 1e-7
    assert np.all(np.abs(flat(out) - exact) <= bound)


@pytest.mark.parametrize("op", ["reduce_sum", "reduce_max"])
def test_reduction_bad_sizes_raise(op):
    with pytest.raises(ValueError, match="reduce_size"):
        getattr(cpu, op)(cpu.Array(6), cpu.Array(2), 4)
    with pytest.raises(ValueError, match="reduce_size must be >= 1"):
        getattr(cpu, op)(cpu.Array(0), cpu.Array(3), 0)


def check_matmul(m: int, n: int, p: int):
    x = RNG.standard_normal((m, n)).astype(np.float32)
    y = RNG.standard_normal((n, p)).astype(np.float32)
    out = cpu.Array(m * p)
    cpu.fill(out, np.nan)  # every element must be written
    cpu.matmul(to_array(x), to_array(y), out, m, n, p)
    got = cpu.to_numpy(out, (m, p), (p, 1), 0)
    exact = x.astype(np.float64) @ y.astype(np.float64)
    # float32 accumulation in any order: |error| <= n * eps * (|x| @ |y|) (plus rounding slack)
    bound = 1.01 * n * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(y)).astype(np.float64)
    assert np.all(np.abs(got - exact) <= bound + 1e-30), f"{m}x{n}x{p}"


@pytest.mark.parametrize(
    "m, n, p",
    [
        (1, 1, 1),
        (6, 16, 16),  # exactly one register tile
        (5, 3, 7),
        (7, 17, 15),  # one past / one short of the tile
        (64, 64, 64),
        (97, 255, 33),
        (130, 300, 145),  # crosses the K and M cache blocks, multi-threaded
        (256, 513, 260),
        (2000, 3, 7),  # tall and skinny
        (1, 1000, 1),  # dot product
        (1, 700, 300),  # vector @ matrix
        (300, 700, 1),  # matrix @ vector
        (6, 300, 4200),  # wide and short: threads split the columns
        (7, 2100, 1100),  # B packed in two panels
        (13, 1, 9),  # outer product
    ],
)
def test_matmul_shapes(m, n, p):
    check_matmul(m, n, p)


def test_matmul_empty_dims():
    out = cpu.Array(6)
    cpu.fill(out, 5.0)
    cpu.matmul(cpu.Array(0), cpu.Array(0), out, 2, 0, 3)
    np.testing.assert_array_equal(flat(out), np.zeros(6, np.float32))
    cpu.matmul(cpu.Array(0), cpu.Array(12), cpu.Array(0), 0, 4, 3)


def test_matmul_output_aliasing_an_input():
    x = RNG.standard_normal((40, 40)).astype(np.float32)
    y = RNG.standard_normal((40, 40)).astype(np.float32)
    a, b = to_array(x), to_array(y)
    cpu.matmul(a, b, a, 40, 40, 40)
    np.testing.assert_allclose(flat(a).reshape(40, 40), x @ y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "sizes, dims, message",
    [
        ((5, 12, 8), (2, 3, 4), "a has 5 elements, expected 2 x 3"),
        ((6, 11, 8), (2, 3, 4), "b has 11"),
        ((6, 12, 9), (2, 3, 4), "out has 9"),
        ((6, 12, 8), (-2, 3, 4), ">= 0"),
        ((6, 12, 8), (1 << 40, 1 << 40, 1), "expected"),  # m * n overflows
    ],
)
def test_matmul_bad_sizes_raise(sizes, dims, message):
    with pytest.raises(ValueError, match=message):
        cpu.matmul(*(cpu.Array(s) for s in sizes), *dims)


def _matmul_in_child(conn, x: np.ndarray, y: np.ndarray) -> None:
    m, n = x.shape
    out = cpu.Array(m * y.shape[1])
    cpu.matmul(to_array(x), to_array(y), out, m, n, y.shape[1])
    total = cpu.Array(1)
    cpu.reduce_sum(to_array(x), total, x.size)
    conn.send((cpu.to_numpy(out, (m, y.shape[1]), (y.shape[1], 1), 0), flat(total)))


def test_forked_child_after_parallel_work_computes():
    """libgomp's pool does not survive fork(); the module must fall back instead of hanging."""
    multiprocessing = pytest.importorskip("multiprocessing")
    x = RNG.standard_normal((300, 400)).astype(np.float32)
    y = RNG.standard_normal((400, 200)).astype(np.float32)
    cpu.matmul(to_array(x), to_array(y), cpu.Array(300 * 200), 300, 400, 200)  # starts the pool
    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_matmul_in_child, args=(sender, x, y))
    child.start()
    try:
        assert receiver.poll(60), "forked child produced no result within 60 s (hung?)"
        product, total = receiver.recv()
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0
    np.testing.assert_allclose(product, x @ y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(total, [x.astype(np.float64).sum()], rtol=1e-5, atol=1e-3)
