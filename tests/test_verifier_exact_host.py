"""verifier.exact_host, the host's exact-mode loop built from csrc/: its sums against
numpy's float64 product, its layouts and its refusals. (tests/test_verifier_exact.py runs
every exact-mode test on both this path and numpy's.)"""
import numpy as np
import pytest
from helpers import integers, reference_mod_p

from verifier import P, exact
from verifier.exact import SPLIT, digit_width

pytestmark = pytest.mark.skipif(exact.exact_host is None,
                                reason="verifier.exact_host was not built (or no AVX2)")
ISAS = ["avx2", "avx512"] if exact.exact_host and exact.exact_host.ISA == "avx512" else ["avx2"]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32,
                                   np.uint32, np.int64])
def test_digit_sums_equal_float64_matmul(dtype, isa):
    """Rows and lengths that are not multiples of the kernel's 4 or 8 lanes and row groups,
    1 to 13 digit columns (groups of 4 and a remainder), the dtype's extremes, digits that
    keep every partial sum within 2^53, on each loop this CPU runs: equal to numpy's
    float64 product (itself exact there), and the row magnitudes equal numpy's."""
    rng = np.random.default_rng(21)
    bound = min(exact.dtype_magnitude(dtype), SPLIT // 2)
    for rows, inner, cols in [(1, 1, 1), (3, 7, 2), (9, 33, 4), (17, 100, 5), (40, 257, 13)]:
        M = rng.integers(max(np.iinfo(dtype).min, -bound), min(np.iinfo(dtype).max, bound),
                         (rows, inner), dtype=dtype, endpoint=True)
        M.flat[0] = max(np.iinfo(dtype).min, -bound)
        M.flat[-1] = min(np.iinfo(dtype).max, bound)
        width = digit_width(bound, inner, 1 << 53)
        W = rng.integers(-(1 << (width - 1)), 1 << (width - 1), (cols, inner),
                         endpoint=True).astype(np.float64)
        sums, magnitudes = exact.exact_host.digit_sums(M, W, True, isa)
        assert np.array_equal(sums, W @ M.T.astype(np.float64))
        assert np.array_equal(magnitudes, np.abs(M.astype(np.int64)).max(axis=1))
        assert exact.exact_host.digit_sums(M, W, False, isa)[1] is None


def test_native_mod_p_takes_any_layout():
    """Transposed, negatively strided, column-sliced, big-endian and unaligned matrices: the
    same residues as Python integers (those the kernel cannot read row by row are copied)."""
    rng = np.random.default_rng(22)
    M = integers(rng, (30, 70), np.int32, small=True)
    V = rng.integers(0, P, (70, 2), dtype=np.int64)
    want = reference_mod_p(M, V)
    unaligned = np.frombuffer(b"\0" + M.tobytes(), np.int32, offset=1).reshape(M.shape)
    assert not unaligned.flags.aligned
    views = [M, np.asfortranarray(M), M[::-1][::-1], M.astype(">i4"), unaligned]
    for view in views:
        assert np.array_equal(exact.native_mod_p(view, V, 1 << 31), want)
    wide = integers(rng, (30, 140), np.int32, small=True)
    assert np.array_equal(exact.native_mod_p(wide[:, ::2], V, 1 << 31),
                          reference_mod_p(wide[:, ::2], V))
    assert np.array_equal(exact.native_mod_p(M[::-1], V, 1 << 31), want[::-1])


def test_digit_sums_refuse_what_they_cannot_read():
    kernel = exact.exact_host.digit_sums
    M, W = np.ones((3, 4), np.int8), np.ones((2, 4))
    with pytest.raises(ValueError, match="differ in length"):
        kernel(M, np.ones((2, 5)), False)
    with pytest.raises(ValueError, match="2-D"):
        kernel(M[0], W, False)
    with pytest.raises(TypeError, match="integer matrix"):
        kernel(M.astype(np.float32), W, False)
    with pytest.raises(ValueError, match="contiguously"):
        kernel(np.ones((3, 8), np.int8)[:, ::2], W, False)
    with pytest.raises(ValueError, match="byte order"):
        kernel(M.astype(">i2"), W, False)
    with pytest.raises(TypeError, match="does not take"):
        kernel(M.astype(np.uint64), W, False)
    with pytest.raises(ValueError, match="isa must be"):
        kernel(M, W, False, "sse2")
