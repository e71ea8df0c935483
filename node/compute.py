"""The worker's compute path: a job's matmul on the best device this machine has.

Float jobs run through needle's NDArray on `cuda`, else the C++ `cpu` backend,
else the numpy backend; integer (exact) jobs run through float BLAS in pieces
small enough that every partial sum is an exact integer (`exact_matmul`: 50-200x
faster than numpy's integer matmul, bench/exact_matmul.py). A job's operands are
(batch, m, k) and (batch, k, n) or a shared (k, n), or both 2-D when batch is 1
(docs/protocol.md).
"""

from __future__ import annotations

import os
import time

import numpy as np

from verifier.exact import data_magnitude, operand_bounds
from verifier.floating import MAX_INNER
from verifier.rng import P

FLOAT_DTYPES = (np.float32,)
EXACT_DTYPES = (np.int8, np.int16, np.int32, np.int64)


def _needle_devices() -> list:
    try:
        import needle as ndl
    except Exception:  # noqa: BLE001 - needle core may be absent or half-built
        return []
    devices = []
    for make in ("cuda", "cpu", "cpu_numpy"):
        try:
            device = getattr(ndl, make)()
            if device.enabled():
                devices.append(device)
        except Exception:  # noqa: BLE001 - a backend module that fails to import is skipped
            continue
    return devices


def best_device():
    """The needle device float jobs run on, or None to use plain numpy.

    `NEEDLE_NET_DEVICE` (cuda, cpu, numpy) forces a choice; one this machine lacks is a
    ValueError (it fell back to plain numpy silently: a GPU worker whose CUDA module failed
    to build ran on the CPU unsaid).
    """
    wanted = os.environ.get("NEEDLE_NET_DEVICE")
    devices = _needle_devices()
    for device in devices:
        name = getattr(device, "name", "")
        if wanted is None or name == wanted or (wanted == "numpy" and "numpy" in name):
            return device
    if wanted in (None, "numpy"):  # no needle at all: plain numpy is the numpy device
        return None
    have = ", ".join(getattr(d, "name", "?") for d in devices) or "plain numpy only"
    raise ValueError(f"NEEDLE_NET_DEVICE={wanted}: this machine has no such device "
                     f"(it has: {have}); use cuda, cpu or numpy, or unset it")


PROBE_SIZE = 512  # the start-up probe's product: PROBE_SIZE^3, float32
PROBE_BATCH = 256  # products of the start-up probe of a batch's per-product cost


def measure_throughput(device) -> float:
    """FLOP/s of one float32 product of PROBE_SIZE^3 on `device`, timed after a first call
    (which pays for loading and device set-up): what a worker assumes of its device before
    it has timed a job of its own. Larger products run faster: an estimate on the safe
    side."""
    x = np.ones((PROBE_SIZE, PROBE_SIZE), np.float32)
    matmul(x, x, device)
    t0 = time.perf_counter()
    matmul(x, x, device)
    return 2 * PROBE_SIZE**3 / max(time.perf_counter() - t0, 1e-9)


def measure_product_seconds(device) -> float:
    """Seconds each product of a batched float job costs on `device` beyond its FLOPs (such a
    job is computed product by product): PROBE_BATCH products of 8 x 8 matrices timed after
    a first call. A batch of many tiny products takes far longer than its FLOPs at the
    probe's rate say."""
    x = np.ones((PROBE_BATCH, 8, 8), np.float32)
    matmul(x, x, device)
    t0 = time.perf_counter()
    matmul(x, x, device)
    return (time.perf_counter() - t0) / PROBE_BATCH


def device_name(device) -> str:
    return "numpy" if device is None else str(getattr(device, "name", device))


def _matmul_2d(a: np.ndarray, b: np.ndarray, device) -> np.ndarray:
    if device is None:
        return a @ b
    import needle as ndl

    out = ndl.NDArray(a, device=device) @ ndl.NDArray(b, device=device)
    return out.numpy()


