"""The verdict of one Freivalds check."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerifyResult:
    """What a check found.

    passed: every row of every round was within its bound (exact mode: equal mod p).
    worst_excess: float modes, max over rows and rounds of |C r - A (B r)| - bound
        (<= 0 when passed, inf for NaN/Inf); exact mode, the number of mismatching rows.
    rounds: random vectors used.
    false_accept_bound: probability that a wrong result passes; exact mode p^-rounds for
        any wrong C, float modes 2^-rounds for any C with an entry above twice its row's bound.
    reason: "ok" or what failed, naming the matrix, batch index and row.
    """

    passed: bool
    worst_excess: float
    rounds: int
    false_accept_bound: float
    reason: str
