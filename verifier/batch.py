"""verify() and verify_many(): input checks, batch broadcasting, vectors, and the verdict."""
from __future__ import annotations

from collections.abc import Iterable
from itertools import product as index_product
from math import prod
from typing import NamedTuple

import numpy as np

from verifier import exact, floating, gpu_exact, gpu_float
from verifier.arrays import as_array, module_of
from verifier.result import VerifyResult, false_accept_bound
from verifier.rng import P, Signs, as_seed, derive_seed, field_vectors

PRECISIONS = ("fp32", "tf32", "bf16", "exact")
DEFAULT_ROUNDS = {"exact": 1, "fp32": 16, "tf32": 16, "bf16": 16}
MAX_ROUNDS = 64
MAX_DIM = 1 << 28  # keeps every exact limb at least 2 bits wide
MAX_DEVICE_PLANS = 64
SMALL_ELEMENT = 1 << 16  # mk + kn + mn up to this: a batch is checked as one stack
STACK_ENTRIES = 1 << 21  # operand entries and digit sums of one chunk of an exact stack
EXACT_INPUTS = "int8, int16, int32, int64, uint8, uint16, uint32"


def verify(A, B, C, *, precision: str = "fp32", rounds: int | None = None,
           seed: bytes | None = None) -> VerifyResult:
    """Check C == A @ B (shapes (..., m, k), (..., k, n), (..., m, n), batch dims broadcast
    like numpy.matmul) with Freivalds' algorithm; never modifies its inputs.

    precision: "exact" for integers (C must equal the integer product), or the class the
    float32 result was computed in: "fp32", "tf32" or "bf16" inputs with float32 accumulation.
    seed: bytes from which the random vectors are derived, so that every node re-running
    the check reaches the same verdict; None draws a fresh one from os.urandom.
    """
    if type(precision) is str and (rounds is None or type(rounds) is int):
        plans = _DEVICE_EXACT if precision == "exact" else _DEVICE_FLOAT
        known = plans.get(_device_key(A, B, C, rounds, precision))
        if known is not None:  # (a non-empty bytes seed is as_seed's answer already)
            return known.verify(A, B, C, seed if type(seed) is bytes and seed else as_seed(seed))
    rounds = _rounds(_precision(precision), rounds)
    seed = as_seed(seed)
    xp = module_of(A, B, C)
    A, B, C = (as_array(xp, x, name) for x, name in ((A, "A"), (B, "B"), (C, "C")))
    batch, m, k, n = _shapes(A, B, C)
    if precision == "exact":
        return _verify_exact(xp, A, B, C, batch, k, n, rounds, seed)
    return _verify_float(xp, A, B, C, batch, k, n, rounds, seed, precision)


def verify_many(triples: Iterable, *, precision: str = "fp32", rounds: int | None = None,
                seed: bytes | None = None) -> list[VerifyResult]:
    """One result per (A, B, C) triple; triple i uses the child seed derive_seed(seed, i).
    A bad argument or triple raises naming the triple (an empty batch still checks the
    arguments, so a misspelt precision is not found only once work arrives)."""
    _rounds(_precision(precision), rounds)
    seed = as_seed(seed)
    results = []
    for i, triple in enumerate(triples):
        try:
            A, B, C = triple
        except (TypeError, ValueError) as err:
            raise TypeError(f"triple {i} must be (A, B, C): {err}") from None
        child = derive_seed(seed, i.to_bytes(8, "big"))
        try:
            results.append(verify(A, B, C, precision=precision, rounds=rounds, seed=child))
        except (TypeError, ValueError) as err:  # the plain type: a subclass's signature varies
            kind = ValueError if isinstance(err, ValueError) else TypeError
            raise kind(f"triple {i}: {err}") from err
    return results


