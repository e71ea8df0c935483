"""Random vectors for the check, derived from a seed so that every node derives the same ones.

Stream: the SHAKE128 output (FIPS 202, an extendable-output function) of DOMAIN || len(seed)
as 8 bytes big-endian || seed || label; the label names the vector kind and shape, so
different checks never share a stream. One C call gives the whole stream (about 0.3 ms for
the 64 KiB of an 8192-long field vector, where SHA-256 in counter mode, one Python call per
32 bytes, took about 3 ms).
"""
from __future__ import annotations

import hashlib
import os
from functools import cached_property

import numpy as np

DOMAIN = b"needle-net/freivalds/v2"
P = (1 << 61) - 1  # the Mersenne prime of exact mode


def new_seed() -> bytes:
    """A fresh unpredictable seed, for checks that need not be reproduced elsewhere."""
    return os.urandom(32)


def as_seed(seed: bytes | bytearray | memoryview | None) -> bytes:
    if seed is None:
        return new_seed()
    if not isinstance(seed, (bytes, bytearray, memoryview)):
        raise TypeError(f"seed must be bytes (32 recommended) or None, got {type(seed).__name__}")
    seed = bytes(seed)
    if not seed:
        raise ValueError("seed must not be empty")
    return seed


def stream(seed: bytes, label: bytes, nbytes: int) -> bytes:
    """The first nbytes of the stream for (seed, label); a longer request extends a shorter
    one (an XOF's output is one infinite string)."""
    return hashlib.shake_128(DOMAIN + len(seed).to_bytes(8, "big") + seed + label).digest(nbytes)


def derive_seed(seed: bytes, label: bytes) -> bytes:
    """A 32-byte child seed, e.g. one per triple of a batch."""
    return stream(seed, b"child:" + label, 32)


class Signs:
    """The +-1 vectors of a float check: the stream's bits, which a GPU kernel expands
    itself, and (made on first use) the (n, rounds) float32 matrix R."""

    def __init__(self, seed: bytes, n: int, rounds: int) -> None:
        self.n, self.rounds = n, rounds
        label = b"sign:" + n.to_bytes(8, "big") + rounds.to_bytes(8, "big")
        self.bits = stream(seed, label, -(-n * rounds // 8))

    @cached_property
    def matrix(self) -> np.ndarray:
        """Bit t of the stream (most significant bit of each byte first) gives entry
        (t % n, t // n), 0 -> +1 and 1 -> -1."""
        bits = np.unpackbits(np.frombuffer(self.bits, np.uint8))[: self.n * self.rounds]
        signs = 1.0 - 2.0 * bits.astype(np.float32)
        return signs.reshape(self.rounds, self.n).T.copy()


def sign_vectors(seed: bytes, n: int, rounds: int) -> np.ndarray:
    """(n, rounds) float32 matrix of +-1: Signs(seed, n, rounds).matrix."""
    return Signs(seed, n, rounds).matrix


def field_label(n: int, rounds: int) -> bytes:
    return b"field:" + n.to_bytes(8, "big") + rounds.to_bytes(8, "big")


def field_vectors(seed: bytes, n: int, rounds: int) -> np.ndarray:
    """(n, rounds) int64 matrix uniform in Z_p: each little-endian 8-byte word of the stream
    keeps its low 61 bits; the value p itself is rejected, so the accepted words are exactly
    uniform on [0, p). Entry (t % n, t // n) is the t-th accepted word."""
    label = field_label(n, rounds)
    need, spare = n * rounds, 8
    while True:  # a rejection has probability 2^-61: the first request nearly always suffices
        words = np.frombuffer(stream(seed, label, 8 * (need + spare)), "<u8") & np.uint64(P)
        words = words[words != np.uint64(P)]
        if words.size >= need:
            return words[:need].astype(np.int64).reshape(rounds, n).T.copy()
        spare *= 2
