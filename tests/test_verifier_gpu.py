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


def _mod_p_reference(M, V):
    """(M @ V) mod p with Python's unbounded integers."""
    from verifier import P

    return np.array((M.astype(object) @ V.astype(object)) % P, dtype=np.uint64)


@pytest.mark.parametrize("dtype, cols", [(np.int8, 4096), (np.int8, 1001), (np.uint8, 300),
                                          (np.int16, 777), (np.uint16, 64), (np.int32, 4096),
                                          (np.int32, 1000), (np.int32, 1002), (np.uint32, 513),
                                          (np.int64, 100)])
@pytest.mark.parametrize("rounds", [1, 3])
def test_fused_residues_match_python_integers(dtype, cols, rounds):
    """Both inner loops (dp4a on int8 words, int64 limb sums) at the dtype's extremes, with
    raw 64-bit vector words whose top 3 bits the kernel must drop."""
    from verifier import P, gpu_exact

    rng = np.random.default_rng(cols)
    info = np.iinfo(dtype)
    low, high = (-(2**20), 2**20) if dtype == np.int64 else (info.min, info.max)
    M = rng.integers(low, high, (37, cols), dtype=dtype, endpoint=True)
    M[0], M[1] = low, high  # every entry at an extreme
    words = rng.integers(0, 2**64, (rounds, cols), dtype=np.uint64, endpoint=False)
    words[0, :5] = np.uint64(P - 1) | np.uint64(7 << 61)
    bound = max(-int(low), int(high))
    out = cupy.empty((37, rounds), np.uint64)
    verdict = cupy.empty(3, np.int64)
    gpu_exact.residues(cupy.asarray(M), cupy.asarray(words), 1, cols, rounds, bound, None, out,
                       verdict)
    expected = _mod_p_reference(M, (words & np.uint64(P)).T)
    np.testing.assert_array_equal(cupy.asnumpy(out), expected)


def test_fused_residues_at_the_longest_dp4a_row():
    """int8 rows of 2^16 entries, all -128, against vectors of all ones: the int32 dp4a sums
    reach their largest magnitude."""
    from verifier import P, gpu_exact

    cols = gpu_exact.MAX_BYTES_COLS
    M = np.full((3, cols), -128, np.int8)
    words = np.full((1, cols), P - 1, np.uint64)
    out = cupy.empty((3, 1), np.uint64)
    dM = cupy.asarray(M)
    assert gpu_exact.bytes_path(dM)
    gpu_exact.residues(dM, cupy.asarray(words), 1, cols, 1, 128, None, out,
                       cupy.empty(3, np.int64))
    np.testing.assert_array_equal(cupy.asnumpy(out), _mod_p_reference(M, words.T))


def test_fused_residues_of_int32_rows_at_the_int64_limit():
    """int32 rows of 2^15 entries at their extremes against the largest limbs: the int64
    limb sums reach cols * 2^31 * (2^w - 1), just below 2^63, and stay exact."""
    from verifier import P, gpu_exact

    cols = 1 << 15
    assert cols * 2**31 * (2 ** gpu_exact.wide_limb_width(2**31, cols)) > 2**63 - 2**48
    M = np.empty((3, cols), np.int32)
    M[0], M[1] = -(2**31), 2**31 - 1
    M[2] = np.random.default_rng(3).integers(-(2**31), 2**31, cols, dtype=np.int32)
    words = np.full((1, cols), P - 1, np.uint64)
    out = cupy.empty((3, 1), np.uint64)
    gpu_exact.residues(cupy.asarray(M), cupy.asarray(words), 1, cols, 1, 2**31, None, out,
                       cupy.empty(3, np.int64))
    np.testing.assert_array_equal(cupy.asnumpy(out), _mod_p_reference(M, words.T))


def _int8_product(rng, m, k, n):
    A = rng.integers(-128, 128, (m, k), dtype=np.int8)
    B = rng.integers(-128, 128, (k, n), dtype=np.int8)
    return A, B, (A.astype(np.int64) @ B).astype(np.int32)


INT8_BOUNDS = (128, 2**31, 128)  # max|B|, max|C|, max|A| of int8 A, B and an int32 C


@pytest.mark.parametrize("n, rounds", [(1, 1), (20, 1), (21, 1), (4096, 1), (333, 4),
                                       (1000, 3), (8191, 2)])
