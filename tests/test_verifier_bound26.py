"""The false-accept bound a result reports is never below the probability it bounds, and
exact mode's failure message names the bounds it used."""
import math
from fractions import Fraction

import numpy as np
import pytest

from verifier import verify
from verifier.rng import P

SEED = b"bound26" * 4


def honest_exact(rng, m=5, k=7, n=4):
    A = rng.integers(-100, 100, (m, k)).astype(np.int8)
    B = rng.integers(-100, 100, (k, n)).astype(np.int8)
    return A, B, A.astype(np.int64) @ B.astype(np.int64)


@pytest.mark.parametrize("rounds", [1, 2, 3, 17, 24])
def test_exact_bound_is_the_least_float_at_or_above_p_to_the_minus_rounds(rounds):
    """One round: the nearest float to 1/(2^61 - 1) is 2^-61, below it; rounds past float64's
    range (24: p^-24 < 2^-1074) must not round to 0 either."""
    A, B, C = honest_exact(np.random.default_rng(rounds))
    bound = verify(A, B, C, precision="exact", rounds=rounds, seed=SEED).false_accept_bound
    exact = Fraction(1, P**rounds)
    assert Fraction(bound) >= exact > 0
    assert Fraction(math.nextafter(bound, 0.0)) < exact  # and not looser than one float step


@pytest.mark.parametrize("rounds", [1, 40, 64])
def test_float_bound_is_two_to_the_minus_rounds(rounds):
    rng = np.random.default_rng(0)
    A = rng.standard_normal((4, 6)).astype(np.float32)
    B = rng.standard_normal((6, 3)).astype(np.float32)
    bound = verify(A, B, A @ B, precision="fp32", rounds=rounds, seed=SEED).false_accept_bound
    assert Fraction(bound) >= Fraction(1, 2**rounds) > 0
    assert Fraction(math.nextafter(bound, 0.0)) < Fraction(1, 2**rounds)


def test_exact_too_large_entry_message_names_the_bounds_used():
    """int8 operands: the dtypes' bounds (128), not the data's largest entries (99), give the
    product's bound; the message says which numbers it multiplied."""
    A, B, C = honest_exact(np.random.default_rng(1))
    C[2, 1] = P  # equal mod p to 0 + P: only the bound tells it from a product
    result = verify(A, B, C, precision="exact", seed=SEED)
    assert not result.passed and result.worst_excess == 1
    assert f"k * |A| * |B| <= 7 * 128 * 128 = {7 * 128 * 128}:" in result.reason
    assert result.reason.endswith("(first row 2)")
