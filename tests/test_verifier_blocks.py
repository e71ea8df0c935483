"""The row-blocked host passes against references: verifier.arrays.products against an
unblocked evaluation (block boundaries, sizes that are no multiple of the block, narrow and
wide W, conversions), float verdicts of verify() against the same check unblocked, and exact
verdicts in 2-row blocks against the wrong rows found with Python integers."""
import numpy as np
import pytest

from verifier import arrays, exact, floating, verify
from verifier.rng import sign_vectors


def unblocked_products(xp, M, W, v, dtype, over=None):
    """The reference: whole-matrix conversion, absolute value and products."""
    if over is not None:
        over[1][:] |= (np.abs(M.astype(np.float64)) > over[0]).any(axis=1)
    Mx = M.astype(dtype)
    return Mx @ W, (None if v is None else np.abs(Mx) @ v)


@pytest.fixture(params=[1, 3, 64])
def block_rows(request, monkeypatch):
    """Blocks of 1, 3 and 64 rows of 5 float64 columns (a block of 3 leaves a remainder)."""
    monkeypatch.setattr(arrays, "BLOCK_BYTES", request.param * 5 * 8)
    return request.param


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 64, 65])
@pytest.mark.parametrize("columns", [1, 2, 3, 16])
def test_blocked_products_equal_unblocked_on_exact_data(block_rows, rows, columns):
    """Small integers: every sum is exact, so blocking must not change a single bit."""
    rng = np.random.default_rng(rows * 100 + columns)
    M = rng.integers(-100, 100, (rows, 5)).astype(np.int16)
    W = rng.integers(-9, 9, (5, columns)).astype(np.float64)
    v = rng.integers(0, 9, 5).astype(np.float64)
    signed, absolute = arrays.products(np, M, W, v, np.float64)
    want_signed, want_absolute = unblocked_products(np, M, W, v, np.float64)
    assert signed.shape == (rows, columns) and absolute.shape == (rows,)
    assert np.array_equal(signed, want_signed)
    assert np.array_equal(absolute, want_absolute)
    signed_only, none = arrays.products(np, M, W, None, np.float64)
    assert none is None and np.array_equal(signed_only, want_signed)


@pytest.mark.parametrize("columns", [1, 2, 5])
def test_blocked_products_of_strided_float32_views_match(block_rows, columns):
    """A transposed (non-contiguous) float32 input, read block by block, no conversion."""
    rng = np.random.default_rng(columns)
    M = rng.standard_normal((10, 7), dtype=np.float32).T  # 7 x 10 view, column-major
    W = rng.standard_normal((10, columns), dtype=np.float32)
    v = rng.random(10, dtype=np.float32)
    signed, absolute = arrays.products(np, M, W, v, np.float32)
    want_signed, want_absolute = unblocked_products(np, M, W, v, np.float32)
    np.testing.assert_allclose(signed, want_signed, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(absolute, want_absolute, rtol=1e-5)
    assert M.base is not None and M.flags.f_contiguous  # the input was not made contiguous


@pytest.mark.parametrize("rounds", [1, 2, 16])
@pytest.mark.parametrize("shape", [(1, 1, 1), (13, 7, 11), (70, 33, 9)])
def test_float_verdicts_and_excesses_equal_the_unblocked_check(monkeypatch, rounds, shape):
    """Bounds agree to float32 summation noise; residuals, which are float32 rounding noise
    themselves for an honest C, agree to a small fraction of the bound."""
    m, k, n = shape
    rng = np.random.default_rng(m + k + n)
    A = rng.standard_normal((m, k), dtype=np.float32)
    B = rng.standard_normal((k, n), dtype=np.float32)
    honest = A @ B
    wrong = honest.copy()
    wrong[m // 2, n - 1] += 1.0
    seed = b"blocks"
    R = sign_vectors(seed, n, rounds)
    monkeypatch.setattr(arrays, "BLOCK_BYTES", 3 * max(k, n) * 4)  # 3-row blocks or fewer
    blocked = [verify(A, B, C, rounds=rounds, seed=seed) for C in (honest, wrong)]
    parts = [floating.residual_and_bound(np, A, B, C, R, "fp32") for C in (honest, wrong)]
    monkeypatch.setattr(floating, "products", unblocked_products)
    reference = [verify(A, B, C, rounds=rounds, seed=seed) for C in (honest, wrong)]
    want_parts = [floating.residual_and_bound(np, A, B, C, R, "fp32") for C in (honest, wrong)]
    for (residual, tau), (want_residual, want_tau) in zip(parts, want_parts, strict=True):
        np.testing.assert_allclose(tau, want_tau, rtol=1e-5)
        assert (np.abs(residual - want_residual) <= 0.05 * want_tau[:, None]).all()
    scale = 0.05 * want_parts[0][1].max()
    for got, want in zip(blocked, reference, strict=True):
        assert got.passed == want.passed
        assert got.worst_excess == pytest.approx(want.worst_excess, abs=scale)
    assert blocked[0].passed and not blocked[1].passed


@pytest.mark.parametrize("c_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shape", [(1, 1, 1), (9, 5, 7), (37, 20, 3)])
def test_exact_verdicts_in_row_blocks_count_the_wrong_rows(monkeypatch, c_dtype, shape):
    """2-row blocks of every matrix: the honest C passes; a wrong C fails with exactly its
    wrong rows counted (found with Python integers) and the first of them named."""
    m, k, n = shape
    rng = np.random.default_rng(m * k * n)
    A = rng.integers(-128, 128, (m, k), dtype=np.int8)
    B = rng.integers(-128, 128, (k, n), dtype=np.int8)
    product = A.astype(object) @ B.astype(object)
    honest = product.astype(c_dtype)
    wrong = honest.copy()
    wrong[m - 1, 0] += 1
    if m > 2:
        wrong[1, n - 1] -= 7
    if c_dtype == np.int64:
        wrong[0, 0] += 1 << 40  # too large to be the product, still a mod-p mismatch row
    elif m > 3:
        wrong[3, 0] = k * 128 * 128 + 1  # above the product bound: a marked row
    monkeypatch.setattr(exact, "BLOCK_BYTES", 2 * max(k, n) * 8)
    wrong_rows = np.flatnonzero((wrong.astype(object) != product).any(axis=1))
    assert verify(A, B, honest, precision="exact", seed=b"b").passed
    result = verify(A, B, wrong, precision="exact", seed=b"b")
    assert not result.passed and result.worst_excess == len(wrong_rows)
    assert result.reason == f"{len(wrong_rows)} rows differ mod p, first row {wrong_rows[0]}"