def _precision(precision) -> str:
    """precision itself, if it names a class (a non-str, e.g. an array, is refused here
    rather than by a failed comparison or dict lookup further in)."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def _rounds(precision: str, rounds: int | None) -> int:
    if rounds is None:
        return DEFAULT_ROUNDS[precision]
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)):
        raise TypeError(f"rounds must be an int, got {type(rounds).__name__}")
    if not 1 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"rounds must be between 1 and {MAX_ROUNDS}, got {rounds}")
    return int(rounds)


def _shapes(A, B, C) -> tuple[tuple[int, ...], int, int, int]:
    for x, name in ((A, "A"), (B, "B"), (C, "C")):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions, got shape {x.shape}")
    (m, k), (k_b, n) = A.shape[-2:], B.shape[-2:]
    if k != k_b:
        raise ValueError(f"inner dimensions differ: A is {A.shape}, B is {B.shape}")
    try:
        batch = np.broadcast_shapes(A.shape[:-2], B.shape[:-2]) if A.ndim + B.ndim > 4 else ()
    except ValueError:
        raise ValueError(f"batch dimensions of A {A.shape} and B {B.shape} do not broadcast"
                         ) from None
    if C.shape != (*batch, m, n):
        raise ValueError(f"C has shape {C.shape}, but A {A.shape} @ B {B.shape} has shape "
                         f"{(*batch, m, n)}")
    if 0 in batch:  # an empty batch is refused like an empty matrix, not passed vacuously
        raise ValueError(f"batch dimensions must be at least 1, got A {A.shape}, B {B.shape}")
    if min(m, k, n) == 0 or max(m, k, n) > MAX_DIM:
        raise ValueError(f"matrix dimensions must be between 1 and {MAX_DIM}, got m={m}, "
                         f"k={k}, n={n}")
    return batch, m, k, n


def _elements(xp, A, B, C, batch):
    """(index, A_i, B_i, C_i) for every batch index, as views (no copies)."""
    if not batch:  # one product: no views (each costs microseconds for device arrays)
        yield (), A, B, C
        return
    A = xp.broadcast_to(A, (*batch, *A.shape[-2:]))
    B = xp.broadcast_to(B, (*batch, *B.shape[-2:]))
    for index in index_product(*(range(d) for d in batch)):
        yield index, A[index], B[index], C[index]


def _rows_of_one_product(xp, A, B, C, batch):
    """(A, B, C) of a host batch whose B is the same matrix for every element, as the 2-D
    product of all the elements' rows (views, never copies): the same B, vectors and
    per-row bounds, with B read once rather than once per element. None where B varies
    along the batch, or the rows of A or C are not evenly spaced in memory."""
    if xp is not np or not batch or any(d != 1 for d in B.shape[:-2]):
        return None
    rows = []
    for x in (np.broadcast_to(A, (*batch, *A.shape[-2:])), C):
        view = x.view()
        try:
            view.shape = (-1, x.shape[-1])  # refused where merging the axes needs a copy
        except AttributeError:
            return None
        rows.append(view)
    return rows[0], B.reshape(B.shape[-2:]), rows[1]


def _element_row(batch: tuple[int, ...], m: int, index: tuple[int, ...], row: int
                 ) -> tuple[tuple[int, ...], int]:
    """(batch index, row) of a wrong row; a row of _rows_of_one_product (index ()) is
    first split into its element and its row there."""
    if len(index) == len(batch):
        return index, row
    *index, row = (int(i) for i in np.unravel_index(row, (*batch, m)))
    return tuple(index), row


def _first_nonfinite_element(xp, A, B, C, batch: tuple[int, ...]) -> tuple[int, ...]:
    """The first batch index where A, B or C holds a NaN or Inf (operands broadcast)."""
    bad = xp.zeros(batch, dtype=bool)
    for M in (A, B, C):
        if M.ndim > 2:
            bad = bad | xp.broadcast_to(~xp.isfinite(M).all(axis=(-2, -1)), batch)
    return tuple(int(i) for i in np.unravel_index(int(xp.argmax(bad)), batch))


def _where(index: tuple[int, ...], row: int) -> str:
    return f"row {row}" + (f" of batch element {index}" if index else "")


def _verify_float(xp, A, B, C, batch, k, n, rounds, seed, precision,
                  device_plan: bool = True) -> VerifyResult:
    for x, name in ((A, "A"), (B, "B"), (C, "C")):
        if x.dtype.kind != "f" or x.dtype.itemsize != 4:  # either byte order: '>f4' too
            raise TypeError(f"{precision} mode takes float32 A, B and C; {name} is {x.dtype}")
    if k >= floating.MAX_INNER:
        raise ValueError(f"inner dimension k={k} too large for a float32 error bound "
                         f"(at most {floating.MAX_INNER - 1})")
    if (device_plan and xp is not np and not batch and floating.float32_possible(n, k)
            and gpu_float.supported(A, B, C)):
        terms = floating.bound_terms(n, k, precision, np.float32)
        known = DeviceFloat(gpu_float.plan_for(A, B, C, rounds, terms), precision, rounds)
        _remember_device(xp, A, B, C, precision, rounds, known)
        return known.verify(A, B, C, seed)
    signs = Signs(seed, n, rounds)
    small = A.shape[-2] * k + k * n + C.shape[-2] * n <= SMALL_ELEMENT
    shared = None if small else _rows_of_one_product(xp, A, B, C, batch)
    if shared is not None:
        parts = [((), *shared)]
    elif batch and small:
        parts = [((), xp.broadcast_to(A, (*batch, *A.shape[-2:])),
                  xp.broadcast_to(B, (*batch, *B.shape[-2:])), C)]  # one stacked check
    else:
        parts = _elements(xp, A, B, C, batch)
    worst, reason = -float("inf"), "ok"
    for index, a, b, c in parts:
        excess, where, bad = floating.check(xp, a, b, c, signs, precision)
        if bad is not None:
            if batch and not index:  # a stacked or shared check: find the element
                index = _first_nonfinite_element(xp, A, B, C, batch)
            worst, reason = excess, bad + (f" (batch element {index})" if index else "")
            break
        if excess > worst:
            worst = excess
            if excess > 0:
                index, row = _element_row(batch, A.shape[-2], index + where[:-1], where[-1])
                reason = f"{_where(index, row)} exceeds its rounding-error bound by {excess:.6g}"
    return _float_result(worst, rounds, reason)


def _float_result(worst: float, rounds: int, reason: str) -> VerifyResult:
    return VerifyResult(worst <= 0, worst, rounds, false_accept_bound(2, rounds), reason)


class DeviceExact(NamedTuple):
    """What verify() derived for one kind of device product whose dtypes alone bound it."""

    plan: gpu_exact.Plan
    passed: VerifyResult

    def verify(self, A, B, C, seed: bytes) -> VerifyResult:
        wrong, row = gpu_exact.check(self.plan, A, B, C, seed)
        if not wrong:
            return self.passed
        return VerifyResult(False, float(wrong), self.passed.rounds,
                            self.passed.false_accept_bound,
                            f"{wrong} rows differ mod p, first {_where((), row)}")


class DeviceFloat(NamedTuple):
    """What verify() derived for one kind of 2-D float32 device product: its plan (tau's
    terms included)."""

    plan: gpu_float.Plan
    precision: str
    rounds: int

    def verify(self, A, B, C, seed: bytes) -> VerifyResult:
        k, n = A.shape[1], B.shape[1]
        found = gpu_float.check(self.plan, A, B, C, Signs(seed, n, self.rounds).bits)
        if found is None:  # NaN/Inf or a float32 overflow: the general path tells which
            import cupy

            return _verify_float(cupy, A, B, C, (), k, n, self.rounds, seed, self.precision,
                                 device_plan=False)
        worst, row = found
        reason = ("ok" if worst <= 0
                  else f"{_where((), row)} exceeds its rounding-error bound by {worst:.6g}")
        return _float_result(worst, self.rounds, reason)


# (type, shapes, dtypes, strides, addresses mod 16, rounds, device, precision) of device
# products checked before -> their DeviceExact or DeviceFloat: a repeat call skips the
# input checks, bounds and plan lookup
_DEVICE_EXACT: dict[tuple, DeviceExact] = {}
_DEVICE_FLOAT: dict[tuple, DeviceFloat] = {}
_DEVICE_TYPES: dict[type, object] = {}  # array type -> its module's getDevice (cupy's)


def _device_key(A, B, C, rounds: int | None, precision: str = "exact") -> tuple | None:
    """The _DEVICE_EXACT or _DEVICE_FLOAT key of these inputs, None for anything but device
    arrays. The three addresses mod 16 are one int (each attribute read costs the host)."""
    array = type(A)
    current_device = _DEVICE_TYPES.get(array)
    if current_device is None or type(B) is not array or type(C) is not array:
        return None
    return (array, A.shape, B.shape, C.shape, A.dtype, B.dtype, C.dtype, A.strides,
            B.strides, C.strides,
            A.data.ptr & 15 | (B.data.ptr & 15) << 4 | (C.data.ptr & 15) << 8,
            DEFAULT_ROUNDS.get(precision) if rounds is None else rounds,
            current_device(), precision)


def _verify_exact(xp, A, B, C, batch, k, n, rounds, seed) -> VerifyResult:
    for x, name in ((A, "A"), (B, "B"), (C, "C")):
        if x.dtype.kind not in "iu" or x.dtype.itemsize > 4 and x.dtype.kind == "u":
            # uint64 in either byte order ('>u8' != np.uint64)
            raise TypeError(f"exact mode takes integer matrices ({EXACT_INPUTS}); "
                            f"{name} is {x.dtype}")
    bound_a, bound_b = exact.operand_bounds(A, B)
    product_bound = k * bound_a * bound_b
    if 2 * product_bound >= P:
        raise ValueError(f"exact mode needs k * max|A| * max|B| < (2^61 - 1) / 2 so that C is "
                         f"determined mod p; here it is {product_bound}")
    bound_c = exact.magnitude(C, P - product_bound - 1)
    bound = false_accept_bound(P, rounds)
    if bound_c + product_bound >= P:  # then bound_c > product_bound: C cannot be the product
        too_large = ((C > product_bound) | (C < -product_bound)).reshape(-1, n).any(axis=1)
        *index, row = (int(i) for i in np.unravel_index(int(too_large.argmax()),
                                                         (*batch, C.shape[-2])))
        return VerifyResult(False, float(too_large.sum()), rounds, bound,
                            f"C has an entry of magnitude {bound_c}, above the largest the "
                            f"product can hold, k * |A| * |B| <= {k} * {bound_a} * {bound_b} = "
                            f"{product_bound}: not the integer product of A and B (first "
                            f"{_where(tuple(index), row)})")
    bounds, R = (bound_b, bound_c, bound_a), None
    mismatches, first = 0, None
    m = A.shape[-2]
    small = m * k + k * n + m * n <= SMALL_ELEMENT
    stacked = xp is np and batch and small and exact._float64_digits(bound_a, k)
    shared = None if small else _rows_of_one_product(xp, A, B, C, batch)
    if stacked:
        mismatches, first = _exact_stack(A, B, C, batch, field_vectors(seed, n, rounds),
                                         bound_a, bound_b, bound_c, product_bound)
    # element by element: device arrays, large elements, and A bounds past float64 digits
    one_by_one = (() if stacked else [((), *shared)] if shared is not None
                  else _elements(xp, A, B, C, batch))
    for index, a, b, c in one_by_one:
        if xp is not np and gpu_exact.supported(a, b, c, rounds, bounds):
            plan = gpu_exact.plan_for(a, b, c, rounds, bounds, product_bound)
            # the dtypes' magnitudes here mean no bound came from the data (one that did
            # and reached its dtype's would have failed above)
            if not batch and bounds == tuple(map(exact.dtype_magnitude, (B.dtype, C.dtype,
                                                                          A.dtype))):
                _remember_device(xp, A, B, C, "exact", rounds, DeviceExact(
                    plan, VerifyResult(True, 0.0, rounds, bound, "ok")))
            wrong, row = gpu_exact.check(plan, a, b, c, seed)
        else:
            if R is None:
                R = xp.asarray(field_vectors(seed, n, rounds))
            wrong, row = exact.check(xp, a, b, c, R, bound_a, bound_b, bound_c,
                                     product_bound)
        if wrong and first is None:
            first = _where(*_element_row(batch, m, index, row))
        mismatches += wrong
    reason = "ok" if first is None else f"{mismatches} rows differ mod p, first {first}"
    return VerifyResult(mismatches == 0, float(mismatches), rounds, bound, reason)


def _exact_stack(A, B, C, batch, R, bound_a: int, bound_b: int, bound_c: int,
                 product_bound: int) -> tuple[int, str | None]:
    """(wrong rows, where the first is) of a host batch of small products: exact.check's
    residues for every element, taken a chunk of elements at a time in a few whole-chunk
    calls. Element by element, the calls cost ~60 us each whatever the size, and a chain node
    checks any batch a client paid a few gas per element for."""
    (m, k), n, rounds = A.shape[-2:], B.shape[-1], R.shape[1]
    A, B = np.broadcast_to(A, (*batch, m, k)), np.broadcast_to(B, (*batch, k, n))
    total = prod(batch)
    step = max(1, STACK_ENTRIES // (m * k + k * n + m * n + 16 * rounds * (m + k)))
    mismatches, first = 0, None
    for start in range(0, total, step):  # fancy indexing copies a chunk, never all of A
        index = np.unravel_index(np.arange(start, min(start + step, total)), batch)
        wrong = exact.wrong_rows_stacked(A[index], B[index], C[index], R, bound_a, bound_b,
                                         bound_c, product_bound)  # (elements, rows)
        if first is None and wrong.any():
            element, row = divmod(int(wrong.argmax()), m)
            where = np.unravel_index(start + element, batch)
            first = _where(tuple(int(i) for i in where), row)
        mismatches += int(wrong.sum())
    return mismatches, first


def _remember_device(xp, A, B, C, precision: str, rounds: int,
                     known: DeviceExact | DeviceFloat) -> None:
    """Keep what a check derived from its inputs' kind for the next call with that kind."""
    _DEVICE_TYPES[type(A)] = xp.cuda.runtime.getDevice
    plans = _DEVICE_EXACT if precision == "exact" else _DEVICE_FLOAT
    if len(plans) >= MAX_DEVICE_PLANS:
        plans.clear()
    plans[_device_key(A, B, C, rounds, precision)] = known
