"""Session 22's differential review of the host verifier: honest float results from orders
and data the other tests do not use, adversarial results, exact residues for every dtype
pairing and byte order on every host loop, the exact operand rule at its boundary.

References are independent of the verifier: Python integers, float64 products, and float32
accumulations written out step by step."""
import itertools

import numpy as np
import pytest

from verifier import P, exact, verify
from verifier.floating import residual_and_bound

F32 = np.float32
SEED = b"review-22".ljust(32, b".")
INT_TYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32]
HOST_LOOPS = (["avx512", "avx2"] if exact.exact_host is not None
              and exact.exact_host.ISA == "avx512" else
              ["avx2"] if exact.exact_host is not None else []) + ["numpy"]


@pytest.fixture(params=HOST_LOOPS)
def host_loop(request, monkeypatch):
    """Exact mode's host loop under test: the compiled one for each instruction set this
    CPU runs, or numpy's (the same residues, bit for bit, are required of all)."""
    if request.param == "numpy":
        monkeypatch.setattr(exact, "exact_host", None)
    elif request.param == "avx2":
        compiled = exact.exact_host

        class Avx2:
            @staticmethod
            def digit_sums(M, W, check):
                return compiled.digit_sums(M, W, check, "avx2")

        monkeypatch.setattr(exact, "exact_host", Avx2)
    return request.param


# ---- honest float32 products, each accumulated in its own way --------------------------

def sequential(A, B, order):
    """One float32 product and one float32 add per step, in the given order of l."""
    C = np.zeros((A.shape[0], B.shape[1]), F32)
    for l in order:
        C = C + np.outer(A[:, l], B[l]).astype(F32)
    return C


def fused(A, B):
    """Each step a fused multiply-add: the product exact, one rounding per step."""
    C = np.zeros((A.shape[0], B.shape[1]), F32)
    for l in range(A.shape[1]):
        C = (C + np.outer(A[:, l].astype(np.float64), B[l])).astype(F32)
    return C


def pairwise(A, B):
    """Products rounded to float32, then summed as a balanced tree."""
    terms = (A[:, :, None] * B[None]).astype(F32)
    while terms.shape[1] > 1:
        if terms.shape[1] % 2:
            terms = np.concatenate([terms, np.zeros_like(terms[:, :1])], axis=1)
        terms = terms[:, 0::2] + terms[:, 1::2]
    return terms[:, 0]


def split_k(A, B, parts=3):
    """A split-K GPU reduction: strided slices of l multiplied apart, then added."""
    total = A[:, 0::parts] @ B[0::parts]
    for q in range(1, parts):
        total = total + A[:, q::parts] @ B[q::parts]
    return total


def toward_zero(A, B):
    """Every step truncated toward zero, as a tensor core's accumulator does."""
    C = np.zeros((A.shape[0], B.shape[1]), F32)
    for l in range(A.shape[1]):
        exact_sum = C.astype(np.float64) + np.outer(A[:, l].astype(np.float64), B[l])
        rounded = exact_sum.astype(F32)
        too_far = np.abs(rounded.astype(np.float64)) > np.abs(exact_sum)
        C = np.where(too_far, np.nextafter(rounded, F32(0)), rounded)
    return C


HONEST = {
    "numpy": lambda A, B: A @ B,
    "float64 rounded": lambda A, B: (A.astype(np.float64) @ B.astype(np.float64)).astype(F32),
    "forward": lambda A, B: sequential(A, B, range(A.shape[1])),
    "reversed": lambda A, B: sequential(A, B, reversed(range(A.shape[1]))),
    "fused": fused,
    "pairwise": pairwise,
    "split k": split_k,
    "toward zero": toward_zero,
}


def keep_bits(x, bits, truncate):
    """x with `bits` explicit mantissa bits (tf32 10, bf16 7), rounded to nearest even or
    truncated."""
    drop = 23 - bits
    u = x.view(np.uint32).astype(np.uint64)
    if not truncate:
        u = u + ((u >> drop) & 1) + (1 << (drop - 1)) - 1
    return ((u >> drop) << drop).astype(np.uint32).view(F32)


