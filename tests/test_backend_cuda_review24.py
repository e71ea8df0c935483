"""Review 24 of the CUDA backend (csrc/ndarray_backend_cuda.cu): regression tests for the defects
found by reading it, each against numpy or the numpy backend. Each docstring says why the code
before the fix fails the test.

Skips where the module is not built; the GPU tests skip where no GPU is present. Each needs
well under 1 GiB of GPU memory.
"""

import numpy as np
import pytest

cuda = pytest.importorskip("needle.backend_ndarray.ndarray_backend_cuda")

import needle.backend_ndarray as nd  # noqa: E402 (after the skip: only where the module exists)
from needle.backend_ndarray import ndarray_backend_numpy as reference  # noqa: E402

has_gpu = cuda.device_count() > 0
gpu = pytest.mark.skipif(not has_gpu, reason="no CUDA GPU on this machine")


@pytest.fixture
def rng():
    return np.random.default_rng(24)


def to_device(x: np.ndarray):
    arr = cuda.Array(x.size)
    cuda.from_numpy(np.ascontiguousarray(x, dtype=np.float32).ravel(), arr)
    return arr


def to_host(arr) -> np.ndarray:
    return cuda.to_numpy(arr, (arr.size,), (1,), 0)


def on_reference(x: np.ndarray):
    arr = reference.Array(x.size)
    reference.from_numpy(np.ascontiguousarray(x, dtype=np.float32).ravel(), arr)
    return arr


# ------------------------------------------------------------------------------------------
# compact / ewise_setitem with the source buffer also the destination

N = 1 << 22  # enough threads, over several waves, for the read/write race to show
IN_PLACE_VIEWS = [
    ((N,), (-1,), N - 1),  # reversed
    ((1024, N // 1024), (1, 1024), 0),  # transposed
]


@gpu
@pytest.mark.parametrize("shape,strides,offset", IN_PLACE_VIEWS, ids=["reversed", "transposed"])
def test_compact_into_its_own_buffer_reads_every_element_first(shape, strides, offset):
    """The cpu module (read_before_writing) and the numpy one (np.copyto) compact a view of x
    into x itself as if from a copy. The CUDA kernels read a[view(i)] and write a[i] in the same
    buffer from many threads at once, so elements were read after other threads had overwritten
    them (a race: with 4M elements reversed or transposed in place, many come out wrong)."""
    x = np.arange(N, dtype=np.float32)
    expected = on_reference(x)
    reference.compact(expected, expected, shape, strides, offset)
    a = to_device(x)
    cuda.compact(a, a, shape, strides, offset)
    np.testing.assert_array_equal(to_host(a), expected.array)


@gpu
@pytest.mark.parametrize("shape,strides,offset", IN_PLACE_VIEWS, ids=["reversed", "transposed"])
def test_ewise_setitem_from_its_own_buffer_reads_every_element_first(shape, strides, offset):
    """As above for x[view] = x: the cpu and numpy modules write the values x had before; the
    CUDA kernel's threads read elements that others had already written (a race)."""
    x = np.arange(N, dtype=np.float32)
    expected = on_reference(x)
    reference.ewise_setitem(expected, expected, shape, strides, offset)
    a = to_device(x)
    cuda.ewise_setitem(a, a, shape, strides, offset)
    np.testing.assert_array_equal(to_host(a), expected.array)


# ------------------------------------------------------------------------------------------
# One-row products (NDArray's sums over leading axes)


@gpu
def test_sum_over_leading_axes_of_many_rows_is_not_stuck_at_2_24():
    """NDArray sums leading axes as ones(1, R) @ x(R, C) with the device's matmul. The CUDA
    sgemm added each output's R products in one float32 chain, which stops growing at 2^24 when
    the terms are ones: 2^25 ones summed to 16777216 (half the answer), where numpy and the cpu
    backend give 33554432."""
    rows = 1 << 25
    x = nd.NDArray(np.ones((rows, 1), dtype=np.float32), device=nd.cuda())
    np.testing.assert_array_equal(x.sum(axis=0).numpy(), np.array([rows], dtype=np.float32))


@gpu
def test_sum_over_leading_axes_is_as_accurate_as_reduce_sum(rng):
    """The same product on realistic data (a bias gradient over 4M rows): each float32 chain of
    4M additions lost about 1e-4 of the sum, where reduce_sum (and now the one-row product)
    adds in double and is off by the final rounding alone."""
    x = rng.random((1 << 22, 5), dtype=np.float32)
    got = nd.NDArray(x, device=nd.cuda()).sum(axis=0).numpy()
    exact = x.astype(np.float64).sum(axis=0)
    np.testing.assert_array_less(np.abs(got - exact), 2.0**-23 * exact)


ROW_SHAPES = [(1, 1), (7, 1), (1, 33), (300, 5), (4097, 4099), (100_003, 64), (1 << 20, 3)]


@gpu
@pytest.mark.parametrize("fn", [cuda.matmul, cuda.matmul_tf32], ids=["float32", "tf32"])
@pytest.mark.parametrize("n,p", ROW_SHAPES)
def test_one_row_products_match_float64(rng, fn, n, p):
    """The one-row path for every K and N: each element within float32's final rounding of the
    float64 product, plus a double sum's error (both the float32 and the TF32 entry points take
    it). Before the fix the long products' float32 chains (and TF32's 10-bit operands) missed
    this bound."""
    a = rng.standard_normal((1, n)).astype(np.float32)
    b = rng.standard_normal((n, p)).astype(np.float32)
    out = cuda.Array(p)
    cuda.fill(out, np.nan)  # every element must be written
    fn(to_device(a), to_device(b), out, 1, n, p)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    bound = 2.0**-24 * np.abs(exact) + (n + 1) * 2.0**-52 * (np.abs(a) @ np.abs(b))
    assert np.all(np.abs(to_host(out) - exact.ravel()) <= bound.ravel())


@gpu
def test_one_row_product_special_values_and_aliasing():
    """NaN and inf as numpy gives them (0 * inf is NaN), and an output that is also the input
    row still reads the whole row first. (A guard for the new one-row path: passes before the
    fix too.)"""
    a = np.array([[0.0, 1.0, 2.0]], dtype=np.float32)
    b = np.array([[np.inf, 1.0, 0.0], [1.0, np.nan, 1.0], [1.0, 1.0, 3e38]], dtype=np.float32)
    out = cuda.Array(3)
    cuda.matmul(to_device(a), to_device(b), out, 1, 3, 3)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(to_host(out), (a @ b).ravel())
    x = np.arange(1.0, 5.0, dtype=np.float32).reshape(1, 4)
    w = np.arange(16.0, dtype=np.float32).reshape(4, 4)
    row = to_device(x)
    cuda.matmul(row, to_device(w), row, 1, 4, 4)
    np.testing.assert_array_equal(to_host(row), (x @ w).ravel())


@gpu
def test_running_out_of_gpu_memory_is_a_memory_error():
    """The cpu and numpy modules raise MemoryError; cuda raised RuntimeError, which code that
    catches running out of memory (the chain's verdicts, for one) let through."""
    with pytest.raises(MemoryError, match="cannot allocate .* bytes on the GPU"):
        cuda.Array(1 << 38)  # 1 TiB: more than any GPU holds, less than the size check
    to_host(to_device(np.ones(4, np.float32)))  # and the device still works
