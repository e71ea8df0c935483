"""Session 24's review of the host verifier: batches whose B is one matrix for every element
(a batched linear layer, (batch, m, k) @ (k, n), as the chain's precompile accepts it).

B is read once for the whole batch, not once per element; the verdicts, wrong-row counts and
rows named are those of each element checked alone (exact mode: identical; float modes: the
same per-row bound), in layouts that can and cannot be viewed as one product, and the inputs
are never written. References: verify() on each element alone and Python's integers."""
import re

import numpy as np
import pytest

from verifier import exact, floating, verify

F32 = np.float32
SEED = b"review-24".ljust(32, b"-")
M, K, N = 40, 200, 300  # mk + kn + mn above SMALL_ELEMENT: not a stack of small products


def snapshot(*arrays):
    return [(x.dtype.str, x.shape, x.strides, x.flags.writeable, x.tobytes()) for x in arrays]


def alone(A, B, C, precision, rounds):
    """(wrong rows, first 'row r of batch element e' or None) from verify() on each element
    by itself, in batch order (exact mode: the count of wrong rows; float: failed elements)."""
    batch = C.shape[:-2]
    A = np.broadcast_to(A, (*batch, *A.shape[-2:]))
    B = np.broadcast_to(B, (*batch, *B.shape[-2:]))
    total, first = 0, None
    for index in np.ndindex(*batch):
        result = verify(A[index], B[index], C[index], precision=precision, rounds=rounds,
                        seed=SEED)
        total += int(result.worst_excess) if precision == "exact" else not result.passed
        if not result.passed and first is None:
            row = int(re.search(r"row (\d+)", result.reason).group(1))
            first = f"row {row} of batch element {tuple(int(i) for i in index)}"
    return total, first


def count_b_passes(monkeypatch, precision):
    """A list that gets one entry per pass the check makes over a (K, N) matrix: B's."""
    passes = []
    if precision == "exact":
        real = exact.matmul_mod_p
        monkeypatch.setattr(exact, "matmul_mod_p", lambda xp, Mx, *rest: (
            passes.append(1) if Mx.shape == (K, N) else None) or real(xp, Mx, *rest))
    else:
        real = floating.products
        monkeypatch.setattr(floating, "products", lambda xp, Mx, *rest: (
            passes.append(1) if Mx.shape == (K, N) else None) or real(xp, Mx, *rest))
    return passes


def operands(rng, precision, batch_a, batch_b):
    if precision == "exact":
        A = rng.integers(-128, 128, (*batch_a, M, K)).astype(np.int8)
        B = rng.integers(-128, 128, (*batch_b, K, N)).astype(np.int8)
        return A, B, np.matmul(A.astype(np.int32), B.astype(np.int32))
    A = rng.standard_normal((*batch_a, M, K)).astype(F32)
    B = rng.standard_normal((*batch_b, K, N)).astype(F32)
    return A, B, np.matmul(A, B)


def corrupt(C, precision, places):
    """C with one entry changed in each (batch..., row, column) of places: by one (exact) or
    by 1e5, far above twice any row's bound here (bf16's is below 2000)."""
    wrong = C.copy()
    for place in places:
        wrong[place] += 1 if precision == "exact" else F32(1e5)
    return wrong


def named(reason):
    """The 'row r of batch element e' a failed verdict names."""
    return re.search(r"row \d+ of batch element \([\d, ]+\)", reason).group(0)


def where(place):
    return f"row {place[-2]} of batch element {place[:-2]}"


@pytest.mark.parametrize("precision", ["exact", "fp32"])
def test_a_shared_b_is_read_once_for_the_whole_batch(monkeypatch, precision):
    """12 elements of 40x200 @ 200x300 sharing B: the check made 12 passes over B (X = B R
    and |B| 1 once per element), 3 to 20 times the product's own time for (batch, 1, k)
    inputs; one pass now, and the same verdict as each element alone."""
    rng = np.random.default_rng(24)
    A, B, C = operands(rng, precision, (3, 4), ())
    places = [(1, 2, 7, 5), (2, 0, 39, 0), (1, 2, 8, 9)]
    wrong = corrupt(C, precision, places)
    passes = count_b_passes(monkeypatch, precision)
    result = verify(A, B, wrong, precision=precision, rounds=2, seed=SEED)
    assert len(passes) == 1
    monkeypatch.undo()
    total, first = alone(A, B, wrong, precision, 2)
    assert not result.passed and first == where(places[0])
    if precision == "exact":
        assert result.worst_excess == total == 3
        assert result.reason == f"3 rows differ mod p, first {first}"
    else:  # float modes name the row of the largest excess
        assert total == 2 and named(result.reason) in map(where, places)


LAYOUTS = {  # A, B, C of the batch -> the arrays given to verify()
    "contiguous": lambda A, B, C: (A, B, C),
    "B with leading ones": lambda A, B, C: (A, B[None, None], C),
    "rows evenly strided": lambda A, B, C: (np.repeat(A, 2, axis=-2)[..., ::2, :], B,
                                            np.repeat(C, 2, axis=-2)[..., ::2, :]),
    "elements apart (no single view)": lambda A, B, C: (np.repeat(A, 2, axis=0)[::2], B,
                                                        np.asfortranarray(C)),
    "big-endian": lambda A, B, C: tuple(x.astype(x.dtype.newbyteorder(">"))
                                        for x in (A, B, C)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision", ["exact", "fp32", "bf16"])
def test_shared_b_verdicts_equal_each_element_alone(layout, precision):
    """Honest batches pass; wrong rows are counted and the first one named as when each
    element is checked alone, whether or not the batch's rows can be viewed as one product;
    no input changes."""
    rng = np.random.default_rng(list(LAYOUTS).index(layout))
    A, B, C = operands(rng, precision, (3, 2), ())
    truth = np.matmul(A.astype(object), B.astype(object))
    for places in ([], [(2, 1, 0, 3)], [(0, 1, 39, 299), (2, 0, 5, 5), (2, 0, 6, 0)]):
        case = corrupt(C, precision, places)
        a, b, c = LAYOUTS[layout](A, B, case)
        for x in (a, b, c):
            x.flags.writeable = False
        before = snapshot(a, b, c)
        result = verify(a, b, c, precision=precision, rounds=2, seed=SEED)
        assert snapshot(a, b, c) == before
        total, first = alone(A, B, case, precision, 2)
        assert result.passed == (first is None) == (not places)
        if precision == "exact":
            assert result.worst_excess == total == int((case != truth).any(axis=-1).sum())
            assert result.reason == ("ok" if not places
                                     else f"{total} rows differ mod p, first {first}")
        elif places:
            assert named(result.reason) in map(where, places)
