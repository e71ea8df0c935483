"""The GPU path (CuPy arrays, float checks evaluated in float32 on the device like on the
host, exact limb products in float64) agrees with the host path."""
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
@pytest.mark.parametrize("accumulator", [np.float32, np.float64])
def test_fused_kernel_matches_float64_products(columns, accumulator):
    from verifier.gpu import signed_and_abs

    rng = np.random.default_rng(columns)
    M = rng.standard_normal((300, 1000), dtype=np.float32)
    W = rng.standard_normal((1000, columns)).astype(accumulator)
    v = rng.random(1000).astype(accumulator)
    S, a = signed_and_abs(cupy.asarray(M), cupy.asarray(W), cupy.asarray(v), accumulator)
    assert S.dtype == accumulator and a.dtype == accumulator
    M64, W64, v64 = M.astype(np.float64), W.astype(np.float64), v.astype(np.float64)
    # float64: rounding far below 1e-12; float32: within gamma_1000(2^-24) of |M| |W|
    scale = 1e-12 if accumulator == np.float64 else 1000 * 2.0**-24 * 1.01
    assert (np.abs(cupy.asnumpy(S) - M64 @ W64) <= scale * (np.abs(M64) @ np.abs(W64))).all()
    assert (np.abs(cupy.asnumpy(a) - np.abs(M64) @ v64) <= scale * (np.abs(M64) @ v64)).all()
    strided = cupy.asarray(M.T.copy()).T  # same values, column-major
    S_t, none = signed_and_abs(strided, cupy.asarray(W), None, accumulator)
    assert none is None
    np.testing.assert_array_equal(cupy.asnumpy(S_t), cupy.asnumpy(S))


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


def test_values_whose_float32_check_overflows_are_checked_in_float64_on_the_gpu():
    A = cupy.full((4, 2), 1e19, cupy.float32)
    B = cupy.full((2, 50), 1e19, cupy.float32)
    C = A @ B  # finite entries whose row sums of |C| overflow float32
    assert bool(cupy.isfinite(C).all())
    assert verify(A, B, C, seed=SEED).passed
    C[1, 7] *= 0.5
    assert not verify(A, B, C, seed=SEED).passed


def test_gpu_and_host_residuals_agree_within_rounding_noise():
    """Both evaluate in float32 against the same tau: the excesses differ by rounding only."""
    from verifier.floating import residual_and_bound
    from verifier.rng import sign_vectors

    rng = np.random.default_rng(5)
    A = rng.standard_normal((200, 300), dtype=np.float32)
    B = rng.standard_normal((300, 100), dtype=np.float32)
    C = A @ B
    C[7, 9] += 3.0
    R = sign_vectors(SEED, 100, 4)
    host_residual, host_tau = residual_and_bound(np, A, B, C, R, "fp32")
    device = residual_and_bound(cupy, *(cupy.asarray(M) for M in (A, B, C)), R, "fp32")
    device_residual, device_tau = (cupy.asnumpy(x) for x in device)
    np.testing.assert_allclose(device_tau, host_tau, rtol=1e-5)
    assert np.abs(device_residual - host_residual).max() < 1e-2 * host_tau.min()
