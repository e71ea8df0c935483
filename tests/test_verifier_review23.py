"""Session 23's review of the host verifier's batched and float paths: which element of a
batch failed, the tf32 / bf16 bound against an independent evaluation of the documented
formula, extreme data and shapes, layouts the compiled exact loop cannot read (converted a
row block at a time, never copied whole), seeds and the result's fields.

References are independent of the verifier: Python integers, float64 products, float32
accumulations written out step by step, and tau evaluated from docs/verifier.md's formula."""
import tracemalloc

import numpy as np
import pytest
from helpers import reference_mod_p

from verifier import P, exact, verify, verify_many
from verifier.rng import derive_seed, field_vectors, sign_vectors

F32 = np.float32
SEED = b"review-23".ljust(32, b"-")
TINY = 2.0**-126
UNIT_IN = {"fp32": 0.0, "tf32": 2.0**-10, "bf16": 2.0**-7}
MANTISSA = {"tf32": 10, "bf16": 7}


# ---- independent references -------------------------------------------------------------

def gamma(length, unit):
    return length * unit / (1 - length * unit)


def documented_tau(A, B, C, precision):
    """tau_i = SAFETY (H_i + delta_i) of docs/verifier.md ("Float modes"), in float64 from
    the exact absolute values (the verifier's own tau is this up to its rounding upwards)."""
    A, B, C = (np.abs(x.astype(np.float64)) for x in (A, B, C))
    k, n = A.shape[-1], B.shape[-1]
    s = B.sum(axis=-1)
    t = (A * s[..., None, :]).sum(axis=-1)
    rho, c, total = A.sum(axis=-1), C.sum(axis=-1), s.sum(axis=-1)[..., None]
    f = (1 + 2.0**-23) * (1 + gamma(k, 2.0**-23))
    u = UNIT_IN[precision]
    H = (f * (1 + u) ** 2 - 1) * t + f * (1 + u) * TINY * (n * rho + total) \
        + n * (10 * k + 2) * TINY
    g_n, g_k, eta_n, eta_k = gamma(n, 2.0**-24), gamma(k, 2.0**-24), 4 * n * TINY, 4 * k * TINY
    delta = g_n * c + (g_n + g_k * (1 + g_n)) * t + (1 + g_k) * eta_n * rho + eta_n + eta_k
    return (1 + 2.0**-20) * (H + delta)


def truncated(x, bits):
    """x with its mantissa truncated to `bits` explicit bits (tf32 10, bf16 7): the largest
    input error the classes allow."""
    drop = 23 - bits
    return ((x.view(np.uint32) >> drop) << drop).view(F32)


def toward_zero(A, B):
    """float32 accumulation (products exact, as a tensor core's), each step truncated toward
    zero, over any leading batch dimensions."""
    C = np.zeros((*np.broadcast_shapes(A.shape[:-2], B.shape[:-2]), A.shape[-2], B.shape[-1]),
                 F32)
    for l in range(A.shape[-1]):
        products = A[..., :, l, None].astype(np.float64) * B[..., None, l, :]
        exact_sum = C.astype(np.float64) + products
        rounded = exact_sum.astype(F32)
        too_far = np.abs(rounded.astype(np.float64)) > np.abs(exact_sum)
        C = np.where(too_far, np.nextafter(rounded, F32(0)), rounded)
    return C


def worst_truncation(rng, shape, bits):
    """Entries whose dropped mantissa bits are all ones (truncation loses almost 2^-bits of
    each), with exponents over 2^-7 .. 2^6 and random signs."""
    kept = rng.integers(0, 2**bits, shape).astype(np.uint32) << (23 - bits)
    exponent = rng.integers(120, 134, shape).astype(np.uint32) << 23
    sign = rng.integers(0, 2, shape).astype(np.uint32) << 31
    return (sign | exponent | kept | np.uint32((1 << (23 - bits)) - 1)).view(F32)


def snapshot(*arrays):
    return [(x.dtype.str, x.shape, x.strides, x.flags.writeable, x.tobytes()) for x in arrays]


# ---- a batch with one bad element -------------------------------------------------------