def operands(kind, rng, m, k, n):
    """Data meant to find a bound too tight: each kind stresses another term of tau."""
    if kind == "dynamic range":  # 36 decades within a row, products within float32
        scale = lambda shape: 10.0 ** rng.uniform(-18, 18, shape)  # noqa: E731
        return ((rng.standard_normal((m, k)) * scale((m, k))).astype(F32),
                (rng.standard_normal((k, n)) * scale((k, n))).astype(F32))
    if kind == "cancellation":  # C exactly 0 where |A||B| is 1e35
        A, B = rng.standard_normal((m, k)).astype(F32), rng.standard_normal((k, n)).astype(F32)
        h = k // 2
        A[:, h : 2 * h], B[h : 2 * h] = A[:, :h], -B[:h]
        return A * F32(1e20), B * F32(1e15)
    if kind == "subnormal products":
        return ((rng.standard_normal((m, k)) * 1e-22).astype(F32),
                (rng.standard_normal((k, n)) * 1e-22).astype(F32))
    if kind == "subnormal inputs":
        return (rng.standard_normal((m, k)) * 1e-40).astype(F32), rng.standard_normal(
            (k, n)).astype(F32)
    if kind == "near float32 max":
        signs = rng.choice([-1.0, 1.0], (m, k))
        return (signs * 3e38).astype(F32), (rng.uniform(-1, 1, (k, n)) / k).astype(F32)
    return rng.uniform(0, 1, (m, k)).astype(F32), rng.uniform(0, 1, (k, n)).astype(F32)


KINDS = ["dynamic range", "cancellation", "subnormal products", "subnormal inputs",
         "near float32 max", "positive"]
SHAPES = [(1, 1, 1), (3, 1, 5), (1, 17, 1), (5, 33, 1), (1, 40, 7), (8, 64, 8), (4, 200, 3)]
CLASSES = [("fp32", None), ("tf32", False), ("tf32", True), ("bf16", False), ("bf16", True)]


@pytest.mark.parametrize("kind", KINDS)
def test_honest_float_results_pass_however_accumulated(kind):
    """8 accumulation orders x 7 shapes x 5 input classes: every finite honest result
    passes in its class (1680 checks)."""
    rng = np.random.default_rng(KINDS.index(kind))
    checked = 0
    for m, k, n in SHAPES:
        A, B = operands(kind, rng, m, k, n)
        for precision, truncate in CLASSES:
            bits = {"tf32": 10, "bf16": 7}.get(precision)
            a, b = (A, B) if bits is None else (keep_bits(A, bits, truncate),
                                                keep_bits(B, bits, truncate))
            for name, product in HONEST.items():
                with np.errstate(over="ignore", invalid="ignore"):
                    C = product(a, b).astype(F32)
                if not np.isfinite(C).all():  # an overflowed product is no honest result
                    continue
                result = verify(A, B, C, precision=precision, seed=SEED)
                assert result.passed, (kind, (m, k, n), precision, truncate, name, result)
                checked += 1
    assert checked >= 200


def test_honest_float_results_pass_at_the_largest_inner_dimension():
    """k = MAX_INNER - 1, where the accumulation bound is largest: cumulative float32 sums
    (numpy's cumsum adds in order) of positive and of cancelling terms pass."""
    rng = np.random.default_rng(7)
    k = (1 << 22) - 1
    A, B = rng.standard_normal((1, k)).astype(F32), rng.standard_normal((k, 2)).astype(F32)
    h = k // 2
    A[0, h : 2 * h], B[h : 2 * h] = A[0, :h], -B[:h]
    for a, b in ((A, B), (np.abs(A), np.abs(B))):
        forward = np.stack([np.cumsum(a[0] * b[:, j], dtype=F32)[-1] for j in range(2)])
        for C in (a @ b, forward[None]):
            assert verify(a, b, C, precision="fp32", seed=SEED).passed


# ---- wrong float results ------------------------------------------------------------------