def matmul(a: np.ndarray, b: np.ndarray, device=None) -> np.ndarray:
    """C = A @ B for a job's operands (2-D or batched 3-D with equal batch; a 2-D A with a
    (1, k, n) B gives a (1, m, n) C)."""
    if a.ndim == 2 and b.ndim == 3 and b.shape[0] == 1:
        # a batch-1 job may name a 2-D A and a (1, k, n) B (the chain accepts both shapes):
        # C is (1, m, n), as numpy's matmul broadcasts it and the chain accepts
        a = a[np.newaxis]
    if a.ndim not in (2, 3) or b.ndim not in (2, a.ndim):
        raise ValueError(f"operands must be 2-D, or 3-D A with 3-D or 2-D B, got {a.shape} "
                         f"and {b.shape}")
    if a.shape[-1] != b.shape[-2] or (b.ndim == 3 and a.shape[0] != b.shape[0]):
        raise ValueError(f"matmul shapes do not match: {a.shape} @ {b.shape}")
    if a.dtype.type in EXACT_DTYPES and b.dtype.type in EXACT_DTYPES:  # mixed ones too, as
        return exact_matmul(a, b, device)  # the chain accepts them
    if a.dtype.type is not b.dtype.type:  # byte order aside: check_operands accepts either
        raise ValueError(f"operand dtypes differ: {a.dtype} and {b.dtype}")
    if a.dtype.type not in FLOAT_DTYPES:
        raise ValueError(f"unsupported operand dtype {a.dtype}")
    if a.ndim == 2:
        return _matmul_2d(a, b, device).astype(np.float32, copy=False)
    bs = b if b.ndim == 3 else [b] * len(a)
    return np.stack([_matmul_2d(x, y, device) for x, y in zip(a, bs, strict=True)])


FLOAT32_EXACT, FLOAT64_EXACT = 1 << 24, 1 << 53  # integers every float of the type holds
MIN_CHUNK = 256  # inner-dimension slices narrower than this cost more in calls than flops