def test_exact_batch_with_an_oversized_entry_names_its_element_and_row():
    """An entry of C at or above p - k max|A| max|B| stops the check before the residues; the
    reason named neither the batch element nor the row holding it (every other failure
    names both)."""
    rng = np.random.default_rng(1)
    A = rng.integers(-100, 100, (1, 5, 6)).astype(np.int8)  # broadcast over B's batch
    B = rng.integers(-100, 100, (4, 6, 3)).astype(np.int8)
    honest = np.array(np.matmul(A.astype(object), B.astype(object)).tolist(), np.int64)
    assert verify(A, B, honest, precision="exact", seed=SEED).passed
    C = honest.copy()
    C[2, 3, 1] = P  # equal mod p to P + 0, far above any product of these operands
    C[3, 0, 2] = -(2**62)
    result = verify(A, B, C, precision="exact", seed=SEED)
    assert not result.passed and result.worst_excess == 2  # the two rows holding them
    assert f"k * |A| * |B| <= 6 * 128 * 128 = {6 * 128 * 128}:" in result.reason  # int8 dtypes
    assert result.reason.endswith("(first row 3 of batch element (2,))")
    single = verify(A[0], B[2], C[2], precision="exact", seed=SEED)
    assert not single.passed and single.reason.endswith("(first row 3)")


@pytest.mark.parametrize("element_rows", [(5, 6, 4), (150, 160, 170)])  # stacked, one by one
def test_float_batch_names_the_wrong_element_and_the_others_pass_alone(element_rows):
    m, k, n = element_rows
    rng = np.random.default_rng(2)
    A = rng.standard_normal((3, 1, m, k), dtype=F32)
    B = rng.standard_normal((4, k, n), dtype=F32)  # batch (3, 4)
    C = (A.astype(np.float64) @ B).astype(F32)
    C[2, 1, m - 1, 0] += 1e3
    result = verify(A, B, C, seed=SEED, rounds=2)
    assert not result.passed and f"row {m - 1} of batch element (2, 1)" in result.reason
    triples = [(A[i, 0], B[j], C[i, j]) for i in range(3) for j in range(4)]
    alone = verify_many(triples, seed=SEED, rounds=2)
    assert [r.passed for r in alone] == [(i, j) != (2, 1) for i in range(3) for j in range(4)]
    # the same vectors for every element: the batch's excess is the wrong element's own
    assert verify(*triples[9], seed=SEED, rounds=2).worst_excess == pytest.approx(
        result.worst_excess, rel=1e-6)


# ---- the float bound of the tf32 and bf16 classes ---------------------------------------

@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_worst_case_truncated_inputs_pass_and_twice_the_bound_fails(precision):
    """Inputs losing almost 2^-bits each to truncation, accumulated toward zero in float32:
    within the class's bound (these reach above 90% of tau). One entry moved by a little
    more than 2 tau (documented tau, from the exact data) fails every round."""
    rng = np.random.default_rng(3)
    bits = MANTISSA[precision]
    for m, k, n in [(1, 1, 1), (2, 3, 1), (3, 2, 4), (2, 40, 3), (1, 700, 2)]:
        A, B = worst_truncation(rng, (2, m, k), bits), worst_truncation(rng, (k, n), bits)
        C = toward_zero(truncated(A, bits), truncated(B, bits))
        result = verify(A, B, C, precision=precision, seed=SEED, rounds=8)
        assert result.passed, (m, k, n, result)
        tau = documented_tau(A, B, C, precision)
        wrong = C.copy()
        wrong[1, m - 1, n - 1] += F32(2.01 * tau[1, m - 1] * np.sign(rng.standard_normal()))
        moved = abs(float(wrong[1, m - 1, n - 1]) - float(C[1, m - 1, n - 1]))
        assert moved > 2.005 * tau[1, m - 1]
        assert not verify(A, B, wrong, precision=precision, seed=SEED, rounds=1).passed


def test_long_inner_dimension_with_tiny_outer_dimensions():
    """K = 100000, M = N = 1 and 2 (row blocks of 2 rows): honest in every class, accumulated
    in float32 forward; one entry off by 2.01 tau fails."""
    rng = np.random.default_rng(4)
    k = 100_000
    A = rng.uniform(0, 1, (1, k)).astype(F32)
    B = rng.uniform(0, 1, (k, 2)).astype(F32)
    C = np.cumsum((A[0, :, None] * B).astype(F32), axis=0, dtype=F32)[-1:]  # sequential
    for precision in ("fp32", "tf32", "bf16"):
        assert verify(A, B, C, precision=precision, seed=SEED, rounds=4).passed
    tau = documented_tau(A, B, C, "fp32")
    wrong = C.copy()
    wrong[0, 1] -= F32(2.01 * tau[0])
    assert not verify(A, B, wrong, seed=SEED, rounds=1).passed
    Ai, Bi = np.full((1, k), -128, np.int8), np.full((k, 2), -128, np.int8)
    Ci = np.full((1, 2), k * 2**14, np.int32)
    assert verify(Ai, Bi, Ci, precision="exact", seed=SEED).passed
    Ci[0, 0] -= 1
    assert verify(Ai, Bi, Ci, precision="exact", seed=SEED).worst_excess == 1


