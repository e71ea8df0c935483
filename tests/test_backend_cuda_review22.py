"""Review 22 of the CUDA backend (csrc/ndarray_backend_cuda.cu): regression tests for the defects
found by reading it. Each docstring says why the code before the fix fails the test.

Skips where the module is not built; the GPU tests skip where no GPU is present. The test that
needs ~16 GiB of GPU memory runs only with NEEDLE_CUDA_BIG_TESTS=1.
"""

import os
import pickle

import numpy as np
import pytest

cuda = pytest.importorskip("needle.backend_ndarray.ndarray_backend_cuda")

import needle.backend_ndarray as nd  # noqa: E402 (after the skip: only where the module exists)

has_gpu = cuda.device_count() > 0
gpu = pytest.mark.skipif(not has_gpu, reason="no CUDA GPU on this machine")
big = pytest.mark.skipif(
    os.environ.get("NEEDLE_CUDA_BIG_TESTS") != "1",
    reason="needs ~16 GiB of GPU memory: set NEEDLE_CUDA_BIG_TESTS=1",
)


@pytest.fixture
def rng():
    return np.random.default_rng(22)


def to_host(arr) -> np.ndarray:
    return cuda.to_numpy(arr, (arr.size,), (1,), 0)


@gpu
@pytest.mark.parametrize("size", [0, 7])
def test_from_numpy_accepts_any_float32_dtype_instance(size):
    """from_numpy checked the dtype with pybind11's `is` (object identity) against numpy's cached
    float32 descriptor. An unpickled float32 array (as multiprocessing and most data pipelines
    hand them over) or one whose dtype carries metadata has a float32 dtype that is equal but
    not the same object, so the old code raised "expected a float32 array, got dtype float32".
    (NDArray's constructor copies such arrays to the cached dtype first, so the primitive is
    called directly.)"""
    x = np.arange(size, dtype=np.float32) - 2.5
    for value in (
        pickle.loads(pickle.dumps(x)),
        x.astype(np.dtype("f4", metadata={"unit": "m"})),
    ):
        assert value.dtype == np.float32
        arr = cuda.Array(size)
        cuda.from_numpy(value, arr)
        np.testing.assert_array_equal(to_host(arr), x)
    with pytest.raises(ValueError, match="float32"):  # still refused: other dtypes
        cuda.from_numpy(x.astype(np.float64), cuda.Array(size))
    with pytest.raises(ValueError, match="float32"):
        cuda.from_numpy(x.astype(">f4"), cuda.Array(size))


# 65535 * 64 rows is the most one launch of the 64 x 64 sgemm tiles can cover (grid.y).
TALL = [
    (65535 * 64 + 1, 3, 5),  # one row past the limit; K, N not multiples of 4
    (64 * 256 * 256, 4, 8),  # a conv's im2col rows for 64 images of 256 x 256; 16-byte rows
]


@gpu
@pytest.mark.parametrize("tf32", [False, True], ids=["float32", "tf32"])
@pytest.mark.parametrize("m,n,p", TALL)
def test_matmul_with_more_rows_than_one_grid_covers(rng, m, n, p, tf32):
    """run_matmul refused any product with (m + 63) / 64 > 65535 ("dims too large for the CUDA
    kernels"), i.e. more than 4,194,240 rows, because the sgemm grid puts 64-row tiles on
    grid.y. Such products are small and common: conv's im2col matrix has N * H_out * W_out rows
    (64 images of 256 x 256 give 4,194,304), and batched x @ W flattens the batch into rows. The
    old code raised ValueError for both shapes here; the fix runs bands of 65535 * 64 rows."""
    a = rng.standard_normal((m, n)).astype(np.float32)
    b = rng.standard_normal((n, p)).astype(np.float32)
    device = nd.cuda()
    with nd.allow_tf32(tf32):
        got = (nd.NDArray(a, device=device) @ nd.NDArray(b, device=device)).numpy()
    assert got.shape == (m, p)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    rounding = 2.0**-10 if tf32 else 0.0
    bound = (2.2 * rounding + (n + 2) * 2.0**-24) * (np.abs(a64) @ np.abs(b64))
    err = np.abs(got - a64 @ b64)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert err[worst] <= bound[worst], f"C{worst}: {got[worst]} vs {(a64 @ b64)[worst]}"


@gpu
def test_tall_matmul_output_aliasing_an_input(rng):
    """The band loop also runs into the scratch buffer used when out aliases an input (same
    reason as above: the old code raised ValueError for more than 4,194,240 rows)."""
    m, n = 65535 * 64 + 3, 1
    x = rng.standard_normal(m).astype(np.float32)
    a = cuda.Array(m)
    cuda.from_numpy(x, a)
    b = cuda.Array(1)
    cuda.fill(b, 2.0)
    cuda.matmul(a, b, a, m, n, 1)
    np.testing.assert_array_equal(to_host(a), 2.0 * x)


@gpu
@big
@pytest.mark.parametrize("fn", [cuda.matmul, cuda.matmul_tf32], ids=["float32", "tf32"])
def test_matmul_refuses_dims_whose_tile_rounding_overflows_int(fn):
    """run_matmul accepted dims up to 2^31 - 1, but the kernels round them up to whole tiles in
    int arithmetic: sgemm's slice count (K + 7) / 8, the Hopper path's (K + 31) / 32 and
    transpose grid, grid.x = (N + 127) / 128, overflow for K or N within 255 of 2^31. With
    K = 2^31 - 2 the old sgemm got a negative slice count and silently wrote 0 (or some other
    wrong result); the TF32 path failed a launch with a RuntimeError. Now such dims raise
    ValueError up front. (Needs 2 x 8 GiB of operands; no kernel runs after the fix.)"""
    k = (1 << 31) - 2
    a, b, out = cuda.Array(k), cuda.Array(k), cuda.Array(1)
    cuda.fill(a, 1.0)
    cuda.fill(b, 1.0)
    with pytest.raises(ValueError, match="too large"):
        fn(a, b, out, 1, k, 1)