def exact_matmul(a: np.ndarray, b: np.ndarray, device=None) -> np.ndarray:
    """A @ B of integer arrays as int64, equal to numpy's int64 matmul (wrapping mod 2^64
    where that overflows), through float BLAS. Each float product covers an inner slice of
    `chunk` terms with chunk * max|A piece| * max|B piece| within the float type's exact
    integers, so every partial sum, in any order, is exact. Operands too large for that are
    cut into signed limbs first; the pieces are recombined in wrapping 64-bit arithmetic.
    The float32 products run on a needle `cuda` device when given one (its default matmul
    is plain float32, never TF32); the float64 ones on the host."""
    k = a.shape[-1]
    shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    if k == 0 or 0 in shape:
        return np.zeros(shape, np.int64)
    bound_a, bound_b = data_magnitude(a), data_magnitude(b)
    if bound_a * bound_b * MIN_CHUNK <= FLOAT32_EXACT:  # int8-sized entries: float32 sgemm
        gpu = device if getattr(device, "name", "") == "cuda" else None
        return _chunked(a, b, np.float32, bound_a * bound_b, gpu)
    budget = (FLOAT64_EXACT // MIN_CHUNK).bit_length() - 1  # bits for both pieces together
    width_a, width_b = _limb_widths(bound_a.bit_length(), bound_b.bit_length(), budget)
    if width_a == width_b == 64:
        return _chunked(a, b, np.float64, bound_a * bound_b)
    total = np.zeros(shape, np.uint64)  # wrapping sums, as numpy's int64 matmul wraps
    for shift_a, piece_a, top_a in _limbs(a, width_a, bound_a):
        for shift_b, piece_b, top_b in _limbs(b, width_b, bound_b):
            part = _chunked(piece_a, piece_b, np.float64, top_a * top_b)
            total += part.view(np.uint64) << np.uint64(shift_a + shift_b)
    return total.view(np.int64)


def _limb_widths(bits_a: int, bits_b: int, budget: int) -> tuple[int, int]:
    """Limb widths for A and B (64: not cut) with |A limb| |B limb| < 2^budget and the
    fewest limb pairs."""
    if bits_a + bits_b <= budget:
        return 64, 64
    options = [(64, budget - bits_a), (budget - bits_b, 64), (budget // 2, budget - budget // 2)]

    def pairs(widths):
        return _count(bits_a, widths[0]) * _count(bits_b, widths[1])
    return min((w for w in options if min(w) > 0), key=pairs)


def _count(bits: int, width: int) -> int:
    return 1 if width >= bits else -(-bits // width)


def _limbs(x: np.ndarray, width: int, bound: int):
    """(shift, limb, bound on |limb|) with x = sum limb * 2^shift (|x| <= bound): unsigned
    width-bit low limbs and a signed top one; x itself when bound < 2^width."""
    rest, shift, mask = x, 0, (1 << width) - 1
    while bound > mask:
        rest = rest.astype(np.int64, copy=False)
        yield shift, rest & mask, mask
        rest, shift = rest >> width, shift + width
        bound = data_magnitude(rest)
    yield shift, rest, max(bound, 1)


def _chunked(a: np.ndarray, b: np.ndarray, dtype, bound: int, device=None) -> np.ndarray:
    """A @ B as int64 for |A| |B| <= bound, from products of inner slices short enough to be
    exact in dtype, summed in float64 while the whole sum is exact there, else in int64."""
    k = a.shape[-1]
    chunk = (FLOAT32_EXACT if dtype == np.float32 else FLOAT64_EXACT) // max(bound, 1)
    fa, fb = a.astype(dtype), b.astype(dtype)
    if device is not None:  # operands go up once; each slice's product comes back
        import needle as ndl

        fa, fb = ndl.NDArray(fa, device=device), ndl.NDArray(fb, device=device)
    if chunk >= k:
        return _result(fa @ fb).astype(np.int64)
    wide = np.float64 if k * bound <= FLOAT64_EXACT else np.int64
    total = None
    for start in range(0, k, chunk):
        inner = slice(start, start + chunk)
        part = _result(fa[(slice(None),) * (fa.ndim - 1) + (inner,)]
                       @ fb[(slice(None),) * (fb.ndim - 2) + (inner, slice(None))])
        if total is None:
            total = part.astype(wide)
        else:
            np.add(total, part if wide == np.float64 else part.astype(np.int64), out=total)
    return total.astype(np.int64, copy=False)


def _result(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.numpy()


class OperandError(ValueError):
    """A job's operands do not match its declaration: the chain cancels such a job at
    finalisation (fee refunded, nobody paid), so a worker skips it instead of computing."""


def check_operands(a: np.ndarray, b: np.ndarray, dims: tuple[int, int, int, int],
                   exact: bool) -> None:
    """OperandError unless A and B are what the job declares (`dims` = batch, m, k, n;
    `exact`: precision class 0): the shapes, an integer dtype for exact jobs and float32
    for the others, finite floats. The same rules as the chain's check (docs/protocol.md)."""
    batch, m, k, n = dims
    _check_shape("A", a, [(batch, m, k)] + ([(m, k)] if batch == 1 else []))
    _check_shape("B", b, [(batch, k, n), (k, n)])
    wanted = EXACT_DTYPES if exact else FLOAT_DTYPES
    for name, array in (("A", a), ("B", b)):
        if array.dtype.type not in wanted:
            raise OperandError(f"{name} is {array.dtype}, the job's precision class needs "
                               f"{'an integer type' if exact else 'float32'}")
        if not exact and not np.isfinite(array).all():
            raise OperandError(f"{name} holds NaN or Inf")
    # the verifier's bounds: beyond them the chain cancels the job at finalisation
    if not exact and k >= MAX_INNER:
        raise OperandError(f"k = {k} is too large for a float32 error bound (the verifier "
                           f"takes k < {MAX_INNER})")
    if exact:
        bound_a, bound_b = operand_bounds(a, b)
        if 2 * k * bound_a * bound_b >= P:
            raise OperandError(f"k * max|A| * max|B| = {k * bound_a * bound_b} is not below "
                               "(2^61 - 1) / 2, the bound the exact verifier needs")


def may_overflow(a: np.ndarray, b: np.ndarray, exact: bool) -> bool:
    """Whether a float job's product might exceed float32's range (k max|A| max|B| does):
    such a job is computed before it is claimed, to see whether it does."""
    if exact:
        return False
    def largest(x: np.ndarray) -> float:  # max |x| without an absolute-value copy
        return max(float(x.max(initial=0)), -float(x.min(initial=0)))

    return largest(a) * largest(b) * a.shape[-1] >= float(np.finfo(np.float32).max) / 2


def check_result(c: np.ndarray, exact: bool) -> None:
    """OperandError if a float job's C holds NaN or Inf: the product of finite operands
    overflowed float32, and the chain fails every such C (a 50 % stake slash), so it must
    never be committed."""
    if not exact and not np.isfinite(c).all():
        raise OperandError("A @ B overflows float32 (C would hold Inf or NaN, which the "
                           "chain's check fails): no result of this job can pass")


def _check_shape(name: str, array: np.ndarray, allowed: list[tuple[int, ...]]) -> None:
    if array.shape not in allowed:
        raise OperandError(f"{name} has shape {array.shape}, the job declares "
                           f"{' or '.join(map(str, allowed))}")


def corrupt(c: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A wrong result for the test-only cheating worker: every entry perturbed."""
    noise = rng.integers(1, 4, size=c.shape).astype(c.dtype)
    return c + noise
