"""Freivalds' check of matrix products: exact over the integers mod p = 2^61 - 1, and for
float32 results against a rigorous rounding-error bound per precision class."""
from verifier.batch import DEFAULT_ROUNDS, PRECISIONS, verify, verify_many
from verifier.result import VerifyResult
from verifier.rng import P

__all__ = ["DEFAULT_ROUNDS", "P", "PRECISIONS", "VerifyResult", "verify", "verify_many"]
