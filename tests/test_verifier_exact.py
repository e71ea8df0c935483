"""Exact mode: modular arithmetic against Python integers, honest integer products pass,
every wrong one fails, including a result that is right only modulo p."""
import numpy as np
import pytest
from helpers import integers, reference_mod_p

from verifier import P, exact, verify, verify_many
from verifier.exact import SPLIT, digit_width, matmul_mod_p, signed_digits

SEEDS = [bytes([i]) * 32 for i in range(5)]
HOST_PATHS = ["native", "numpy"] if exact.exact_host is not None else ["numpy"]


@pytest.fixture(autouse=True, params=HOST_PATHS)
def host_path(request, monkeypatch):
    """Every test here runs on both host paths: verifier.exact_host's loop (built from
    csrc/) and numpy's, which installs without the module use."""
    if request.param == "numpy":
        monkeypatch.setattr(exact, "exact_host", None)
    return request.param
INPUT_TYPES = [np.int8, np.int16, np.int32, np.uint8, np.uint16]


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.uint32, np.int64])
def test_matmul_mod_p_matches_python_integers(dtype):
    rng = np.random.default_rng(0)
    # inner 16384: 32-bit entries leave 8- and 9-bit float64 digits, the narrowest there are
    for rows, inner, cols in [(1, 1, 1), (5, 300, 3), (7, 64, 2), (2, 16384, 1)]:
        M = integers(rng, (rows, inner), dtype)
        M.flat[0] = np.iinfo(dtype).min  # the extremes, int64's minimum included
        M.flat[-1] = np.iinfo(dtype).max
        V = rng.integers(0, P, (inner, cols), dtype=np.int64)
        V.flat[0] = P - 1
        bound = max(-int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
        assert np.array_equal(matmul_mod_p(np, M, V, bound), reference_mod_p(M, V))


@pytest.mark.parametrize("inner", [300, 16384])
def test_matmul_mod_p_at_the_worst_case_magnitudes(inner):
    """Every entry at the dtype's extreme and vectors whose digits are all at -2^(w-1) or
    at their largest: partial sums reach the limit that the digit width is chosen for
    (2^53 in float64, 2^62 in int64)."""
    for dtype in (np.int8, np.int32, np.int64):
        bound = max(-int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
        width = digit_width(min(bound, SPLIT // 2), inner, 1 << 53)
        if width < 8:
            width = digit_width(min(bound, SPLIT // 2), inner, 1 << 62)
        limbs = -(-61 // width)
        lowest = (1 << (width * (limbs - 1))) - sum(1 << (width * t + width - 1)
                                                   for t in range(limbs - 1))
        V = np.array([[P - 1, (1 << 60) - 1, lowest]] * inner, dtype=np.int64)
        for value in (np.iinfo(dtype).min, np.iinfo(dtype).max):
            M = np.full((3, inner), value, dtype=dtype)
            assert np.array_equal(matmul_mod_p(np, M, V, bound), reference_mod_p(M, V))


def test_signed_digits_rebuild_the_vector_within_their_bounds():
    rng = np.random.default_rng(8)
    V = rng.integers(0, P, (500, 3), dtype=np.int64)
    V[:4, 0] = [0, 1, P - 1, (1 << 60)]
    for width in (8, 10, 15, 16, 31, 35, 60):
        digits = signed_digits(np, V, width)
        assert digits.shape == (-(-61 // width), 3, 500)
        assert np.abs(digits).max() <= 2 ** (width - 1)
        weights = np.array([1 << (width * t) for t in range(digits.shape[0])], dtype=object)
        rebuilt = (digits.astype(object) * weights[:, None, None]).sum(axis=0)
        assert np.array_equal(rebuilt.astype(np.int64), V.T)


def test_rotate_multiplies_by_powers_of_two_mod_p():
    """Every shift 0..60, as an int and as an array, against Python integers; the extremes
    0, 1, p - 1 and 2^60 included."""
    rng = np.random.default_rng(12)
    x = np.concatenate([[0, 1, P - 1, 1 << 60], rng.integers(0, P, 57)]).astype(np.int64)
    shifts = np.arange(61)
    want = np.array([int(v) * 2**int(t) % P for v, t in zip(x, shifts, strict=True)])
    assert np.array_equal(exact.rotate(x, shifts), want)
    for t in (0, 1, 32, 60):
        assert np.array_equal(exact.rotate(x, t), [int(v) * 2**t % P for v in x])


@pytest.mark.parametrize("limit", [1 << 53, 1 << 62])
def test_digit_width_is_the_widest_that_stays_within_the_limit(limit):
    """inner * bound * 2^(w-1) <= limit < inner * bound * 2^w, checked with Python
    integers, powers of two included."""
    for bound in (1, 127, 128, 255, 1 << 15, 1 << 26, (1 << 31) - 1, 1 << 31):
        for inner in (1, 3, 4096, 4097, 1 << 20, 1 << 28):
            width = digit_width(bound, inner, limit)
            if inner * bound > limit or width == 60:
                continue
            assert inner * bound * (1 << (width - 1)) <= limit
            assert inner * bound * (1 << width) > limit
    assert digit_width(128, 4096, 1 << 53) == 35  # int8 operands, k = 4096: 2 digits
    assert digit_width(1 << 26, 4096, 1 << 53) == 16  # C checked against k 128^2: 4 digits
    assert digit_width((1 << 31) - 1, 4096, 1 << 53) == 11  # int32 C trusted: 6 digits


def test_matmul_mod_p_marks_rows_above_the_limit():
    """Rows with an entry past the limit get p; the other rows stay exact, also next to a
    row whose float64 sums overflow int64."""
    rng = np.random.default_rng(9)
    M = rng.integers(-(1 << 26), 1 << 26, (40, 4096), dtype=np.int64)
    M[3, 5], M[17, 0], M[39, 4095] = (1 << 26) + 1, -(1 << 62), 1 << 26
    V = rng.integers(0, P, (4096, 2), dtype=np.int64)
    got = matmul_mod_p(np, M, V, np.iinfo(np.int64).max, limit=1 << 26)
    want = reference_mod_p(M, V)
    want[[3, 17]] = P
    assert np.array_equal(got, want)


def test_matmul_mod_p_marks_rows_above_a_limit_of_32_bits_or_more():
    """A limit past 2^32 (int16 operands, k = 64: k max|A| max|B| = 2^36): the entries are
    split into 32-bit halves, every row exact, rows with an entry past the limit p."""
    rng = np.random.default_rng(13)
    limit = 1 << 36
    M = rng.integers(-limit, limit, (6, 64), dtype=np.int64, endpoint=True)
    M[1, 3], M[4, 0], M[5, 63] = limit + 1, -(1 << 62), -limit
    V = rng.integers(0, P, (64, 2), dtype=np.int64)
    want = reference_mod_p(M, V)
    want[[1, 4]] = P
    assert np.array_equal(matmul_mod_p(np, M, V, np.iinfo(np.int64).max, limit=limit), want)


def test_matmul_mod_p_in_int64_where_float64_digits_would_be_too_narrow():
    """int32 entries and an inner length of 2^16: float64 would leave 7-bit digits, so the
    digit products run in int64 (arrays.products), checked against Python integers."""
    rng = np.random.default_rng(14)
    inner = 1 << 16
    assert digit_width(1 << 31, inner, 1 << 53) < 8
    M = integers(rng, (2, inner), np.int32)
    M[0, :] = np.iinfo(np.int32).min
    V = rng.integers(0, P, (inner, 1), dtype=np.int64)
    V[:, 0] = P - 1
    assert np.array_equal(matmul_mod_p(np, M, V, 1 << 31), reference_mod_p(M, V))


def test_host_mod_p_with_a_digit_width_per_block(monkeypatch):
    """Row blocks of very different magnitudes (so different digit widths, down to the
    limit's own) in one matrix, a row at the limit itself, vectors with p - 1: every row
    exact against Python integers, rows with an entry past the limit p."""
    inner, limit, block = 4096, 1 << 26, 3
    monkeypatch.setattr(exact, "BLOCK_BYTES", block * inner * 8)
    rng = np.random.default_rng(11)
    tops = [1 << 8, limit, 1 << 20, 1 << 14]
    M = np.concatenate([rng.integers(-top, top, (block, inner), dtype=np.int64, endpoint=True)
                        for top in tops]).astype(np.int32)
    M[block, :] = -limit  # a whole row at the limit
    M[2 * block + 1, 7] = limit + 1  # past it: the row gets p
    V = rng.integers(0, P, (inner, 2), dtype=np.int64)
    V[:, 0] = P - 1
    widths = {digit_width(top, inner, 1 << 53) for top in tops}
    assert len(widths) == 4 and min(widths) == digit_width(limit, inner, 1 << 53)
    want = reference_mod_p(M, V)
    want[2 * block + 1] = P
    assert np.array_equal(exact.host_mod_p(M, V, 1 << 31, limit), want)
    assert np.array_equal(matmul_mod_p(np, M, V, 1 << 31, limit=limit), want)


@pytest.mark.parametrize("block", [1, 3, 64])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int32, np.uint32])
def test_host_mod_p_in_row_blocks_matches_python_integers(monkeypatch, block, dtype):
    """Blocks of 1, 3 and 64 rows (a remainder after the last whole one), one to three
    vector columns, the dtype's extremes, a strided (transposed) input that must not be
    copied, with and without a limit checked against the data."""
    inner = 300
    monkeypatch.setattr(exact, "BLOCK_BYTES", block * inner * 8)
    rng = np.random.default_rng(block)
    bound = exact.dtype_magnitude(dtype)
    for rows, cols in [(1, 1), (7, 3), (100, 2)]:
        M = integers(rng, (rows, inner), dtype)
        M[0, 0], M[-1, -1] = np.iinfo(dtype).min, np.iinfo(dtype).max
        V = rng.integers(0, P, (inner, cols), dtype=np.int64)
        V[0] = P - 1
        want = reference_mod_p(M, V)
        assert np.array_equal(exact.host_mod_p(M, V, bound), want)
        strided = np.asfortranarray(M.T).T  # the same matrix, column-major
        assert np.array_equal(exact.host_mod_p(strided, V, bound), want)
        if bound > 1000:  # a limit below the dtype's: rows with a larger entry get p
            over = (np.abs(M.astype(np.int64)) > 1000).any(axis=1)
            assert np.array_equal(exact.host_mod_p(M, V, bound, 1000),
                                  np.where(over[:, None], P, want))


def honest(A, B):
    return A.astype(np.int64) @ B.astype(np.int64)


def test_thousands_of_honest_integer_products_pass():
    rng = np.random.default_rng(1)
    triples = []
    for i in range(1500):
        m, k, n = rng.integers(1, 24, 3)
        dtype = INPUT_TYPES[i % len(INPUT_TYPES)]
        A = integers(rng, (m, k), dtype, small=dtype in (np.int32,))
        B = integers(rng, (k, n), dtype, small=dtype in (np.int32,))
        C = honest(A, B)
        fits = np.abs(C).max() < 2**31  # otherwise an int32 C would be wrapped, i.e. wrong
        triples.append((A, B, C.astype(np.int32) if fits and i % 2 else C))
    results = verify_many(triples, precision="exact", seed=b"exact completeness")
    assert [r.reason for r in results if not r.passed] == []
    assert all(r.worst_excess == 0 and r.rounds == 1 for r in results)


@pytest.mark.parametrize("shape", [(1, 1, 1), (512, 1024, 300), (3, 1024, 1)])
def test_larger_honest_products_pass(shape):
    m, k, n = shape
    rng = np.random.default_rng(2)
    A, B = integers(rng, (m, k), np.int8), integers(rng, (k, n), np.int8)
    C = (A.astype(np.float64) @ B.astype(np.float64)).astype(np.int32)  # exact below 2^53
    assert verify(A, B, C, precision="exact", seed=SEEDS[0]).passed


def test_full_range_int32_inputs_with_int64_results():
    """|entries| up to 2^31 with k = 3: products up to 2^63 do not fit, so the data decides."""
    rng = np.random.default_rng(3)
    A = rng.integers(-(2**28), 2**28, (6, 3)).astype(np.int32)
    B = rng.integers(-(2**28), 2**28, (3, 5)).astype(np.int32)
    C = honest(A, B)
    assert verify(A, B, C, precision="exact", seed=SEEDS[1]).passed
    C[4, 4] += 1
    assert not verify(A, B, C, precision="exact", seed=SEEDS[1]).passed


def adversaries(A, B, C, rng):
    yield "one entry +1", C + (np.arange(C.size).reshape(C.shape) == 7)
    shifted = C.copy()
    shifted[3] += 5
    yield "row shifted", shifted
    column = C.copy()
    column[:, 1] -= 1
    yield "column shifted", column
    yield "rank-1 error", C + np.outer(rng.integers(-3, 4, C.shape[0]),
                                       rng.integers(-3, 4, C.shape[1]) | 1)
    yield "zeros", np.zeros_like(C)
    yield "transpose", C.T.copy()
    A2 = A.copy()
    A2[2, 2] += 1
    yield "slightly different input", honest(A2, B)
    yield "swapped operands", honest(B, A)
    plus_p = C.copy()
    plus_p[0, 0] += P  # equal to the product mod p: caught by the magnitude rule
    yield "entry + p", plus_p
    yield "int32 wrap-around", (C * 2**24).astype(np.int32).astype(np.int64)


@pytest.mark.parametrize("rounds", [1, 2])
def test_adversarial_results_fail(rounds):
    rng = np.random.default_rng(4)
    A, B = integers(rng, (31, 31), np.int8), integers(rng, (31, 31), np.int8)
    C = honest(A, B)
    for name, wrong in adversaries(A, B, C, rng):
        assert not np.array_equal(wrong, C), name
        for seed in SEEDS:
            result = verify(A, B, wrong, precision="exact", rounds=rounds, seed=seed)
            assert not result.passed, (name, result)
            assert result.worst_excess >= 1 and result.reason != "ok"


def test_mismatch_count_is_the_number_of_wrong_rows():
    rng = np.random.default_rng(5)
    A, B = integers(rng, (20, 9), np.int16), integers(rng, (9, 12), np.int16)
    wrong = honest(A, B)
    wrong[[1, 4, 4, 19], [0, 3, 7, 11]] += 1
    result = verify(A, B, wrong, precision="exact", seed=SEEDS[2])
    assert result.worst_excess == 3 and "row 1" in result.reason


def test_false_accept_bound_is_p_to_the_minus_rounds():
    A = B = np.eye(3, dtype=np.int8)
    for rounds in (1, 2, 5):
        result = verify(A, B, np.eye(3, dtype=np.int32), precision="exact", rounds=rounds)
        assert result.false_accept_bound == pytest.approx(float(P) ** -rounds)
        assert result.false_accept_bound <= 2.0**-40


def test_single_round_never_accepts_crafted_errors():
    """A pair error (x, -x): a round misses iff r_j1 = r_j2 in Z_p, probability 1/p."""
    rng = np.random.default_rng(6)
    A, B = integers(rng, (5, 6), np.int8), integers(rng, (6, 7), np.int8)
    wrong = honest(A, B)
    wrong[1, 2] += 3
    wrong[1, 5] -= 3
    accepted = sum(verify(A, B, wrong, precision="exact", seed=i.to_bytes(4, "big")).passed
                   for i in range(2000))
    assert accepted == 0


def test_exact_mode_rejects_floats_and_oversized_operands():
    A = np.ones((2, 2), np.float32)
    with pytest.raises(TypeError, match="exact mode takes integer"):
        verify(A, A, A, precision="exact")
    I = np.ones((2, 2), np.int64)
    with pytest.raises(TypeError, match="C is uint64"):
        verify(I, I, I.astype(np.uint64), precision="exact")
    big = np.full((2, 2), 2**31 - 1, np.int32)
    with pytest.raises(ValueError, match="k \\* max\\|A\\| \\* max\\|B\\|"):
        verify(big, big, np.zeros((2, 2), np.int64), precision="exact")


def test_int32_entries_above_the_product_bound_fail_on_the_host():
    """k max|A| max|B| + 1 and int32's minimum: both rows counted, whatever r is."""
    rng = np.random.default_rng(10)
    A = integers(rng, (64, 128), np.int8)
    B = integers(rng, (128, 64), np.int8)
    C = honest(A, B).astype(np.int32)
    C[5, 6] = 128 * 128 * 128 + 1
    C[9, 1] = np.iinfo(np.int32).min
    for seed in SEEDS:
        result = verify(A, B, C, precision="exact", seed=seed)
        assert not result.passed and result.worst_excess == 2 and "first row 5" in result.reason

