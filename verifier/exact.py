"""Exact mode: C = A B over the integers, checked by Freivalds modulo p = 2^61 - 1.

Matrix entries stay as they are; the vectors, uniform in Z_p, are cut into signed w-bit
digits with w chosen so that every partial sum of (matrix) x (digits) is an integer of
magnitude at most 2^53 (float64 BLAS, exact) or, for very large entries or inner dimensions,
2^62 (int64): exact in any summation order. Digit results are reduced mod p and recombined
with shifts, which mod a Mersenne prime are 61-bit rotations. On the host C's entries are
checked against the product's bound rather than trusted up to their dtype's.

The host's float64 passes run in `verifier.exact_host` (csrc/verifier_exact_host*.cc) where
that module was built: it widens each entry in registers and takes it against every digit
column at once, where numpy writes a float64 copy of each row block and reads it once per
column. Both give the same sums, exactly; numpy's loop stays for installs without it.
"""
from __future__ import annotations

from types import ModuleType

import numpy as np

from verifier.arrays import products
from verifier.rng import P

try:  # optional: built from csrc/ with needle's backends; numpy gives the same result
    from verifier import exact_host
except ImportError:
    exact_host = None

SPLIT = 1 << 32  # entries at least this large are split into 32-bit halves first
BLOCK_BYTES = 1 << 21  # a float64 row block of host_mod_p: 64 rows at k = 4096, in L3


def dtype_magnitude(dtype) -> int:
    """Largest |x| an integer dtype can hold."""
    info = np.iinfo(dtype)
    return max(-int(info.min), int(info.max))


def data_magnitude(M) -> int:
    """Largest |x| in M (exact Python int: no overflow for int64's minimum)."""
    return max(-int(M.min()), int(M.max()))


def magnitude(M, limit: int) -> int:
    """An upper bound on |M|: the dtype's when that is within limit, else the data's."""
    bound = dtype_magnitude(M.dtype)
    return bound if bound <= limit else data_magnitude(M)


def operand_bounds(A, B) -> tuple[int, int]:
    """Upper bounds on |A| and |B| for exact mode's rule 2 k max|A| max|B| < p (C determined
    mod p): the dtypes' where they keep it, else the data's (a scan of both). The verifier,
    the client and the worker all test the rule with these."""
    k = A.shape[-1]
    bound_a, bound_b = dtype_magnitude(A.dtype), dtype_magnitude(B.dtype)
    if 2 * k * bound_a * bound_b >= P:
        bound_a, bound_b = data_magnitude(A), data_magnitude(B)
    return bound_a, bound_b


def rotate(x, shift):
    """x * 2^shift mod p for x in [0, p) (int64) and shift in [0, 61), an int or an integer
    array broadcasting against x: 2^61 = 1 mod p makes it a 61-bit rotation. In int64: the
    bits that x << shift pushes past bit 63 are dropped either way, and x >> (61 - shift)
    of x >= 0 shifts zeros in."""
    return ((x << shift) & P) | (x >> (61 - shift))


def add_mod(xp: ModuleType, a, b):
    total = a + b  # both in [0, p): no overflow below 2^62
    return xp.where(total >= P, total - P, total)