def test_keccak_on_the_device_derives_the_field_vectors(n, rounds):
    """The words the check's first phase derives are SHAKE128's blocks bit for bit (hashlib,
    block by block), and their low 61 bits are field_vectors, for many seeds (some longer
    than a block) and n that are not multiples of a block's 21 words."""
    import hashlib

    from verifier import P, gpu_exact
    from verifier.rng import FIELD_BLOCK_DOMAIN, field_key, field_vectors

    A, B, C = _int8_product(np.random.default_rng(n), 3, 8, n)
    dA, dB, dC = cupy.asarray(A), cupy.asarray(B), cupy.asarray(C)
    plan = gpu_exact.plan_for(dA, dB, dC, rounds, INT8_BOUNDS, 8 * 2**14)
    for seed in (SEED, b"x", bytes(range(256)) * 2, n.to_bytes(32, "big")):
        key = field_key(seed, n, rounds)
        verdict = gpu_exact.launch(plan, dA, dB, dC, key)
        cupy.cuda.get_current_stream().synchronize()
        assert verdict.tolist() == [0, 2**63 - 1, 0]  # the true product passes
        got = cupy.asnumpy(plan.ws.words)
        raw = b"".join(hashlib.shake_128(FIELD_BLOCK_DOMAIN + key + b.to_bytes(8, "big"))
                       .digest(168) for b in range(-(-n * rounds // 21)))
        np.testing.assert_array_equal(got.ravel(), np.frombuffer(raw, "<u8")[: n * rounds])
        R = field_vectors(seed, n, rounds)
        np.testing.assert_array_equal((got & np.uint64(P)).T, R.astype(np.uint64))


def test_a_rejected_word_is_flagged_by_the_residue_kernels():
    """A word whose low 61 bits are p (stream v3 rejects it; probability 2^-61) sets the
    verdict's third entry in B's and C's passes, so the check can take the host's vectors."""
    from verifier import P, gpu_exact

    rng = np.random.default_rng(11)
    A, B, C = _int8_product(rng, 40, 64, 48)
    dA, dB, dC = cupy.asarray(A), cupy.asarray(B), cupy.asarray(C)
    plan = gpu_exact.plan_for(dA, dB, dC, 1, INT8_BOUNDS, 64 * 2**14)
    words = rng.integers(0, P, (1, 48), dtype=np.uint64)

    def verdict(words):
        found = gpu_exact.launch(plan, dA, dB, dC, words=cupy.asarray(words))
        cupy.cuda.get_current_stream().synchronize()
        return found.tolist()

    assert verdict(words) == [0, 2**63 - 1, 0]
    for value in (P, P | (7 << 61)):
        rejected = words.copy()
        rejected[0, 47] = value
        assert verdict(rejected)[2] == 1
        assert verdict(words) == [0, 2**63 - 1, 0]  # reset by the next launch
    flags = cupy.zeros(3, np.int64)  # C's pass alone (int32 rows) flags it too
    gpu_exact.residues(dC, cupy.asarray(rejected), 1, 48, 1, 2**31, None,
                       cupy.empty((40, 1), np.uint64), flags)
    assert int(flags[2]) == 1


def test_more_row_blocks_than_resident_blocks_and_back_to_back_checks():
    """Each resident block takes many blocks of rows in turn (C has 3125 blocks of 32 rows),
    the grid's barriers and counters are reused by launch after launch: wrong rows anywhere,
    including the last, are counted and the first is found, as on the host."""
    from verifier import gpu_exact

    rng = np.random.default_rng(12)
    A, B, C = _int8_product(rng, 100_000, 64, 64)
    dA, dB, dC = cupy.asarray(A), cupy.asarray(B), cupy.asarray(C)
    plan = gpu_exact.plan_for(dA, dB, dC, 1, INT8_BOUNDS, 64 * 2**14)
    assert plan.grid < 3125
    wrong = C.copy()
    wrong[[99_999, 31, 50_000], [63, 0, 17]] += [1, -5, 2**20]
    dW = cupy.asarray(wrong)
    for i in range(6):
        seed = i.to_bytes(4, "big")
        assert gpu_exact.check(plan, dA, dB, dC, seed) == (0, 0)
        assert gpu_exact.check(plan, dA, dB, dW, seed) == (3, 31)
    assert verify(A, B, wrong, precision="exact", seed=SEED) == verify(
        dA, dB, dW, precision="exact", seed=SEED)


def test_plans_sharing_a_workspace_never_read_each_others_verdicts():
    """Two plans of one shape (an int32 and an int16 C) share the workspace and its pinned
    verdict: checks alternating between them each get their own launch's verdict."""
    from verifier import gpu_exact
    from verifier.exact import dtype_magnitude

    rng = np.random.default_rng(15)
    A = rng.integers(-16, 16, (96, 64), dtype=np.int8)
    B = rng.integers(-16, 16, (64, 80), dtype=np.int8)
    C = (A.astype(np.int64) @ B).astype(np.int32)
    wrong = C.copy()
    wrong[40, 2] += 1
    dA, dB = cupy.asarray(A), cupy.asarray(B)
    product_bound = 64 * 128 * 128
    plans = {dtype: gpu_exact.plan_for(dA, dB, cupy.asarray(C.astype(dtype)), 1,
                                       (128, dtype_magnitude(dtype), 128), product_bound)
             for dtype in (np.int32, np.int16)}
    assert plans[np.int32].ws is plans[np.int16].ws and plans[np.int32] != plans[np.int16]
    for i in range(8):
        seed = i.to_bytes(4, "big")
        for dtype, plan in plans.items():
            honest, bad = (i + (dtype == np.int16)) % 2 == 0, cupy.asarray(wrong.astype(dtype))
            M = cupy.asarray(C.astype(dtype)) if honest else bad
            assert gpu_exact.check(plan, dA, dB, M, seed) == ((0, 0) if honest else (1, 40))


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.uint32, np.int64])
@pytest.mark.parametrize("offset", [0, 1])  # rows read 16 bytes at a time where aligned
def test_the_entry_bound_alone_fails_rows_whose_residues_agree(dtype, offset):
    """An honest C checked against a product bound below some of its entries: exactly the
    rows holding an entry of magnitude above the bound fail, though every residue agrees,
    and an entry at the bound passes (the bound check by itself, on every wide C type)."""
    from verifier import gpu_exact
    from verifier.exact import dtype_magnitude

    operand = np.uint8 if dtype == np.uint32 else np.int8
    rng = np.random.default_rng(21)
    A = rng.integers(0 if operand == np.uint8 else -8, 8, (200, 64), dtype=operand)
    B = rng.integers(0 if operand == np.uint8 else -8, 8, (64, 96), dtype=operand)
    C = A.astype(np.int64) @ B
    largest = np.abs(C).max(axis=1)
    bound = int(np.median(largest))
    failing = np.flatnonzero(largest > bound)
    assert 0 < len(failing) < len(C) and (largest == bound).any()
    flat = cupy.empty(C.size + offset, dtype)
    dC = flat[offset:].reshape(C.shape)
    dC[...] = cupy.asarray(C.astype(dtype))
    dA, dB = cupy.asarray(A), cupy.asarray(B)
    magnitude = dtype_magnitude(operand)
    plan = gpu_exact.plan_for(dA, dB, dC, 1, (magnitude, dtype_magnitude(dtype), magnitude),
                              bound)
    assert gpu_exact.check(plan, dA, dB, dC, SEED) == (len(failing), failing[0])
    honest = gpu_exact.plan_for(dA, dB, dC, 1, (magnitude, dtype_magnitude(dtype), magnitude),
                                int(largest.max()))
    assert gpu_exact.check(honest, dA, dB, dC, SEED) == (0, 0)


def test_every_wrong_row_is_counted_once_launch_after_launch():
    """With every row wrong each is counted exactly once (neither twice nor missed; A's
    tensor-core pass sums a block's rows in shared memory it then reuses), launch after
    launch; a row holding an entry above the product's bound counts as wrong."""
    from verifier import gpu_exact

    rng = np.random.default_rng(14)
    m, k, n = 1000, 256, 96
    A, B, C = _int8_product(rng, m, k, n)
    product_bound = k * 128 * 128
    dA, dB, dC = cupy.asarray(A), cupy.asarray(B), cupy.asarray(C)
    plan = gpu_exact.plan_for(dA, dB, dC, 1, INT8_BOUNDS, product_bound)
    all_wrong = cupy.asarray(C + np.int32(1))
    above = C.copy()
    above[[998, 3], [95, 0]] = [product_bound + 1, -product_bound - 1]
    d_above = cupy.asarray(above)
    for i in range(4):
        seed = i.to_bytes(4, "big")
        assert gpu_exact.check(plan, dA, dB, all_wrong, seed) == (m, 0)
        assert gpu_exact.check(plan, dA, dB, dC, seed) == (0, 0)
        assert gpu_exact.check(plan, dA, dB, d_above, seed) == (2, 3)
    on_host = verify(A, B, above, precision="exact", seed=SEED)
    assert not on_host.passed and verify(dA, dB, d_above, precision="exact", seed=SEED) == on_host


def test_repeated_device_checks_take_the_remembered_plan_with_the_same_verdicts():
    """A second verify() of the same kind of device inputs skips the input checks it did the
    first time: verdicts stay the host's, other kinds (strides, alignment, dtype, rounds)
    are not mistaken for it, and bad arguments still get their errors."""
    from verifier import batch

    rng = np.random.default_rng(13)
    A, B, C = _int8_product(rng, 96, 128, 64)
    dA, dB, dC = cupy.asarray(A), cupy.asarray(B), cupy.asarray(C)
    first = verify(dA, dB, dC, precision="exact", seed=SEED)
    assert first.passed and batch._device_key(dA, dB, dC, None) in batch._DEVICE_EXACT
    wrong = C.copy()
    wrong[77, 5] += 1
    for seed in (SEED, b"again", None):
        assert verify(dA, dB, dC, precision="exact", seed=seed) == first
        on_gpu = verify(dA, dB, cupy.asarray(wrong), precision="exact", seed=seed)
        assert not on_gpu.passed and on_gpu.reason == "1 rows differ mod p, first row 77"
    assert verify(dA, dB, cupy.asarray(wrong), precision="exact", seed=SEED) == verify(
        A, B, wrong, precision="exact", seed=SEED)
    flat = cupy.zeros(C.size + 1, np.int32)  # same shape and dtype, 4 bytes off
    shifted = flat[1:].reshape(C.shape)
    shifted[...] = cupy.asarray(wrong)
    transposed = cupy.asarray(wrong.T.copy()).T  # same shape, column-major
    for other in (shifted, transposed, cupy.asarray(wrong.astype(np.int64))):
        assert verify(dA, dB, other, precision="exact", seed=SEED).reason.endswith("row 77")
    assert not verify(dA, dB, cupy.asarray(wrong), precision="exact", rounds=2).passed
    with pytest.raises(TypeError, match="rounds must be an int"):
        verify(dA, dB, dC, precision="exact", rounds=True)
    with pytest.raises(TypeError, match="seed must be bytes"):
        verify(dA, dB, dC, precision="exact", seed="text")
    with pytest.raises(ValueError, match="seed must not be empty"):
        verify(dA, dB, dC, precision="exact", seed=b"")
    with pytest.raises(TypeError, match="exact mode takes integer"):
        verify(dA, dB, dC.astype(np.float32), precision="exact")
    with pytest.raises(ValueError, match="C has shape"):
        verify(dA, dB, dC[:, :63], precision="exact")
    assert dC.dtype == np.int32 and (cupy.asnumpy(dC) == C).all()  # inputs untouched


@pytest.mark.parametrize("rounds", [1, 2, 4, 5])
def test_exact_gpu_verdicts_equal_the_host_verdicts(rounds):
    """int8 operands and an int32 C (the fused kernels; 5 rounds the generic path): honest
    passes, and wrong rows are counted and located as on the host."""
    from verifier import gpu_exact

    rng = np.random.default_rng(rounds)
    A = rng.integers(-128, 128, (300, 512), dtype=np.int8)
    B = rng.integers(-128, 128, (512, 260), dtype=np.int8)
    C = (A.astype(np.int64) @ B).astype(np.int32)
    dA, dB, dC = cupy.asarray(A), cupy.asarray(B), cupy.asarray(C)
    bounds = (128, 2**31, 128)
    assert gpu_exact.supported(dA, dB, dC, rounds, bounds) == (rounds <= gpu_exact.MAX_ROUNDS)
    assert verify(dA, dB, dC, precision="exact", rounds=rounds, seed=SEED).passed
    for row, col, delta in [(299, 259, 1), (17, 0, -1), (150, 3, 2**30)]:
        C[row, col] += delta
    dC = cupy.asarray(C)
    on_gpu = verify(dA, dB, dC, precision="exact", rounds=rounds, seed=SEED)
    on_host = verify(A, B, C, precision="exact", rounds=rounds, seed=SEED)
    assert not on_gpu.passed and on_gpu == on_host
    assert on_gpu.worst_excess == 3 and "first row 17" in on_gpu.reason


@pytest.mark.parametrize("types, offset", [(("int8", "int8", "int32"), 1),
                                           (("int16", "uint8", "int64"), 0),
                                           (("uint16", "int16", "int32"), 2)])
def test_exact_gpu_verdicts_of_other_types_and_alignments(types, offset):
    """B's and C's passes share one launch whatever their inner loops (dp4a or wide limbs,
    16-byte, 4-byte or single loads): verdicts equal the host's."""
    from verifier import P, exact, gpu_exact

    rng = np.random.default_rng(offset)
    m, k, n = 70, 96, 52
    a_type, b_type, c_type = (np.dtype(t) for t in types)
    A = rng.integers(0, 100, (m, k)).astype(a_type)
    B = rng.integers(-100 if b_type.kind == "i" else 0, 100, (k, n)).astype(b_type)
    C = (A.astype(np.int64) @ B.astype(np.int64)).astype(c_type)

    def device(M):  # M's rows starting offset entries past an allocation's start
        flat = cupy.zeros(M.size + offset, M.dtype)
        dM = flat[offset:].reshape(M.shape)
        dM[...] = cupy.asarray(M)
        return dM

    dA, dB = device(A), device(B)
    assert verify(dA, dB, device(C), precision="exact", seed=SEED).passed
    C[m - 1, 0] += 1
    C[3, n - 1] -= 2
    dC = device(C)
    bound_a, bound_b = exact.dtype_magnitude(a_type), exact.dtype_magnitude(b_type)
    bound_c = exact.magnitude(C, P - k * bound_a * bound_b - 1)
    assert gpu_exact.supported(dA, dB, dC, 1, (bound_b, bound_c, bound_a))  # the fused path
    on_gpu = verify(dA, dB, dC, precision="exact", seed=SEED)
    assert on_gpu == verify(A, B, C, precision="exact", seed=SEED)
    assert not on_gpu.passed and on_gpu.worst_excess == 2 and "first row 3" in on_gpu.reason


def test_exact_gpu_rejects_entries_above_the_product_bound():
    """An int32 C with an entry above k max|A| max|B| (equal to the product mod p) fails: the
    kernel marks its row, whatever r is."""
    rng = np.random.default_rng(7)
    A = rng.integers(-128, 128, (64, 128), dtype=np.int8)
    B = rng.integers(-128, 128, (128, 64), dtype=np.int8)
    C = (A.astype(np.int64) @ B).astype(np.int32)
    C[5, 6] = 128 * 128 * 128 + 1  # one past the bound
    C[9, 1] = -(2**31)
    for seed in (SEED, b"other"):
        result = verify(cupy.asarray(A), cupy.asarray(B), cupy.asarray(C), precision="exact",
                        seed=seed)
        assert not result.passed and result.worst_excess == 2 and "first row 5" in result.reason
        assert result == verify(A, B, C, precision="exact", seed=seed)  # host: differ mod p


def _host_worst(A, B, C, rounds, precision="fp32"):
    """The host's float32 evaluation: (worst excess, its row)."""
    from verifier.floating import worst_per_row
    from verifier.rng import sign_vectors

    row_excess = worst_per_row(np, A, B, C, sign_vectors(SEED, B.shape[1], rounds), precision,
                               np.float32)
    return float(row_excess.max()), int(row_excess.argmax())


@pytest.mark.parametrize("rounds", [1, 3, 16, 64])
@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (130, 300, 64), (77, 129, 33), (257, 512, 1000)])
def test_fused_float_kernels_find_the_host_worst_row(rounds, m, k, n):
    """The three fused kernels (16-byte loads where rows allow, scalar loads otherwise)
    against the host's evaluation: same worst row when one stands out, same excess up to
    float32 summation order."""
    from verifier import gpu_float
    from verifier.floating import bound_terms
    from verifier.rng import Signs

    rng = np.random.default_rng(m * rounds)
    A = rng.standard_normal((m, k), dtype=np.float32)
    B = rng.standard_normal((k, n), dtype=np.float32)
    C = (A.astype(np.float64) @ B).astype(np.float32)
    signs = Signs(SEED, n, rounds)
    terms = bound_terms(n, k, "fp32", np.float32)
    _, tau = residual_and_bound_host(A, B, C, signs.matrix)
    for wrong_row, size in ((None, 0), (m - 1, 50), (m // 3, 100)):  # the last one stands out
        if wrong_row is not None:
            C = C.copy()
            C[wrong_row, n // 2] += np.float32(size * tau.max())
        host_worst, host_row = _host_worst(A, B, C, rounds)
        found = gpu_float.worst_row(*(cupy.asarray(M) for M in (A, B, C)), signs.bits, rounds,
                                    terms)
        assert found is not None
        assert abs(found[0] - host_worst) <= 1e-2 * tau.min()
        if wrong_row is not None:
            assert found[1] == (host_row,) == (wrong_row,)


def residual_and_bound_host(A, B, C, R):
    from verifier.floating import residual_and_bound

    return residual_and_bound(np, A, B, C, R, "fp32")


@pytest.mark.parametrize("n", [40, 37])
def test_float_verdicts_at_the_bound_equal_the_host_verdicts(n):
    """Integer-valued bf16-class data, every sum exact in float32 on both sides: a wrong
    entry of size round(tau) -+ 1 (about 0.1% inside or outside the bound) passes or fails
    on the GPU exactly as on the host, with the same excess and row."""
    from verifier.floating import residual_and_bound
    from verifier.rng import sign_vectors

    rng = np.random.default_rng(n)
    m, k = 48, 64
    A = rng.integers(-8, 9, (m, k)).astype(np.float32)
    B = rng.integers(-8, 9, (k, n)).astype(np.float32)
    C = (A.astype(np.int64) @ B.astype(np.int64)).astype(np.float32)  # exact
    _, tau = residual_and_bound(np, A, B, C, sign_vectors(SEED, n, 2), "bf16")
    assert 100 < tau.min()  # wrong entries stay far below 2^24 / n: exact sums
    outcomes = set()
    for row, col in [(5, 3), (20, n - 1), (47, 0)]:
        for step in (-1, 1):
            wrong = C.copy()
            wrong[row, col] += np.float32(np.round(tau[row]) + step)
            host = verify(A, B, wrong, precision="bf16", rounds=2, seed=SEED)
            gpu = verify(*(cupy.asarray(M) for M in (A, B, wrong)), precision="bf16", rounds=2,
                         seed=SEED)
            assert 0.4 < abs(host.worst_excess) < 1.6  # borderline: within 2 of ~1000
            assert gpu.passed == host.passed and abs(gpu.worst_excess - host.worst_excess) < 1e-2
            if not host.passed:
                assert gpu.reason.split(" exceeds")[0] == host.reason.split(" exceeds")[0]
            outcomes.add(host.passed)
    assert outcomes == {True, False}


def test_misaligned_and_strided_device_matrices_get_the_host_verdicts():
    """Rows that do not start 16-byte aligned take scalar loads; strided ones a copy."""
    rng = np.random.default_rng(9)
    A = rng.standard_normal((96, 128), dtype=np.float32)
    B = rng.standard_normal((128, 64), dtype=np.float32)
    C = A @ B
    flat = cupy.zeros(C.size + 1, np.float32)
    dC = flat[1:].reshape(C.shape)  # contiguous, 4 bytes past a 16-byte boundary
    dC[...] = cupy.asarray(C)
    dA = cupy.asarray(A.T.copy()).T  # column-major
    assert verify(dA, cupy.asarray(B), dC, seed=SEED).passed
    dC[40, 2] += 1.0
    C[40, 2] += 1.0
    gpu, host = verify(dA, cupy.asarray(B), dC, seed=SEED), verify(A, B, C, seed=SEED)
    assert not gpu.passed and not host.passed
    assert "row 40 " in gpu.reason and "row 40 " in host.reason


@pytest.mark.parametrize("name", ["A", "B", "C"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_on_the_gpu_name_the_matrix_as_on_the_host(name, value):
    rng = np.random.default_rng(10)
    mats = {"A": rng.standard_normal((64, 80), dtype=np.float32),
            "B": rng.standard_normal((80, 48), dtype=np.float32)}
    mats["C"] = mats["A"] @ mats["B"]
    mats[name][7, 5] = value
    host = verify(mats["A"], mats["B"], mats["C"], seed=SEED)
    gpu = verify(*(cupy.asarray(mats[x]) for x in "ABC"), seed=SEED)
    assert gpu == host and not gpu.passed and gpu.reason == f"NaN or Inf in {name}"


@pytest.mark.parametrize("dtype, offset", [(np.int8, 4), (np.int8, 1), (np.int32, 1),
                                           (np.int8, 16)])
def test_fused_residues_of_rows_at_any_alignment(dtype, offset):
    """Rows starting 16-byte aligned take 16-byte loads, others 4-byte words (int8 rows at a
    4-byte boundary) or single entries: the same residues either way."""
    from verifier import gpu_exact

    rng = np.random.default_rng(offset)
    rows, cols = 33, 2048
    info = np.iinfo(dtype)
    M = rng.integers(info.min, info.max, (rows, cols), dtype=dtype, endpoint=True)
    flat = cupy.zeros(rows * cols + offset, dtype)
    dM = flat[offset:].reshape(rows, cols)
    dM[...] = cupy.asarray(M)
    words = rng.integers(0, 2**64, (2, cols), dtype=np.uint64, endpoint=False)
    out = cupy.empty((rows, 2), np.uint64)
    gpu_exact.residues(dM, cupy.asarray(words), 1, cols, 2, max(-int(info.min), int(info.max)),
                       None, out, cupy.empty(3, np.int64))
    expected = _mod_p_reference(M, (words & np.uint64(gpu_exact.P)).T)
    np.testing.assert_array_equal(cupy.asnumpy(out), expected)


def _small_integers(rng, shape):
    """Integer-valued float32 entries in [-8, 8]: every product and partial sum of R, B R,
    A (B R) and C stays an integer below 2^24, exact in float32 in any order."""
    return rng.integers(-8, 9, shape).astype(np.float32)


def _same_outcome(gpu, host, tau_max):
    """The one-launch check's result against the host's: same verdict, same row, and the
    same excess up to the float32 rounding of |A| weights (order-dependent in tau only)."""
    assert gpu.passed == host.passed and gpu.rounds == host.rounds
    assert gpu.false_accept_bound == host.false_accept_bound
    assert abs(gpu.worst_excess - host.worst_excess) <= 1e-5 * tau_max
    assert gpu.reason.split(" exceeds")[0] == host.reason.split(" exceeds")[0]


@pytest.mark.parametrize("rounds", [1, 16])
@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (37, 29, 33), (130, 300, 64), (64, 2048, 20),
                                     (300, 70, 1000)])
def test_one_launch_float_checks_equal_the_host_checks(rounds, m, k, n):
    """Honest, above-bound and NaN/Inf results: verify() on the device (its first call makes
    the plan, the second takes the remembered one) gives the host's verdict, row and excess,
    for shapes that are not square, 1 x 1 and not multiples of 16 (16-byte and scalar
    loads)."""
    from verifier.floating import residual_and_bound
    from verifier.rng import sign_vectors

    rng = np.random.default_rng(m + k + n + rounds)
    A, B = _small_integers(rng, (m, k)), _small_integers(rng, (k, n))
    C = (A.astype(np.int64) @ B.astype(np.int64)).astype(np.float32)  # exact
    _, tau = residual_and_bound(np, A, B, C, sign_vectors(SEED, n, rounds), "fp32")
    above = C.copy()
    above[m // 2, n - 1] += np.float32(4 * tau.max())  # 4 tau: fails for any signs
    not_finite = [("NaN or Inf in A", 0, np.nan), ("NaN or Inf in B", 1, np.inf),
                  ("NaN or Inf in C", 2, -np.inf)]
    cases = [((A, B, C), True), ((A, B, above), False)]
    for _, which, value in not_finite:
        mats = [A.copy(), B.copy(), C.copy()]
        mats[which][-1, 0] = value
        cases.append((tuple(mats), False))
    for mats, passes in cases:
        host = verify(*mats, rounds=rounds, seed=SEED)
        device = [cupy.asarray(M) for M in mats]
        for _ in range(2):
            gpu = verify(*device, rounds=rounds, seed=SEED)
            assert gpu.passed == host.passed == passes
            if np.isfinite(host.worst_excess):
                _same_outcome(gpu, host, tau.max())
            else:
                assert gpu == host and host.reason.startswith("NaN or Inf in")
    for name, which, _ in not_finite:
        assert verify(*(cases[2 + which][0]), rounds=rounds, seed=SEED).reason == name


def test_one_launch_float_checks_of_random_data_and_precision_classes():
    """cuBLAS's own summation order: honest results pass in every class, a wrong entry of
    twice the bound fails in every class on the device as on the host, at the same row."""
    from verifier.floating import residual_and_bound
    from verifier.rng import sign_vectors

    rng = np.random.default_rng(21)
    m, k, n = 200, 513, 260
    A = rng.standard_normal((m, k), dtype=np.float32)
    B = rng.standard_normal((k, n), dtype=np.float32)
    dA, dB = cupy.asarray(A), cupy.asarray(B)
    dC = dA @ dB
    for precision in ("fp32", "tf32", "bf16"):
        assert verify(dA, dB, dC, precision=precision, rounds=4, seed=SEED).passed
        _, tau = residual_and_bound(np, A, B, cupy.asnumpy(dC), sign_vectors(SEED, n, 4),
                                    precision)
        wrong = cupy.asnumpy(dC)
        wrong[123, 7] += np.float32(4 * tau.max())
        host = verify(A, B, wrong, precision=precision, rounds=4, seed=SEED)
        gpu = verify(dA, dB, cupy.asarray(wrong), precision=precision, rounds=4, seed=SEED)
        assert not host.passed and "row 123 " in host.reason
        assert gpu.reason.split(" exceeds")[0] == host.reason.split(" exceeds")[0]
        assert abs(gpu.worst_excess - host.worst_excess) <= 1e-2 * tau.min()


def test_one_launch_float_check_of_a_stack_takes_each_element():
    """Leading batch dimensions (elements too large for one stacked check): each element is
    one launch; the verdict names the host's element and row."""
    rng = np.random.default_rng(22)
    A = _small_integers(rng, (2, 2, 150, 200))
    B = _small_integers(rng, (2, 200, 180))
    C = (A.astype(np.int64) @ B.astype(np.int64)).astype(np.float32)
    assert verify(*(cupy.asarray(M) for M in (A, B, C)), seed=SEED).passed
    C[1, 0, 77, 5] += 1e4
    host = verify(A, B, C, seed=SEED)
    gpu = verify(*(cupy.asarray(M) for M in (A, B, C)), seed=SEED)
    assert not gpu.passed and "row 77 of batch element (1, 0)" in host.reason
    assert gpu.reason.split(" exceeds")[0] == host.reason.split(" exceeds")[0]


def test_one_launch_float_check_over_many_row_blocks_reports_the_first_worst_row():
    """More rows than one wave of resident warps takes: two identical wrong rows far apart
    (the same excess, found by different blocks) give the first, as numpy's argmax does;
    checks after a failing one pass again (the counters reset)."""
    from verifier import gpu_float
    from verifier.floating import bound_terms
    from verifier.rng import Signs

    rng = np.random.default_rng(23)
    m, k, n = 100_000, 8, 12
    A, B = _small_integers(rng, (m, k)), _small_integers(rng, (k, n))
    C = (A.astype(np.int64) @ B.astype(np.int64)).astype(np.float32)
    A[99_990], C[99_990] = A[12_345], C[12_345]
    wrong = C.copy()
    wrong[[12_345, 99_990], 3] += 1e3
    dA, dB, dC, dwrong = (cupy.asarray(M) for M in (A, B, C, wrong))
    terms = bound_terms(n, k, "fp32", np.float32)
    plan = gpu_float.plan_for(dA, dB, dC, 2, terms)
    assert plan.row_blocks[2] > plan.grid  # A's row blocks: blocks take several in turn
    for seed in (SEED, b"other", b"third"):
        bits = Signs(seed, n, 2).bits
        assert gpu_float.check(plan, dA, dB, dC, bits)[0] <= 0
        worst, row = gpu_float.check(plan, dA, dB, dwrong, bits)
        host = verify(A, B, wrong, rounds=2, seed=seed)
        assert row == 12_345 and "row 12345 " in host.reason
        assert abs(worst - host.worst_excess) <= 1e-5 * abs(host.worst_excess)
