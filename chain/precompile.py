"""The Freivalds precompile: verify a committed matmul result against its operands.

Input is the ABI encoding of (aId, bId, cId, batch, m, k, n, precision, rounds, seed);
output is one 32-byte word, the verdict. Gas is charged from the declared shapes
before any blob is read, so the cost is known in advance and O(rounds * n^2):

    gas = PRECOMPILE_BASE_GAS + PRECOMPILE_ELEMENT_GAS * (1 + rounds) * batch * (mk + kn + mn)

Every failure of the data is a verdict, never an exception: a node must not halt because
a blob is missing or malformed. A failure of this node (too little memory for the check) is
no verdict: it raises CheckUnavailable, so that the node's sealer drops the transaction and
a replay stops, where a FAIL would slash an honest worker on a small node alone.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
from eth.abc import ComputationAPI
from eth_abi import decode

from chain.blobs import BlobStore, decode_array, parse_header
from chain.params import PRECOMPILE_BASE_GAS, PRECOMPILE_ELEMENT_GAS

log = logging.getLogger(__name__)

FAIL, PASS, BAD_OPERANDS = 0, 1, 2
PRECISIONS = {0: "exact", 1: "fp32", 2: "tf32", 3: "bf16"}
INPUT_TYPES = ["bytes32", "bytes32", "bytes32", "uint64", "uint64", "uint64", "uint64",
               "uint8", "uint256", "bytes32"]
MAX_ROUNDS = 64


def check_gas(batch: int, m: int, k: int, n: int, rounds: int) -> int:
    """Gas for one check, from the declared shapes (documented in docs/protocol.md)."""
    elements = batch * (m * k + k * n + m * n)
    return PRECOMPILE_BASE_GAS + PRECOMPILE_ELEMENT_GAS * (1 + rounds) * elements


def _operand(store: BlobStore, id_: bytes, shapes: list[tuple], exact: bool) -> np.ndarray | None:
    """Load a blob and check it has one of the allowed shapes and a dtype fit for the class.
    Its header is checked first: gas is charged for the declared shapes, so a small job naming
    a huge blob must not make every node read all of it (the verdict is the same either way)."""
    head = store.head(id_)
    if head is None:
        return None
    try:
        dtype, shape, _ = parse_header(head)
    except ValueError:
        return None
    if shape not in shapes or exact != np.issubdtype(dtype, np.integer):
        return None
    data = store.get(id_)
    if data is None:
        return None
    try:
        array = decode_array(data)
    except ValueError:
        return None
    if not exact and not np.isfinite(array).all():
        return None
    return array


class CheckUnavailable(Exception):
    """This node could not run a check (out of memory): not a property of the result, so no
    verdict. Not a VMError: py-evm does not make it the call's outcome."""


def verdict(store: BlobStore, a_id: bytes, b_id: bytes, c_id: bytes, batch: int, m: int, k: int,
            n: int, precision: int, rounds: int, seed: bytes) -> int:
    """PASS if C = A @ B for every product in the batch, by Freivalds with this seed."""
    from verifier import verify

    if 0 in (batch, m, k, n):
        # an empty product, which the verifier refuses; refused before any blob is read, since
        # gas paid for batch * (mk + kn + mn) = 0 elements of a batch of 0 and a shared 2-D B
        # of any size would otherwise be read and decoded by every node for the base gas
        return BAD_OPERANDS
    exact = precision == 0
    single = [(batch, m, k)] + ([(m, k)] if batch == 1 else [])
    a = _operand(store, a_id, single, exact)
    b = _operand(store, b_id, [(batch, k, n), (k, n)], exact)
    if a is None or b is None:
        return BAD_OPERANDS
    # C has A @ B's own shape: 3-D if either operand is. A batch of 1 must not take the other
    # spelling, which the verifier refuses, making the worker's error the submitter's
    c = _operand(store, c_id, [(batch, m, n) if a.ndim == 3 or b.ndim == 3 else (m, n)], exact)
    if c is None:
        return FAIL
    try:
        result = verify(a, b, c, precision=PRECISIONS[precision], rounds=rounds, seed=seed)
    except (ValueError, TypeError):
        # shapes and dtypes were checked above: what is left is a job the verifier cannot
        # bound (float k >= 2^22, exact entries too large for p): the submitter's input
        return BAD_OPERANDS
    return PASS if result.passed else FAIL


def make_freivalds_precompile(store: BlobStore) -> Callable[[ComputationAPI], ComputationAPI]:
    """The precompile bound to this node's blob store."""

    def freivalds(computation: ComputationAPI) -> ComputationAPI:
        computation.consume_gas(PRECOMPILE_BASE_GAS, reason="Freivalds base")
        try:
            a_id, b_id, c_id, batch, m, k, n, precision, rounds, seed = decode(
                INPUT_TYPES, computation.msg.data_as_bytes
            )
        except Exception:
            computation.output = FAIL.to_bytes(32, "big")
            return computation
        if precision not in PRECISIONS or not 1 <= rounds <= MAX_ROUNDS:
            computation.output = FAIL.to_bytes(32, "big")
            return computation
        computation.consume_gas(
            check_gas(batch, m, k, n, rounds) - PRECOMPILE_BASE_GAS, reason="Freivalds check"
        )
        try:
            result = verdict(store, a_id, b_id, c_id, batch, m, k, n, precision, rounds, seed)
        except MemoryError as exc:
            raise CheckUnavailable(f"too little memory for a Freivalds check of batch {batch}, "
                                   f"{m}x{k} @ {k}x{n}") from exc
        except Exception:
            log.exception("Freivalds check raised; counted as a failed verification")
            result = FAIL
        computation.output = result.to_bytes(32, "big")
        return computation

    return freivalds