def test_wrong_float_results_with_an_entry_above_twice_the_bound_fail():
    """Shifted rows and columns, a rank-1 error, the product of perturbed inputs, a zero or
    scaled result, the transpose: 2 rounds reject every one that has an entry above
    2 tau_i; NaN or Inf anywhere fails with worst_excess = inf."""
    rng = np.random.default_rng(8)
    checked = 0
    for _ in range(20):
        m, k, n = (int(d) for d in rng.integers(2, 40, 3))
        A, B = rng.standard_normal((m, k)).astype(F32), rng.standard_normal((k, n)).astype(F32)
        C = A @ B
        wrong = [np.roll(C, 1, 0), np.roll(C, 1, 1), C * F32(1.01), np.zeros_like(C),
                 C + np.outer(rng.standard_normal(m), rng.standard_normal(n)).astype(F32),
                 A @ (B + F32(1e-2) * rng.standard_normal(B.shape).astype(F32))]
        if m == n:
            wrong.append(np.ascontiguousarray(C.T))
        exact_product = A.astype(np.float64) @ B
        for W, precision in itertools.product(wrong, ("fp32", "tf32", "bf16")):
            _, tau = residual_and_bound(np, A, B, W, np.ones((n, 1), F32), precision,
                                        np.float64)
            if (np.abs(W - exact_product) > 2 * tau[:, None]).any():
                result = verify(A, B, W, precision=precision, rounds=2, seed=rng.bytes(32))
                assert not result.passed and result.worst_excess > 0
                checked += 1
        for name, value in itertools.product("ABC", (np.nan, np.inf, -np.inf)):
            X = {"A": A.copy(), "B": B.copy(), "C": C.copy()}
            M = X[name]
            M[rng.integers(M.shape[0]), rng.integers(M.shape[1])] = value
            result = verify(X["A"], X["B"], X["C"], seed=rng.bytes(32))
            assert not result.passed and result.worst_excess == np.inf, (name, value)
            assert name in result.reason
    assert checked >= 250


@pytest.mark.parametrize("error, probability", [
    ([1, -1] + [0] * 14, 1 / 2),
    ([1, 1, 1, 1] + [0] * 12, 6 / 16),
    ([1] * 16, 12870 / 2**16),  # C(16, 8) / 2^16
    ([0, 0, 0, 0, 0, 1] + [0] * 10, 0),
])
def test_single_round_false_accepts_follow_the_sign_distribution(error, probability):
    """One round, an error far above the bound: accepted with exactly the probability that
    its +-1 combination vanishes (below 1/2, the stated bound), within 4 standard
    deviations over 3000 seeds."""
    rng = np.random.default_rng(9)
    A, B = rng.standard_normal((8, 16)).astype(F32), rng.standard_normal((16, 16)).astype(F32)
    C = A @ B
    _, tau = residual_and_bound(np, A, B, C, np.ones((16, 1), F32), "fp32", np.float64)
    C[2] += F32(100 * tau.max()) * np.asarray(error, F32)
    seeds = 3000
    accepted = sum(verify(A, B, C, rounds=1, seed=s.to_bytes(4, "big")).passed
                   for s in range(seeds))
    spread = 4 * (probability * (1 - probability) / seeds) ** 0.5
    assert abs(accepted / seeds - probability) <= spread and accepted / seeds <= 0.5 + spread


# ---- exact mode -----------------------------------------------------------------------

def python_mod_p(M, V) -> np.ndarray:
    rows = [[int(x) for x in row] for row in M]
    cols = [[int(x) for x in col] for col in np.asarray(V).T]
    return np.array([[sum(a * v for a, v in zip(row, col, strict=True)) % P for col in cols]
                     for row in rows], dtype=np.int64)


def extremes(rng, dtype, shape):
    """Entries drawn from the dtype's minimum and maximum, 0, 1 and their neighbours."""
    info = np.iinfo(dtype)
    values = [int(info.min), int(info.max), 0, 1, int(info.max) - 1,
              int(info.min) + 1 if info.min < 0 else 2]
    return np.array(rng.choice(np.array(values, dtype=object), shape).tolist(), dtype=dtype)


