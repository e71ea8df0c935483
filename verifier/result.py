"""The verdict of one Freivalds check."""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache


@dataclass(frozen=True)
class VerifyResult:
    """What a check found.

    passed: every row of every round was within its bound (exact mode: equal mod p).
    worst_excess: float modes, max over rows and rounds of |C r - A (B r)| - bound
        (<= 0 when passed, inf for NaN/Inf); exact mode, the number of mismatching rows.
    rounds: random vectors used.
    false_accept_bound: probability that a wrong result passes; exact mode p^-rounds for
        any wrong C, float modes 2^-rounds for any C with an entry above twice its row's bound
        (the least float64 at or above it: never below what it bounds).
    reason: "ok" or what failed, naming the matrix, batch index and row.
    """

    passed: bool
    worst_excess: float
    rounds: int
    false_accept_bound: float
    reason: str



@lru_cache(maxsize=256)
def false_accept_bound(chances: int, rounds: int) -> float:
    """chances^-rounds as the least float64 at or above it: the nearest float to p^-1 is
    2^-61, below it, which a bound must not be, and past p^-17 it would be 0. Cached: the
    float checks on a GPU ask for it on every call."""
    probability = Fraction(1, chances**rounds)
    nearest = float(probability)
    return nearest if Fraction(nearest) >= probability else math.nextafter(nearest, math.inf)
