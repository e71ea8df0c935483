"""Float modes: honest results from many summation orders and backends pass; wrong ones fail.

Honest sources are independent re-implementations of a float32 matmul (reversed, blocked,
float64-then-rounded, round-toward-zero accumulation, tf32/bf16-rounded inputs, needle's cpu
backend), never the verifier's own arithmetic.
"""
import numpy as np
import pytest

from verifier import verify, verify_many
from verifier.floating import residual_and_bound
from verifier.rng import sign_vectors

SEEDS = [bytes([i]) * 32 for i in range(5)]


# ---- honest float32 products, each in a different order / precision -------------------

def numpy_matmul(A, B):
    return A @ B


def float64_rounded(A, B):
    return (A.astype(np.float64) @ B.astype(np.float64)).astype(np.float32)


def reversed_outer(A, B):
    """Sum of rank-1 terms in float32, last term first (a product then an add per step)."""
    C = np.zeros((A.shape[0], B.shape[1]), np.float32)
    for l in reversed(range(A.shape[1])):
        C += np.outer(A[:, l], B[l, :]).astype(np.float32)
    return C


def blocked(A, B, block=7):
    """Blocks of the inner dimension multiplied separately, partial sums added in reverse."""
    parts = [A[:, i : i + block] @ B[i : i + block] for i in range(0, A.shape[1], block)]
    C = np.zeros((A.shape[0], B.shape[1]), np.float32)
    for part in reversed(parts):
        C += part
    return C


def toward_zero(A, B):
    """Each accumulation step rounded toward zero, like a truncating tensor core."""
    C = np.zeros((A.shape[0], B.shape[1]), np.float32)
    for l in range(A.shape[1]):
        exact = C.astype(np.float64) + np.outer(A[:, l].astype(np.float64), B[l, :])
        rounded = exact.astype(np.float32)
        too_far = np.abs(rounded.astype(np.float64)) > np.abs(exact)
        C = np.where(too_far, np.nextafter(rounded, np.float32(0)), rounded)
    return C


def round_mantissa(x, keep_bits, truncate=False):
    """x rounded to keep_bits explicit mantissa bits (tf32: 10, bf16: 7), float32 layout."""
    drop = 23 - keep_bits
    u = x.view(np.uint32).astype(np.uint64)
    if not truncate:
        u = u + ((u >> drop) & 1) + (1 << (drop - 1)) - 1  # round half to even
    u = u & ~np.uint64((1 << drop) - 1)
    return u.astype(np.uint32).view(np.float32)


MANTISSA = {"tf32": 10, "bf16": 7}


def reduced_inputs(precision, truncate):
    def source(A, B):
        bits = MANTISSA[precision]
        return round_mantissa(A, bits, truncate) @ round_mantissa(B, bits, truncate)
    return source


SOURCES = [numpy_matmul, float64_rounded, reversed_outer, blocked, toward_zero]


def data(rng, shape, kind):
    if kind == "normal":
        return rng.standard_normal(shape, dtype=np.float32)
    if kind == "positive":  # no cancellation: rounding errors all push one way
        return rng.random(shape, dtype=np.float32)
    if kind == "wide":  # magnitudes over 2^-20 .. 2^20
        return (rng.standard_normal(shape) * 2.0 ** rng.integers(-20, 21, shape)).astype(
            np.float32)
    if kind == "sparse":
        return (rng.standard_normal(shape) * (rng.random(shape) < 0.2)).astype(np.float32)
    if kind == "tiny":  # products fall in the subnormal range
        return (rng.standard_normal(shape) * 1e-21).astype(np.float32)
    if kind == "huge":  # products near 1e34
        return (rng.standard_normal(shape) * 1e17).astype(np.float32)
    raise ValueError(kind)


KINDS = ["normal", "positive", "wide", "sparse", "tiny", "huge"]


# ---- completeness -----------------------------------------------------------------------

