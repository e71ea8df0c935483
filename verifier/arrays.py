"""Where the arrays live (numpy, or CuPy for data already on a GPU) and the one pass per
matrix that the check makes over it."""
from __future__ import annotations

from types import ModuleType

import numpy as np

BLOCK_BYTES = 1 << 20  # a row block in the evaluation dtype, kept in cache while it is used
NARROW = 6  # up to this many columns of W, one matrix-vector product each beats a skinny gemm


def module_of(*arrays) -> ModuleType:
    """numpy for host data, cupy for device data; mixing the two is an error."""
    on_gpu = [hasattr(x, "__cuda_array_interface__") for x in arrays]
    if not any(on_gpu):
        return np
    if not all(on_gpu):
        raise TypeError("A, B and C must all be on the host or all on the GPU")
    try:
        import cupy  # imported lazily: only device data needs it
    except ImportError as err:
        raise ImportError("A, B and C are device arrays (__cuda_array_interface__); checking "
                          "them needs CuPy, which is not installed") from err
    return cupy


def as_array(xp: ModuleType, x, name: str):
    """The input itself when it already is an array of xp (never a copy). A host subclass
    (a masked array, np.matrix) is viewed as a plain ndarray, also without a copy: its
    reductions and operators (a mask hiding NaN or huge entries from max and isfinite)
    would otherwise change the verdict, and the data is what is checked."""
    if isinstance(x, xp.ndarray):
        return x if xp is not np or type(x) is np.ndarray else np.asarray(x)
    try:
        array = xp.asarray(x)
    except Exception as err:
        raise TypeError(f"{name} is not an array: {err}") from err
    if array.dtype.kind in "OSUV":  # None, a str, a dict, nested lists of huge ints
        raise TypeError(f"{name} is not a numeric array: got {type(x).__name__} "
                        f"(converts to dtype {array.dtype})")
    return array


def products(xp: ModuleType, M, W, v, dtype, over: tuple[int, np.ndarray] | None = None):
    """(M @ W, |M| @ v) evaluated in dtype, reading M once; v may be None. M may carry
    leading batch dimensions (then W and v may too). over = (limit, flags), host matrices
    only: flags[i] is set for each row i of M holding an entry of magnitude above limit,
    found on the block while it is in cache (the product of such a row may be inexact).

    On the host M is taken in row blocks of BLOCK_BYTES in dtype, small enough to stay in
    cache, so M is read from memory once and the absolute value and any conversion to dtype
    never make a full-size copy of it. On a GPU a fused kernel does the same.
    """
    if M.ndim > 2:  # a stack of small matrices: whole-array operations beat a Python loop
        Mx = M.astype(dtype, copy=False)
        return Mx @ W, (None if v is None else (xp.abs(Mx) @ v[..., None])[..., 0])
    if xp is not np:
        from verifier.gpu import signed_and_abs

        if dtype == np.int64:  # int64 limbs: huge exact entries, rare
            return M.astype(dtype, copy=False) @ W, None
        return signed_and_abs(M, W, v, dtype)
    rows, cols = M.shape
    narrow = W.shape[1] <= NARROW
    signed = np.empty((W.shape[1], rows) if narrow else (rows, W.shape[1]), dtype)
    columns = np.ascontiguousarray(W.T) if narrow else None
    absolute = None if v is None else np.empty(rows, dtype)
    step = max(1, BLOCK_BYTES // (cols * np.dtype(dtype).itemsize))
    buf = np.empty((min(step, rows), cols), dtype)
    for i in range(0, rows, step):
        end = min(i + step, rows)
        blk, out = M[i:end], buf[: end - i]
        if over is not None and (blk.max() > over[0] or blk.min() < -over[0]):
            over[1][i:end] |= ((blk > over[0]) | (blk < -over[0])).any(axis=1)
        if blk.dtype != dtype:
            np.copyto(out, blk, casting="unsafe")  # callers keep values exact in dtype
            blk = out
        if narrow:
            for q, column in enumerate(columns):
                np.matmul(blk, column, out=signed[q, i:end])
        else:
            np.matmul(blk, W, out=signed[i:end])
        if v is not None:
            np.abs(blk, out=out)
            np.matmul(out, v, out=absolute[i:end])
    return (signed.T if narrow else signed), absolute
