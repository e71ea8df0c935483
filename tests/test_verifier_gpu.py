"""The GPU path (CuPy arrays, checked in float64 on the device) agrees with the host path."""
import numpy as np
import pytest

from verifier import verify

cupy = pytest.importorskip("cupy")
try:
    cupy.cuda.runtime.getDeviceCount()
except Exception as err:  # CuPy without a usable GPU
    pytest.skip(f"no CUDA GPU: {err}", allow_module_level=True)

SEED = b"gpu" * 11


@pytest.mark.parametrize("columns", [1, 3, 16, 64])
def test_fused_kernel_matches_float64_products(columns):
    from verifier.gpu import signed_and_abs

    rng = np.random.default_rng(columns)
    M = rng.standard_normal((300, 1000), dtype=np.float32)
    W = rng.standard_normal((1000, columns))
    v = rng.random(1000)
    S, a = signed_and_abs(cupy.asarray(M), cupy.asarray(W), cupy.asarray(v))
    M64 = M.astype(np.float64)
    np.testing.assert_allclose(cupy.asnumpy(S), M64 @ W, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cupy.asnumpy(a), np.abs(M64) @ v, rtol=1e-12)
    strided = cupy.asarray(M.T.copy()).T  # same values, column-major
    S_t, _ = signed_and_abs(strided, cupy.asarray(W), cupy.asarray(v))
    np.testing.assert_allclose(cupy.asnumpy(S_t), M64 @ W, rtol=1e-12, atol=1e-12)


def test_float_verdicts_match_the_host_and_gpu_matmul_passes():
    rng = np.random.default_rng(0)
    for m, k, n in [(1, 1, 1), (65, 300, 33), (1024, 1024, 1024)]:
        A = rng.standard_normal((m, k), dtype=np.float32)
        B = rng.standard_normal((k, n), dtype=np.float32)
        dA, dB = cupy.asarray(A), cupy.asarray(B)
        dC = dA @ dB  # cuBLAS, its own summation order
        assert verify(dA, dB, dC, seed=SEED).passed
        wrong = dC.copy()
        wrong[m // 2, n // 2] += 1e4  # far above 2 tau at n = 1024 (docs: tightness)
        on_gpu = verify(dA, dB, wrong, seed=SEED)
        on_host = verify(A, B, cupy.asnumpy(wrong), seed=SEED)
        assert not on_gpu.passed and not on_host.passed
        wrong[0, 0] = cupy.nan
        assert "NaN or Inf in C" in verify(dA, dB, wrong, seed=SEED).reason


def test_tf32_tensor_core_results_pass_in_the_tf32_class():
    rng = np.random.default_rng(1)
    A = cupy.asarray(rng.random((512, 2048), dtype=np.float32))
    B = cupy.asarray(rng.random((2048, 256), dtype=np.float32))
    cublas = cupy.cuda.cublas
    handle = cupy.cuda.device.get_cublas_handle()
    previous = cublas.getMathMode(handle)
    cublas.setMathMode(handle, getattr(cublas, "CUBLAS_TF32_TENSOR_OP_MATH", 3))
    try:
        C = A @ B
    finally:
        cublas.setMathMode(handle, previous)
    exact = A.astype(cupy.float64) @ B.astype(cupy.float64)
    fp32_error = float(cupy.abs((A @ B) - exact).max())
    assert float(cupy.abs(C - exact).max()) > 10 * fp32_error  # tensor cores were used
    assert verify(A, B, C, precision="tf32", seed=SEED).passed


def test_exact_mode_and_batches_on_the_gpu():
    rng = np.random.default_rng(2)
    A = rng.integers(-128, 128, (3, 200, 300)).astype(np.int8)
    B = rng.integers(-128, 128, (300, 100)).astype(np.int8)
    C = A.astype(np.int64) @ B
    dA, dB, dC = cupy.asarray(A), cupy.asarray(B), cupy.asarray(C)
    assert verify(dA, dB, dC, precision="exact", seed=SEED).passed
    dC[1, 5, 7] += 1
    result = verify(dA, dB, dC, precision="exact", seed=SEED)
    assert not result.passed and result.worst_excess == 1


def test_exact_mode_with_large_int64_results_on_the_gpu():
    rng = np.random.default_rng(3)
    A = rng.integers(-(2**28), 2**28, (6, 3)).astype(np.int32)
    B = rng.integers(-(2**28), 2**28, (3, 5)).astype(np.int32)
    C = A.astype(np.int64) @ B  # entries near 2^57: split into 32-bit halves
    dA, dB, dC = cupy.asarray(A), cupy.asarray(B), cupy.asarray(C)
    assert verify(dA, dB, dC, precision="exact", seed=SEED).passed
    dC[2, 3] += 1
    assert not verify(dA, dB, dC, precision="exact", seed=SEED).passed


def test_batched_float_checks_on_the_gpu():
    rng = np.random.default_rng(4)
    A = cupy.asarray(rng.standard_normal((16, 4, 24, 32), dtype=np.float32))
    B = cupy.asarray(rng.standard_normal((4, 32, 8), dtype=np.float32))
    C = A @ B
    assert verify(A, B, C, seed=SEED).passed
    C[9, 2, 5, 5] += 100.0
    result = verify(A, B, C, seed=SEED)
    assert not result.passed and "row 5 of batch element (9, 2)" in result.reason


def test_mixing_host_and_device_arrays_is_an_error():
    A = np.ones((2, 2), np.float32)
    with pytest.raises(TypeError, match="must all be on the host or all on the GPU"):
        verify(A, cupy.asarray(A), A)