def test_thousands_of_small_honest_results_pass():
    rng = np.random.default_rng(0)
    triples = []
    for _ in range(400):
        m, k, n = rng.integers(1, 40, 3)
        kind = KINDS[rng.integers(len(KINDS))]
        A, B = data(rng, (m, k), kind), data(rng, (k, n), kind)
        for source in SOURCES:
            triples.append((A, B, source(A, B)))
    assert len(triples) == 2000
    results = verify_many(triples, precision="fp32", rounds=4, seed=b"completeness")
    failed = [(i, r.reason) for i, r in enumerate(results) if not r.passed]
    assert failed == []
    assert all(r.worst_excess <= 0 for r in results)


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("truncate", [False, True])
def test_reduced_precision_inputs_pass_in_their_class(precision, truncate):
    rng = np.random.default_rng(1)
    source = reduced_inputs(precision, truncate)
    triples = []
    for _ in range(150):
        m, k, n = rng.integers(1, 40, 3)
        kind = KINDS[rng.integers(len(KINDS))]
        A, B = data(rng, (m, k), kind), data(rng, (k, n), kind)
        triples.append((A, B, source(A, B)))
    assert all(r.passed for r in verify_many(triples, precision=precision, seed=b"x"))


def test_reduced_precision_result_fails_the_fp32_class():
    """bf16 inputs make errors far above what fp32 allows: the class matters."""
    rng = np.random.default_rng(2)
    A, B = data(rng, (64, 256), "positive"), data(rng, (256, 64), "positive")
    C = reduced_inputs("bf16", True)(A, B)
    assert verify(A, B, C, precision="bf16", seed=SEEDS[0]).passed
    assert not verify(A, B, C, precision="fp32", seed=SEEDS[0]).passed


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1024, 1), (1024, 1, 3), (1024, 700, 900)])
def test_large_and_degenerate_shapes_pass(shape):
    m, k, n = shape
    rng = np.random.default_rng(3)
    A, B = data(rng, (m, k), "normal"), data(rng, (k, n), "normal")
    sources = [numpy_matmul, float64_rounded, blocked] + ([reversed_outer] if k <= 1024 else [])
    for source in sources:
        result = verify(A, B, source(A, B), seed=SEEDS[1])
        assert result.passed, (source.__name__, result)


def test_long_truncating_accumulation_of_positive_terms_passes():
    """The worst honest case: every rounding toward zero over k = 4096 positive terms."""
    rng = np.random.default_rng(4)
    A, B = data(rng, (4, 4096), "positive"), data(rng, (4096, 6), "positive")
    C = toward_zero(A, B)
    exact = A.astype(np.float64) @ B.astype(np.float64)
    assert np.abs(C - exact).max() > 10 * np.abs(A @ B - exact).max()  # a real, biased drift
    assert verify(A, B, C, seed=SEEDS[2]).passed


def test_values_whose_float32_check_overflows_are_checked_in_float64():
    """Row sums of |C| reach 1e40 > float32's max although every entry is finite."""
    A, B = np.full((4, 2), 1e19, np.float32), np.full((2, 50), 1e19, np.float32)
    C = A @ B
    assert np.isfinite(C).all()
    assert verify(A, B, C, seed=SEEDS[0]).passed
    wrong = C.copy()
    wrong[1, 7] *= np.float32(0.5)
    assert not verify(A, B, wrong, seed=SEEDS[0]).passed


def test_needle_cpu_backend_results_pass():
    ndl = pytest.importorskip("needle")
    try:
        device = ndl.cpu()
        if not device.enabled():
            pytest.skip("needle cpu backend not built")
        rng = np.random.default_rng(5)
        cases = []
        for m, k, n in [(1, 1, 1), (17, 33, 9), (128, 300, 64)]:
            A, B = data(rng, (m, k), "normal"), data(rng, (k, n), "normal")
            C = (ndl.NDArray(A, device=device) @ ndl.NDArray(B, device=device)).numpy()
            cases.append((A, B, C))
    except (AttributeError, NotImplementedError) as err:
        pytest.skip(f"needle cpu matmul unavailable: {err}")
    for A, B, C in cases:
        assert verify(A, B, np.ascontiguousarray(C, np.float32), seed=SEEDS[3]).passed


# ---- soundness ----------------------------------------------------------------------------

def thresholds(A, B, C, seed, rounds):
    """2 tau_i, the size above which one wrong entry is always caught."""
    R = sign_vectors(seed, B.shape[1], rounds)
    _, tau = residual_and_bound(np, A, B, C, R, "fp32")
    return 2 * tau


