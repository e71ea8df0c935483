"""Session 25's adversarial review of the host verifier. No defect was found; these pin the
probes that came closest to one, against independent references (Python's integers, float64
products): NaN/Inf that only zero columns of A meet, rows repeated or reversed by strides on
both exact host loops, and exact wrong-row counts over several rounds in broadcast batches."""
from fractions import Fraction

import numpy as np
import pytest

from verifier import exact, verify

SEED = b"review-25".ljust(32, b"-")


@pytest.fixture(params=["compiled", "numpy"])
def host_loop(request, monkeypatch):
    """Exact mode's host loop under test (both must give the same verdicts)."""
    if request.param == "numpy" or exact.exact_host is None:
        monkeypatch.setattr(exact, "exact_host", None)
    return request.param


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_b_rows_that_meet_only_zero_columns_of_a_fail(value):
    """A B row whose entries every row of A multiplies by zero leaves A @ B finite when a
    product skips zeros; the verdict must still name B (its absolute row sums reach tau)."""
    rng = np.random.default_rng(25)
    A = rng.standard_normal((6, 5)).astype(np.float32)
    B = rng.standard_normal((5, 4)).astype(np.float32)
    A[:, 2] = 0
    honest = A @ B  # B's row 2 does not reach it
    B[2, 1] = value
    result = verify(A, B, honest, precision="fp32", rounds=2, seed=SEED)
    assert not result.passed and result.worst_excess == np.inf
    assert "B" in result.reason


def _python_product(A, B):
    columns = list(zip(*B, strict=True))
    return [[sum(int(a) * int(b) for a, b in zip(row, col, strict=True)) for col in columns]
            for row in A]


@pytest.mark.parametrize("layout", ["repeated rows", "reversed rows", "reversed columns"])
def test_strided_rows_on_both_host_loops_against_python_integers(host_loop, layout):
    rng = np.random.default_rng(5)
    base_a = rng.integers(-128, 128, (7, 9), dtype=np.int8)
    B = rng.integers(-2**15, 2**15, (9, 6), dtype=np.int16)
    if layout == "repeated rows":  # every row one row of memory: row stride 0
        A = np.broadcast_to(base_a[:1], base_a.shape)
    elif layout == "reversed rows":
        A = base_a[::-1]
    else:
        A, B = base_a[:, ::-1], B[::-1]
    C = np.array(_python_product(A, B), dtype=np.int64)
    C_view = C[::-1].copy()[::-1]  # same values, negative row stride
    assert verify(A, B, C_view, precision="exact", seed=SEED).passed
    wrong = C.copy()
    wrong[[1, 4], [0, 5]] += [1, 1 << 40]  # the second above the product bound
    result = verify(A, B, wrong[::-1].copy()[::-1], precision="exact", seed=SEED)
    assert not result.passed and result.worst_excess == 2.0
    assert result.reason.endswith("first row 1")


@pytest.mark.parametrize("rounds", [1, 3, 8])
def test_exact_wrong_row_counts_in_broadcast_batches_over_rounds(host_loop, rounds):
    """(2, 1) @ (1, 3) batches: the stacked path; each wrong row counted once however many
    rounds, and a result's fields match the rounds run."""
    rng = np.random.default_rng(rounds)
    A = rng.integers(-2**20, 2**20, (2, 1, 4, 5), dtype=np.int32)
    B = rng.integers(0, 256, (1, 3, 5, 6), dtype=np.uint8)
    C = np.matmul(A.astype(object), B.astype(object)).astype(np.int64)
    assert verify(A, B, C, precision="exact", rounds=rounds, seed=SEED).passed
    C[1, 2, 3, 0] += 1
    C[0, 1, 0, 5] -= 1 << 40
    result = verify(A, B, C, precision="exact", rounds=rounds, seed=SEED)
    assert (result.passed, result.worst_excess, result.rounds) == (False, 2.0, rounds)
    assert Fraction(result.false_accept_bound) >= Fraction(1, ((1 << 61) - 1) ** rounds)
    assert result.reason.endswith("first row 0 of batch element (0, 1)")
