"""Exact mode on host batches of small products: checked as a stack, a chunk of elements at
a time, rather than ~60 us of Python calls per element (the chain's precompile runs this
on every node for a few gas per element).

The stacked verdict must be the element loop's, field for field: the loop itself (forced
by a SMALL_ELEMENT of 0), verify() on each element alone with the same seed (so the same
vectors), and the rows where C != A @ B in Python integers."""
import re

import numpy as np
import pytest

import verifier.batch as batch_module
from verifier import exact, verify

SEED = b"stack-23".ljust(32, b"-")

# (A dtype, B dtype, C dtype, A batch, B batch, m, k, n, rounds, A magnitude, B magnitude);
# a magnitude None: the dtype's whole range
CASES = [
    ("int8", "int8", "int32", (4,), (4,), 1, 1, 1, 1, None, None),
    ("int8", "int16", "int64", (1,), (5, 3), 3, 4, 2, 2, None, None),  # A broadcast
    ("int16", "int8", "int32", (5, 3), (), 8, 9, 7, 3, None, None),  # B 2-D
    ("uint8", "uint16", "uint32", (2, 1, 3), (1, 4, 1), 2, 5, 3, 1, None, None),
    ("int32", "int32", "int64", (6,), (6,), 4, 4, 4, 2, 1 << 20, 1 << 10),  # data bounds
    ("int64", "int64", "int64", (7,), (1,), 1, 8, 1, 1, 1000, 1000),
    ("uint32", "int8", "int64", (3, 2), (3, 2), 2, 3, 2, 2, None, None),  # |A| < 2^32
    (">i2", "<i1", ">i8", (2, 3), (2, 3), 3, 2, 4, 2, None, None),  # another byte order
    ("int64", "int8", "int64", (4,), (4,), 2, 3, 2, 1, 1 << 40, None),  # A past float64
]


def operand(rng, dtype, shape, magnitude):
    info = np.iinfo(dtype)
    lo, hi = (info.min, info.max) if magnitude is None else (-magnitude, magnitude)
    return rng.integers(lo, hi, shape, dtype=np.dtype(dtype).newbyteorder("="),
                        endpoint=True).astype(dtype)


def product(A, B):
    """A @ B (batch dims broadcast) in Python integers."""
    return np.matmul(A.astype(object), B.astype(object))


def corrupt(rng, C, count):
    """C with `count` random entries changed: by a little, or to the largest magnitude
    (above k max|A| max|B| for these cases, within the P check) that C's dtype holds."""
    info = np.iinfo(C.dtype)
    values = C.astype(object)
    flat = values.reshape(-1)
    for position in rng.choice(flat.size, size=min(count, flat.size), replace=False):
        old = flat[position]
        if rng.random() < 0.3:
            new = min(info.max, 1 << 58) * (1 if info.min == 0 or rng.random() < 0.5 else -1)
        else:
            new = old + int(rng.integers(1, 4)) * (1 if rng.random() < 0.5 else -1)
        flat[position] = new if info.min <= new <= info.max and new != old else old ^ 1
    return values.astype(C.dtype)


def element_verdicts(A, B, C, rounds):
    """(total wrong rows, reason) from verify() on each element alone, in batch order."""
    batch = C.shape[:-2]
    A = np.broadcast_to(A, (*batch, *A.shape[-2:]))
    B = np.broadcast_to(B, (*batch, *B.shape[-2:]))
    total, first = 0, None
    for index in np.ndindex(*batch):
        alone = verify(A[index], B[index], C[index], precision="exact", rounds=rounds,
                       seed=SEED)
        total += int(alone.worst_excess)
        if not alone.passed and first is None:
            row = int(re.search(r"first row (\d+)", alone.reason).group(1))
            first = f"row {row} of batch element {tuple(int(i) for i in index)}"
    return total, ("ok" if first is None else f"{total} rows differ mod p, first {first}")


def loop_verdict(monkeypatch, A, B, C, rounds):
    with monkeypatch.context() as patch:
        patch.setattr(batch_module, "SMALL_ELEMENT", 0)
        return verify(A, B, C, precision="exact", rounds=rounds, seed=SEED)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_stacked_verdicts_equal_the_element_loop_and_integer_truth(monkeypatch, case):
    dtype_a, dtype_b, dtype_c, batch_a, batch_b, m, k, n, rounds, mag_a, mag_b = CASES[case]
    rng = np.random.default_rng(case)
    A = operand(rng, dtype_a, (*batch_a, m, k), mag_a)
    B = operand(rng, dtype_b, (*batch_b, k, n), mag_b)
    honest = product(A, B)
    C = honest.astype(dtype_c)
    assert (C.astype(object) == honest).all()  # the dtype holds the product
    for trial in range(4):
        if trial:
            C = corrupt(rng, honest.astype(dtype_c), count=int(rng.integers(1, 6)))
        result = verify(A, B, C, precision="exact", rounds=rounds, seed=SEED)
        assert result == loop_verdict(monkeypatch, A, B, C, rounds)
        total, reason = element_verdicts(A, B, C, rounds)
        assert (result.worst_excess, result.reason) == (total, reason)
        wrong_rows = int((C.astype(object) != honest).any(axis=-1).sum())
        assert result.worst_excess == wrong_rows and result.passed == (wrong_rows == 0)


def test_chunks_of_the_stack_give_the_whole_batch_verdict(monkeypatch):
    """Chunks of 7 elements over a batch of 23 (the last one short); wrong rows in the
    second, third and last chunks, none in the first."""
    rng = np.random.default_rng(23)
    m, k, n, rounds = 3, 4, 2, 2
    A = operand(rng, "int8", (23, m, k), None)
    B = operand(rng, "int16", (1, k, n), None)
    honest = product(A, B)
    C = honest.astype(np.int64)
    C[9, 2, 1] += 1
    C[16, 0, 0] = 1 << 58  # above the product's bound: its row is flagged
    C[16, 1, 1] -= 5
    C[22, 2, 0] += 3
    per_element = m * k + k * n + m * n + 16 * rounds * (m + k)
    monkeypatch.setattr(batch_module, "STACK_ENTRIES", 7 * per_element + 3)
    stacks = []
    real_stacked = exact.stacked_mod_p
    monkeypatch.setattr(exact, "stacked_mod_p", lambda M, V, bound: stacks.append(len(M))
                        or real_stacked(M, V, bound))
    result = verify(A, B, C, precision="exact", rounds=rounds, seed=SEED)
    assert stacks == [7, 7, 7, 2]
    assert not result.passed and result.worst_excess == 4
    assert result.reason == "4 rows differ mod p, first row 2 of batch element (9,)"
    assert result == loop_verdict(monkeypatch, A, B, C, rounds)
    assert element_verdicts(A, B, C, rounds) == (4, result.reason)


def test_a_batch_of_small_products_is_not_checked_element_by_element(monkeypatch):
    """1000 2x3x2 products: the loop makes 3000 matmul_mod_p calls (~60 us each whatever the
    size), the stack two for the whole batch."""
    rng = np.random.default_rng(1000)
    A = operand(rng, "int8", (1000, 2, 3), None)
    B = operand(rng, "int8", (1000, 3, 2), None)
    C = product(A, B).astype(np.int32)
    C[617, 1, 0] -= 1
    calls = []
    real = exact.matmul_mod_p
    monkeypatch.setattr(exact, "matmul_mod_p", lambda *args: calls.append(1) or real(*args))
    result = verify(A, B, C, precision="exact", seed=SEED)
    assert len(calls) <= 4
    assert result.worst_excess == 1
    assert result.reason == "1 rows differ mod p, first row 1 of batch element (617,)"