def adversaries(A, B, C, rng):
    m, n = C.shape
    scale = float(thresholds(A, B, C, SEEDS[0], 1).max())
    big = 1e3 * scale
    row_offset = C.copy()
    row_offset[3] += big  # n is odd, so sum(r) != 0 and the row is always caught
    rolled = C.copy()
    rolled[5] = np.roll(rolled[5], 1)
    column = C.copy()
    column[:, 2] -= big
    u, v = rng.standard_normal((m, 2)), rng.standard_normal((2, n))
    low_rank = (C + big * (u @ v)).astype(np.float32)
    A2 = A.copy()
    A2[7, 11] += 1.0
    yield "row offset", row_offset
    yield "row rolled", rolled
    yield "column shifted", column
    yield "rank-2 error", low_rank
    yield "zeros", np.zeros_like(C)
    yield "transpose", np.ascontiguousarray(C.T)
    yield "slightly different input", A2 @ B
    yield "swapped operands", B @ A
    yield "random", rng.standard_normal(C.shape).astype(np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        poisoned = C.copy()
        poisoned[0, 0] = bad
        yield f"{bad} entry", poisoned


@pytest.mark.parametrize("rounds", [2, 3])
def test_adversarial_results_fail(rounds):
    rng = np.random.default_rng(6)
    n = 63
    A, B = data(rng, (n, n), "normal"), data(rng, (n, n), "normal")
    C = A @ B
    for name, wrong in adversaries(A, B, C, rng):
        for seed in SEEDS:
            result = verify(A, B, wrong, rounds=rounds, seed=seed)
            assert not result.passed, (name, seed, result)
            assert result.worst_excess > 0 and result.reason != "ok"


def test_one_entry_just_above_the_threshold_is_always_caught():
    rng = np.random.default_rng(7)
    A, B = data(rng, (40, 50), "normal"), data(rng, (50, 30), "normal")
    C = A @ B
    for seed in SEEDS:
        limit = thresholds(A, B, C, seed, 1)
        for i in (0, 17, 39):
            wrong = C.copy()
            wrong[i, 4] += np.float32(limit[i] * 1.01)
            assert not verify(A, B, wrong, rounds=1, seed=seed).passed
            smaller = C.copy()
            smaller[i, 4] += np.float32(limit[i] * 1e-3)  # far inside: looks honest
            assert verify(A, B, smaller, rounds=1, seed=seed).passed


def test_nan_and_inf_in_inputs_fail_and_name_the_matrix():
    rng = np.random.default_rng(8)
    A, B = data(rng, (8, 9), "normal"), data(rng, (9, 10), "normal")
    C = A @ B
    for name, index in (("A", 0), ("B", 1)):
        operands = [A.copy(), B.copy(), C]
        operands[index][2, 3] = np.nan
        result = verify(*operands, seed=SEEDS[0])
        assert not result.passed and result.worst_excess == np.inf
        assert f"NaN or Inf in {name}" in result.reason


def test_single_round_false_accept_rate_matches_the_theory():
    """Error x (e_j1 - e_j2) in one row, x far above the threshold: a round misses exactly
    when r_j1 == r_j2, probability 1/2, which is the bound; two rounds, 1/4."""
    rng = np.random.default_rng(9)
    A, B = data(rng, (6, 8), "normal"), data(rng, (8, 10), "normal")
    C = A @ B
    x = np.float32(100 * thresholds(A, B, C, SEEDS[0], 1).max())
    wrong = C.copy()
    wrong[2, 1] += x
    wrong[2, 6] -= x
    trials = 1600
    for rounds, bound in ((1, 0.5), (2, 0.25)):
        results = [verify(A, B, wrong, rounds=rounds, seed=i.to_bytes(4, "big"))
                   for i in range(trials)]
        rate = sum(r.passed for r in results) / trials
        assert results[0].false_accept_bound == bound
        sd = (bound * (1 - bound) / trials) ** 0.5
        assert abs(rate - bound) < 5 * sd, rate


def test_float32_and_float64_evaluations_give_the_same_bound():
    """Host (float32) and GPU / fallback (float64) paths charge the same unit, so nodes on
    different paths compare against the same tau and the residuals agree closely."""
    rng = np.random.default_rng(10)
    A, B = data(rng, (50, 70), "normal"), data(rng, (70, 40), "normal")
    C = A @ B
    R = sign_vectors(SEEDS[0], 40, 3)
    res32, tau32 = residual_and_bound(np, A, B, C, R, "fp32", np.float32)
    res64, tau64 = residual_and_bound(np, A, B, C, R, "fp32", np.float64)
    np.testing.assert_allclose(tau32, tau64, rtol=1e-5)
    assert np.abs(res32 - res64).max() < 1e-2 * tau64.min()  # rounding noise, far below tau