@pytest.mark.parametrize("dtype", INT_TYPES)
def test_residues_equal_python_integers_on_every_host_loop(host_loop, dtype):
    """matmul_mod_p at the dtype's extremes, either byte order, inner lengths around the
    vector width, trusted or checked against a limit (rows above it get p)."""
    rng = np.random.default_rng(INT_TYPES.index(dtype))
    for order, inner in itertools.product("=>", (1, 3, 8, 13, 70)):
        M = extremes(rng, dtype, (9, inner)).astype(np.dtype(dtype).newbyteorder(order))
        V = rng.integers(0, P, (inner, 3), dtype=np.int64)
        V[0, 0], V[-1, -1] = P - 1, 0
        want = python_mod_p(M, V)
        bound = exact.dtype_magnitude(M.dtype)
        np.testing.assert_array_equal(exact.matmul_mod_p(np, M, V, bound), want)
        for limit in (0, 100, bound // 2, 1 << 31):
            marked = want.copy()
            marked[(np.abs(M.astype(object)) > limit).any(axis=1)] = P
            np.testing.assert_array_equal(exact.matmul_mod_p(np, M, V, bound, limit), marked)


def test_host_loops_give_identical_residues_on_random_shapes(monkeypatch):
    """400 random dtypes, shapes, column counts and limits: the compiled loop for each
    instruction set and numpy's give the same residues, bit for bit."""
    if exact.exact_host is None:
        pytest.skip("verifier.exact_host was not built")
    compiled = exact.exact_host
    rng = np.random.default_rng(11)
    for _ in range(400):
        dtype = INT_TYPES[rng.integers(len(INT_TYPES))]
        info = np.iinfo(dtype)
        rows, inner, cols = (int(d) for d in rng.integers(1, (40, 300, 5)))
        M = rng.integers(max(int(info.min), -(1 << 40)), min(int(info.max), 1 << 40),
                         (rows, inner), endpoint=True).astype(dtype)
        M.flat[rng.integers(M.size)], M.flat[rng.integers(M.size)] = info.min, info.max
        V = rng.integers(0, P, (inner, cols), dtype=np.int64)
        bound = exact.data_magnitude(M)
        limit = int(rng.integers(0, min(bound, (1 << 32) - 1))) if rng.random() < 0.5 else None
        found = []
        for isa in (["avx512"] if compiled.ISA == "avx512" else []) + ["avx2", None]:
            monkeypatch.setattr(exact, "exact_host", None if isa is None else type(
                "Loop", (), {"digit_sums": staticmethod(
                    lambda M, W, check, isa=isa: compiled.digit_sums(M, W, check, isa))}))
            found.append(exact.matmul_mod_p(np, M, V, bound, limit))
        for other in found[1:]:
            np.testing.assert_array_equal(other, found[0])


@pytest.mark.parametrize("c_dtype", [np.int64, np.dtype(">i8")])
def test_every_dtype_pairing_passes_honest_and_counts_wrong_rows(host_loop, c_dtype):
    """A and B at their dtypes' extremes for the 32 of 49 pairings within the operand rule: the
    Python-integer product passes; one entry off by 1 or by p is one wrong row."""
    rng = np.random.default_rng(12)
    k, checked = 5, 0
    for dtype_a, dtype_b in itertools.product(INT_TYPES, INT_TYPES):
        A, B = extremes(rng, dtype_a, (4, k)), extremes(rng, dtype_b, (k, 3))
        bound_a, bound_b = exact.operand_bounds(A, B)
        if 2 * k * bound_a * bound_b >= P:
            continue
        product = A.astype(object) @ B.astype(object)
        assert verify(A, B, np.array(product.tolist(), c_dtype), precision="exact",
                      seed=SEED).passed
        for delta, (i, j) in ((1, (0, 0)), (-1, (3, 2)), (P, (1, 1))):
            wrong = product.copy()
            wrong[i, j] += delta
            result = verify(A, B, np.array(wrong.tolist(), c_dtype), precision="exact",
                            seed=SEED)
            assert not result.passed and result.worst_excess == 1, (dtype_a, dtype_b, delta)
        checked += 1
    assert checked >= 30


def test_operand_rule_boundary_and_the_forgery_at_it(host_loop):
    """k max|A| max|B| = (p - 1)/2 is the largest product bound the rule 2 k max|A| max|B|
    < p admits (node/client.py and node/compute.py test the same rule); there the honest
    product passes and C = AB - p, whose magnitude plus the bound is exactly p, fails;
    one more is a ValueError."""
    b = np.array([[1], [1], [1]], np.int8)
    a = np.array([[(P - 1) // 2 // 3] * 3], np.int64)  # 3 divides 2^60 - 1
    product = int(a.sum())
    assert 3 * int(a.max()) == product == (P - 1) // 2
    assert verify(a, b, np.array([[product]]), precision="exact", seed=SEED).passed
    forged = verify(a, b, np.array([[product - P]]), precision="exact", seed=SEED)
    assert not forged.passed and forged.worst_excess == 1
    a[0, 0] += 1
    with pytest.raises(ValueError, match="2\\^61 - 1"):
        verify(a, b, np.array([[product + 1]]), precision="exact", seed=SEED)


def test_int32_operands_with_a_long_inner_dimension(host_loop):
    """int32 at its extremes times int8, k = 2^20: float64 digits would be 3 bits wide, so
    A's pass runs in int64; the exact product passes, +1 and +p do not."""
    rng = np.random.default_rng(13)
    k = 1 << 20
    A = np.where(rng.random((2, k)) < 0.5, -(2**31), 2**31 - 1).astype(np.int32)
    B = np.where(rng.random((k, 2)) < 0.5, -128, 127).astype(np.int8)
    C = np.array((A.astype(object) @ B.astype(object)).tolist(), dtype=np.int64)
    assert verify(A, B, C, precision="exact", seed=SEED).passed
    for delta in (1, P):
        wrong = C.copy()
        wrong[1, 0] += delta
        assert not verify(A, B, wrong, precision="exact", seed=SEED).passed


# ---- layouts ----------------------------------------------------------------------------

def unaligned(x):
    """x copied to an address one byte past an aligned one."""
    raw = np.zeros(x.nbytes + 1, np.uint8)
    y = np.ndarray(x.shape, x.dtype, buffer=raw.data, offset=1)
    y[...] = x
    return y


def small_integers(rng, dtype, shape):
    """Entries within +-100 (0..199 for unsigned types)."""
    low = 0 if np.dtype(dtype).kind == "u" else -100
    return rng.integers(low, low + 200, shape).astype(dtype)


LAYOUTS = {
    "unaligned": unaligned,
    "reversed twice": lambda x: x[::-1, ::-1].copy()[::-1, ::-1],
    "fortran": np.asfortranarray,
    "every other column": lambda x: np.repeat(x, 2, axis=1)[:, ::2],
    "big-endian": lambda x: x.astype(x.dtype.newbyteorder(">")),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_give_the_same_verdicts_and_are_never_written(host_loop, layout):
    """Exact (every input dtype against int16 B) and fp32 checks of read-only views in each
    layout: honest passes, one changed entry fails, no input changes."""
    rng = np.random.default_rng(14)
    f = LAYOUTS[layout]
    triples = []
    for dtype in INT_TYPES:
        A = small_integers(rng, dtype, (7, 13))
        B = rng.integers(-100, 100, (13, 9)).astype(np.int16)
        triples.append(("exact", A, B, (A.astype(np.int64) @ B).astype(np.int32)))
    A, B = rng.standard_normal((7, 13)).astype(F32), rng.standard_normal((13, 9)).astype(F32)
    triples.append(("fp32", A, B, A @ B))
    for precision, A, B, C in triples:
        a, b, c = (f(x) for x in (A, B, C))
        for x in (a, b, c):
            x.flags.writeable = False
        before = [(x.tobytes(), x.dtype, x.strides) for x in (a, b, c)]
        assert verify(a, b, c, precision=precision, seed=SEED).passed
        wrong = np.array(c)
        wrong[3, 4] += 1
        assert not verify(a, b, wrong, precision=precision, rounds=2, seed=SEED).passed
        assert [(x.tobytes(), x.dtype, x.strides) for x in (a, b, c)] == before