def digit_width(bound: int, inner: int, limit: int) -> int:
    """The widest w <= 60 with inner * bound * 2^(w-1) <= limit: every partial sum of a
    matrix row (|entries| <= bound) times a vector of signed w-bit digits (magnitude at most
    2^(w-1)) is then an integer of magnitude at most limit (2^53: exact in float64 in any
    order; 2^62: no int64 overflow)."""
    return min(60, (limit // (inner * max(bound, 1))).bit_length())


def signed_digits(xp: ModuleType, V, width: int):
    """(limbs, cols, inner) digits d_t of V (inner, cols) in [0, p) (int64),
    V^T = sum_t d_t 2^(width t), every |d_t| <= 2^(width-1): the unsigned digits of V + H,
    H = sum_{t < limbs-1} 2^(width-1) 2^(width t), less 2^(width-1) each but the top one
    (which stays at most 2^(61 - width (limbs-1)) <= 2^(width-1), as width * limbs >= 62 for
    width <= 60). inner is the last axis, so each operation runs along it (for one column,
    (inner, limbs, 1) took ~60 us per shift, one element per inner loop)."""
    limbs = -(-61 // width)
    half = 1 << (width - 1)
    offset = sum(half << (width * t) for t in range(limbs - 1))  # V + offset < 2^62
    shifts = xp.arange(limbs, dtype=np.int64)[:, None, None] * width
    centre = xp.asarray([half] * (limbs - 1) + [0], dtype=np.int64)[:, None, None]
    return (((V.T + offset)[None] >> shifts) & ((1 << width) - 1)) - centre


def matmul_mod_p(xp: ModuleType, M, V, bound: int, limit: int | None = None):
    """(M @ V) mod p in [0, p), exactly, for an integer matrix M with |M| <= bound and
    V in [0, p) (int64). limit (host only): a bound that M's entries are checked against
    instead of trusted; rows holding a larger entry get the value p, which no residue
    equals (a C with such an entry is not the product)."""
    if xp is np and M.ndim == 2 and _float64_digits(bound if limit is None else limit,
                                                    V.shape[0]):
        return host_mod_p(M, V, bound, limit)
    flags = None
    if limit is not None:
        bound, flags = limit, np.zeros(M.shape[0], bool)
    if bound >= SPLIT:
        M64 = M.astype(np.int64, copy=False)
        high = matmul_mod_p(xp, M64 >> 32, V, SPLIT // 2)
        low = matmul_mod_p(xp, M64 & (SPLIT - 1), V, SPLIT - 1)
        result = add_mod(xp, rotate(high, 32), low)
        if flags is not None:  # the halves are exact for any entries: mark the rows here
            result[((M > limit) | (M < -limit)).any(axis=1)] = P
        return result
    inner, cols = V.shape
    width, dtype = digit_width(bound, inner, 1 << 53), np.float64
    if width < 8:  # huge entries or inner dimensions: int64 (numpy's own loops) instead
        width, dtype = digit_width(bound, inner, 1 << 62), np.int64
    pieces = signed_digits(xp, V, width)  # (limbs, cols, inner)
    limbs = pieces.shape[0]
    W = xp.ascontiguousarray(pieces.reshape(limbs * cols, inner).T, dtype=dtype)
    over = None if flags is None else (limit, flags)
    sums, _ = products(xp, M, W, None, dtype, over)
    with np.errstate(invalid="ignore"):  # only a flagged row's sum can exceed int64
        residues = sums.astype(np.int64).reshape(-1, limbs, cols) % P
    shifts = xp.arange(limbs, dtype=np.int64)[:, None] * width
    result = _recombine(xp, residues, shifts, axis=1)
    if flags is not None:
        result[flags] = P
    return result


def stacked_mod_p(M: np.ndarray, V: np.ndarray, bound: int) -> np.ndarray:
    """(count, rows, cols) M_i V_i mod p for a host stack of integer matrices M (count, rows,
    inner) with |M| <= bound and _float64_digits(bound, inner), and V (count, inner, cols) in
    [0, p) (int64): the digits of matmul_mod_p's float64 path, all taken in one batched
    matmul, so a stack of small products costs no Python call per product."""
    count, inner, cols = V.shape
    width = digit_width(bound, inner, 1 << 53)
    digits = signed_digits(np, V.reshape(-1, cols).T, width)  # (limbs, count * inner, cols)
    limbs = digits.shape[0]
    D = np.moveaxis(digits.reshape(limbs, count, inner, cols), 0, 2)  # digit t: column t cols+j
    D = D.reshape(count, inner, limbs * cols).astype(np.float64)
    sums = np.matmul(M.astype(np.float64), D).astype(np.int64)  # each within 2^53: exact
    residues = sums + (P & (sums >> 63))  # |sum| < p: mod p adds p to a negative
    shifts = np.arange(limbs, dtype=np.int64)[:, None] * width
    return _recombine(np, residues.reshape(count, -1, limbs, cols), shifts, axis=2)


def _float64_digits(bound: int, inner: int) -> bool:
    """Whether entries up to bound take digits of at least 8 bits in float64."""
    return bound < SPLIT and digit_width(bound, inner, 1 << 53) >= 8


def _recombine(xp: ModuleType, residues, shifts, axis: int):
    """sum_t residues_t 2^shift_t mod p over the digit axis; every shift below 61."""
    terms = rotate(residues, shifts)  # (M d_t) 2^(w t) mod p, each in [0, p)
    high = (terms >> 32).sum(axis=axis)  # at most 31 terms: both sums stay below p
    low = (terms & (SPLIT - 1)).sum(axis=axis)
    return add_mod(xp, rotate(high, 32), low)


def host_mod_p(M: np.ndarray, V: np.ndarray, bound: int, limit: int | None = None
               ) -> np.ndarray:
    """(M @ V) mod p for a 2-D host matrix with |M| <= bound, or checked against limit:
    rows holding an entry above limit get p."""
    if exact_host is not None:
        return native_mod_p(M, V, bound, limit)
    return numpy_mod_p(M, V, bound, limit)


def native_mod_p(M: np.ndarray, V: np.ndarray, bound: int, limit: int | None = None
                 ) -> np.ndarray:
    """host_mod_p in one pass of exact_host.digit_sums: every digit column of V against
    each entry of M while it is in a register, and each row's largest |entry| found on the
    way (one digit width for all rows: finding it per block first would read M twice).
    A matrix it cannot read as it is (strided columns, another byte order, unaligned) is
    converted in row blocks of BLOCK_BYTES, so it is never copied whole."""
    inner, cols = V.shape
    width = digit_width(bound if limit is None else limit, inner, 1 << 53)
    W = signed_digits(np, V, width).reshape(-1, inner).astype(np.float64)
    check = limit is not None
    if (M.dtype.isnative and M.flags.aligned and M.strides[0] % M.itemsize == 0
            and (M.shape[1] <= 1 or M.strides[1] == M.itemsize)):
        sums, magnitudes = exact_host.digit_sums(M, W, check)
    else:  # a layout digit_sums cannot read: converted a row block at a time, never whole
        native = M.dtype.newbyteorder("=")
        step = max(1, BLOCK_BYTES // (inner * M.itemsize))
        parts = [exact_host.digit_sums(np.ascontiguousarray(M[i : i + step], native), W, check)
                 for i in range(0, M.shape[0], step)]
        sums = np.concatenate([part[0] for part in parts], axis=1)
        magnitudes = np.concatenate([part[1] for part in parts]) if check else None
    limbs = sums.shape[0] // cols
    result = _host_residues(sums.reshape(limbs, cols, -1),
                            np.arange(limbs)[:, None, None] * width)
    if limit is not None:
        result[magnitudes > limit] = P
    return result


def numpy_mod_p(M: np.ndarray, V: np.ndarray, bound: int, limit: int | None = None
                ) -> np.ndarray:
    """host_mod_p in numpy, one row block at a time: each block is converted
    to float64 once while it is in cache and taken against all its digit columns in one
    matmul call (a matrix-vector product each: OpenBLAS's skinny gemm is slower). Every
    partial sum stays within 2^53: exact in float64 in any order.

    With limit (C, checked against the product's bound rather than trusted up to its
    dtype's), each block's digit width comes from the block's own largest entry (int8
    products at k = 4096: 3 columns of 21 bits where the limit allows 4 of 16), and rows
    holding an entry above limit get p."""
    inner, cols = V.shape
    rows = M.shape[0]
    width = digit_width(bound if limit is None else limit, inner, 1 << 53)
    most = -(-61 // width)  # digits at the narrowest width
    sums = np.zeros((most * cols, 1, rows))  # row t cols + j: digit t of column j of V
    widths = np.full(rows, width)
    flags = np.zeros(rows, bool)
    digits = {}  # width -> (limbs * cols, 1, inner) float64, one digit column each
    step = max(1, BLOCK_BYTES // (inner * 8))
    buf = np.empty((min(step, rows), inner))
    for i in range(0, rows, step):
        blk = M[i : i + step]
        end = i + blk.shape[0]
        out = buf[: end - i]
        np.copyto(out, blk, casting="unsafe")  # first: the read from memory overlaps it
        if limit is not None:
            top = max(int(blk.max()), -int(blk.min()))
            if top > limit:
                flags[i:end] = ((blk > limit) | (blk < -limit)).any(axis=1)
            width = digit_width(min(top, limit), inner, 1 << 53)
            widths[i:end] = width
        W = digits.get(width)
        if W is None:
            pieces = signed_digits(np, V, width).reshape(-1, 1, inner)
            W = digits[width] = pieces.astype(np.float64)
        np.matmul(W, out.T, out=sums[: W.shape[0], :, i:end])
    # digit t of a row is shifted by t * width (below 61); digits a row does not have are 0
    shifts = np.minimum(np.arange(most)[:, None] * widths, 60)[:, None, :]
    result = _host_residues(sums.reshape(most, cols, rows), shifts)
    result[flags] = P
    return result


def _host_residues(sums: np.ndarray, shifts) -> np.ndarray:
    """(rows, cols) sum_t sums_t 2^shift_t mod p from float64 digit sums (digits, cols,
    rows), each an integer within 2^53 (a flagged row's may be anything: overwritten)."""
    with np.errstate(invalid="ignore"):  # only a flagged row's sum can exceed int64
        sums = sums.astype(np.int64)
    residues = sums + (P & (sums >> 63))  # |sum| <= 2^53 < p: mod p adds p to a negative
    return _recombine(np, residues, shifts, axis=0).T.copy()


def check(xp: ModuleType, A, B, C, R, bound_a: int, bound_b: int, bound_c: int,
          product_bound: int) -> tuple[int, int]:
    """(number of rows of C where C R != A (B R) mod p for some column of R or C holds an
    entry above product_bound, the first). On the host C's entries are checked against
    product_bound when it is below bound_c (fewer digits: for an int32 C of int8 operands
    at k = n = 4096, 4 rather than 6, and 3 in blocks whose entries stay below 2^21)."""
    X = matmul_mod_p(xp, B, R, bound_b)
    Y = matmul_mod_p(xp, A, X, bound_a)
    Z = matmul_mod_p(xp, C, R, bound_c, _c_limit(xp, bound_c, product_bound))
    wrong = (Y != Z).any(axis=1)
    return int(wrong.sum()), int(wrong.argmax())


def wrong_rows_stacked(A: np.ndarray, B: np.ndarray, C: np.ndarray, R: np.ndarray,
                       bound_a: int, bound_b: int, bound_c: int,
                       product_bound: int) -> np.ndarray:
    """`check` for a host stack of products, A (count, m, k), B (count, k, n), C (count, m,
    n) with _float64_digits(bound_a, k): the (count, m) rows that differ mod p or hold an
    entry above product_bound, from three calls for the whole stack."""
    count, k, n = B.shape
    X = matmul_mod_p(np, B.reshape(-1, n), R, bound_b).reshape(count, k, -1)
    Y = stacked_mod_p(A, X, bound_a)
    Z = matmul_mod_p(np, C.reshape(-1, n), R, bound_c, _c_limit(np, bound_c, product_bound))
    return (Y != Z.reshape(Y.shape)).any(axis=2)


def _c_limit(xp: ModuleType, bound_c: int, product_bound: int) -> int | None:
    """What C's entries are checked against, rather than trusted up to bound_c: the
    product's bound, on the host, where it is the smaller."""
    return product_bound if xp is np and product_bound < bound_c else None