def test_signed_zeros_subnormals_and_values_near_float32_max():
    """-0.0 everywhere, subnormal products and a float32 evaluation that overflows (the bound's
    float32 sums reach inf; the float64 re-evaluation decides) all pass honest and fail
    wrong."""
    zeros = -np.zeros((3, 4), F32)
    assert verify(zeros, zeros.T.copy(), -np.zeros((3, 3), F32), seed=SEED).passed
    rng = np.random.default_rng(5)
    small = (rng.standard_normal((4, 6)) * 1e-40).astype(F32)  # subnormal inputs
    other = rng.standard_normal((6, 5)).astype(F32)
    C = (small.astype(np.float64) @ other).astype(F32)
    assert verify(small, other, C, seed=SEED).passed
    A = np.array([[3e38, -3e38, 3e38]], F32)
    B = np.array([[1.0, 1.0], [1.0, 0.5], [0.5, 0.25]], F32)
    C = (A.astype(np.float64) @ B).astype(F32)  # finite, though |A| |B| is not in float32
    assert np.isfinite(C).all()
    honest = verify(A, B, C, seed=SEED)
    assert honest.passed and np.isfinite(honest.worst_excess)
    tau = documented_tau(A, B, C, "fp32")
    wrong = C.copy()
    wrong[0, 0] = F32(float(C[0, 0]) - 2.01 * tau[0])
    result = verify(A, B, wrong, seed=SEED, rounds=1)
    assert not result.passed and np.isfinite(result.worst_excess)


# ---- dtypes at their extremes ------------------------------------------------------------

def test_integer_extremes_against_python_integers():
    rng = np.random.default_rng(6)
    A = rng.choice([-(2**31), 2**31 - 1, 0, -1], (3, 2)).astype(np.int32)
    B = rng.choice([0, 1, 2**17, 2**18 - 1], (2, 4)).astype(np.uint32)
    product = np.matmul(A.astype(object), B.astype(object))
    C = np.array(product.tolist(), np.int64)
    assert verify(A, B, C, precision="exact", seed=SEED).passed
    wrapped = C.astype(np.int32)  # an int32 C that wrapped around is not the product
    rows_that_wrapped = int((C != wrapped).any(axis=1).sum())
    assert rows_that_wrapped > 0
    result = verify(A, B, wrapped, precision="exact", seed=SEED)
    assert not result.passed and result.worst_excess == rows_that_wrapped
    with pytest.raises(TypeError, match="A is bool"):
        verify(A > 0, B > 0, C, precision="exact")
    with pytest.raises(TypeError, match="A is float16"):
        verify(np.ones((3, 2), np.float16), B.astype(F32), C.astype(F32))
    with pytest.raises(TypeError, match="C is uint64"):
        verify(A, B, C.astype(np.uint64), precision="exact")


# ---- layouts the compiled exact loop cannot read ----------------------------------------

UNREADABLE = {
    "fortran": np.asfortranarray,
    "big-endian": lambda x: x.astype(x.dtype.newbyteorder(">")),
    "every other column": lambda x: np.repeat(x, 2, axis=1)[:, ::2],
    "unaligned": lambda x: np.frombuffer(b"\0" + x.tobytes(), np.uint8)[1:].view(
        x.dtype).reshape(x.shape),
}


@pytest.mark.skipif(exact.exact_host is None, reason="verifier.exact_host not built")
@pytest.mark.parametrize("layout", UNREADABLE)
def test_compiled_loop_converts_unreadable_layouts_in_row_blocks(monkeypatch, layout):
    """Residues and flags equal Python's integers when the conversion takes several row
    blocks (a last short one included)."""
    monkeypatch.setattr(exact, "BLOCK_BYTES", 3 * 11 * 4)  # 3 rows of int32 per block
    rng = np.random.default_rng(7)
    M = rng.integers(-(2**20), 2**20, (37, 11)).astype(np.int32)
    M[[4, 30], [2, 9]] = 2**21  # above the limit below: those rows get p
    V = field_vectors(SEED, 11, 2)
    expected = reference_mod_p(M, V)
    expected[[4, 30]] = P
    m = UNREADABLE[layout](M)
    before = snapshot(m)
    np.testing.assert_array_equal(exact.native_mod_p(m, V, 2**31, 2**20 + 5), expected)
    np.testing.assert_array_equal(exact.native_mod_p(m, V, 2**21),
                                  reference_mod_p(M, V))
    assert snapshot(m) == before


