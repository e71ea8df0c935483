"""Random vectors for the check, derived from a seed so that every node derives the same ones.

Stream (v2; sign bits and child seeds): the SHAKE128 output (FIPS 202, an extendable-output
function) of DOMAIN || len(seed) as 8 bytes big-endian || seed || label; the label names the
vector kind and shape, so different checks never share a stream.

Field vectors (v3): independent 168-byte blocks, block b the SHAKE128 output of
FIELD_BLOCK_DOMAIN || key || b (8 bytes big-endian), key a 32-byte digest of the seed and
the label. Each block is one Keccak-f[1600] permutation of a 64-byte input, so a GPU derives
all blocks at once from the key (verifier/gpu_exact.py); a sequential squeeze cannot be split.
"""
from __future__ import annotations

import hashlib
import os
from functools import cached_property

import numpy as np

DOMAIN = b"needle-net/freivalds/v2"
# v3's two inputs differ at byte 23 (':' or '/'): no key input is ever a block input
FIELD_KEY_DOMAIN = b"needle-net/freivalds/v3:field-key"
FIELD_BLOCK_DOMAIN = b"needle-net/freivalds/v3/"  # 24 bytes: key and counter fill whole lanes
BLOCK_BYTES = 168  # SHAKE128's rate: one permutation's output
BLOCK_WORDS = BLOCK_BYTES // 8
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


def stream(seed: bytes, label: bytes, nbytes: int, domain: bytes = DOMAIN) -> bytes:
    """The first nbytes of the stream for (seed, label); a longer request extends a shorter
    one (an XOF's output is one infinite string)."""
    return hashlib.shake_128(domain + len(seed).to_bytes(8, "big") + seed + label).digest(nbytes)


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


def field_key(seed: bytes, n: int, rounds: int) -> bytes:
    """The 32 bytes every block of a field vector is derived from: SHAKE128 of
    FIELD_KEY_DOMAIN || len(seed) (8 bytes big-endian) || seed || field_label(n, rounds)."""
    return stream(seed, field_label(n, rounds), 32, FIELD_KEY_DOMAIN)


def field_blocks(key: bytes, first: int, count: int) -> bytes:
    """Blocks first .. first + count - 1 of a field vector's words, BLOCK_BYTES each: block b
    is SHAKE128(FIELD_BLOCK_DOMAIN || key || b as 8 bytes big-endian), 168 bytes."""
    prefix, shake = FIELD_BLOCK_DOMAIN + key, hashlib.shake_128
    return b"".join([shake(prefix + b.to_bytes(8, "big")).digest(BLOCK_BYTES)
                     for b in range(first, first + count)])


def field_vectors(seed: bytes, n: int, rounds: int) -> np.ndarray:
    """(n, rounds) int64 matrix uniform in Z_p: the words of blocks 0, 1, ... in order, each
    little-endian 8-byte word keeping its low 61 bits; the value p itself is rejected, so the
    accepted words are exactly uniform on [0, p). Entry (t % n, t // n) is the t-th accepted
    word."""
    key, need = field_key(seed, n, rounds), n * rounds
    accepted, blocks = np.empty(0, np.uint64), 0
    while accepted.size < need:  # a rejection has probability 2^-61: one pass nearly always
        count = -(-(need - accepted.size) // BLOCK_WORDS)
        words = np.frombuffer(field_blocks(key, blocks, count), "<u8") & np.uint64(P)
        accepted = np.concatenate([accepted, words[words != np.uint64(P)]])
        blocks += count
    return accepted[:need].astype(np.int64).reshape(rounds, n).T.copy()