@pytest.mark.skipif(exact.exact_host is None, reason="verifier.exact_host not built")
@pytest.mark.parametrize("layout", UNREADABLE)
def test_large_matrices_in_unreadable_layouts_are_never_copied_whole(layout):
    """docs/verifier.md: large host matrices are not copied. The compiled loop made a full
    native C-contiguous copy of any matrix it could not read as it is (16 MiB here)."""
    rng = np.random.default_rng(8)
    A = rng.integers(-128, 128, (4096, 8)).astype(np.int8)
    B = rng.integers(-128, 128, (8, 1024)).astype(np.int8)
    C = (A.astype(np.int32) @ B.astype(np.int32))  # (4096, 1024) int32, 16 MiB
    C[1000, 3] += 1
    c = UNREADABLE[layout](C)
    before = snapshot(c)
    tracemalloc.start()
    try:
        result = verify(A, B, c, precision="exact", seed=SEED)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not result.passed and result.worst_excess == 1
    assert result.reason.endswith("first row 1000")
    assert peak < C.nbytes // 4, peak
    assert snapshot(c) == before


# ---- seeds and the result's fields ------------------------------------------------------

def test_seeds_of_every_length_are_deterministic_and_distinct():
    """The seed's length is part of the stream's input: b"\\0" and b"\\0\\0" (and a seed
    and its extension) give different vectors; bytes, bytearray and memoryview of the same
    bytes give the same verdict and vectors."""
    seeds = [b"\0", b"\0\0", b"\0" * 32, b"\0" * 33, b"\1" * 200]
    signs = [sign_vectors(s, 64, 2).tobytes() for s in seeds]
    fields = [field_vectors(s, 64, 1).tobytes() for s in seeds]
    assert len(set(signs)) == len(set(fields)) == len(seeds)
    rng = np.random.default_rng(9)
    A, B = rng.standard_normal((6, 7), dtype=F32), rng.standard_normal((7, 64), dtype=F32)
    C = A @ B
    C[2, 5] += F32(0.01)  # near its bound: the excess depends on the vectors
    for seed in seeds:
        results = {verify(A, B, C, seed=s, rounds=2)
                   for s in (seed, bytearray(seed), memoryview(seed))}
        assert len(results) == 1
    with pytest.raises(ValueError, match="empty"):
        verify(A, B, C, seed=b"")


def test_result_fields_of_batches_and_of_verify_many():
    """rounds, the false-accept bound (2^-rounds; p^-rounds, never 0) and the excess over a
    whole batch (float: the worst row's |C r - A B r| - tau against a float64 evaluation;
    exact: the number of wrong rows over all elements)."""
    rng = np.random.default_rng(10)
    A = rng.integers(-4, 5, (3, 4, 5)).astype(F32)  # small integers: every sum exact
    B = rng.integers(-4, 5, (5, 6)).astype(F32)
    C = A @ B
    C[1, 2, 3] += 40
    C[2, 0, 0] -= 25
    result = verify(A, B, C, seed=SEED, rounds=5)
    assert result.rounds == 5 and result.false_accept_bound == 2.0**-5
    tau = documented_tau(A, B, C, "fp32")
    assert result.worst_excess == pytest.approx(40 - tau[1, 2], rel=1e-6)  # one entry: every r
    assert "row 2 of batch element (1,)" in result.reason
    Ai, Bi = A.astype(np.int8), B.astype(np.int8)
    Ci = C.astype(np.int32)
    exact_result = verify(Ai, Bi, Ci, precision="exact", seed=SEED, rounds=3)
    assert exact_result.worst_excess == 2 and exact_result.rounds == 3
    assert exact_result.false_accept_bound == pytest.approx(float(P) ** -3, rel=1e-12)
    assert verify(Ai, Bi, Ci, precision="exact", rounds=64).false_accept_bound > 0
    many = verify_many([(Ai[i], Bi, Ci[i]) for i in range(3)], precision="exact", seed=SEED)
    assert [r.worst_excess for r in many] == [0, 1, 1]
    child = derive_seed(SEED, (2).to_bytes(8, "big"))
    assert verify(Ai[2], Bi, Ci[2], precision="exact", seed=child) == many[2]
