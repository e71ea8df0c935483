"""Decoding signed transactions, in a second process for batches.

Decoding a raw transaction and recovering its sender (RLP, the signing hash, secp256k1
recovery) is ~0.4 ms of CPU; checking it against the head state is ~0.05 ms. The node's
process is busy sealing, so a batch of raw transactions (a JSON-RPC batch request) is decoded
in one worker process, which returns the transaction objects with their senders already
recovered (unpickling one is ~10 us); the state checks stay in ``Node.admit_decoded``. Small
batches are decoded in place: a round trip to the worker is not worth it for one or two.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from eth.abc import SignedTransactionAPI
from eth.constants import GAS_TX, SECPK1_N
from eth.vm.forks.prague.constants import STANDARD_TOKEN_COST, TOTAL_COST_FLOOR_PER_TOKEN
from eth.vm.forks.prague.transactions import PragueTransactionBuilder
from eth.vm.forks.shanghai.constants import INITCODE_WORD_COST, MAX_INITCODE_SIZE
from eth_utils import ValidationError

from chain.params import CHAIN_ID

log = logging.getLogger(__name__)

BLOB_TX_TYPE = 3
SET_CODE_TX_TYPE = 4
MIN_WORKER_BATCH = 16  # fewer raw transactions are decoded in the caller's process
# geth's txMaxSize: the largest legitimate ones (a 256-job submitJobs, EIP-3860's largest
# initcode) are under half of it; a pending transaction is held in memory, and without a
# limit one sender's 1024 future nonces could hold gigabytes (a body may be 64 MiB)
MAX_TX_BYTES = 128 * 1024


class TxRejected(ValueError):
    """A transaction refused at admission; the message says why."""


def validate_fee_caps(tx: SignedTransactionAPI) -> None:
    """EIP-1559: the tip offered per gas may not exceed the most the sender pays per gas.
    py-evm does not check it; the chain's VM does (``chain.vm.PoUWState``), and admission."""
    if tx.max_priority_fee_per_gas > tx.max_fee_per_gas:
        raise ValidationError(f"maxPriorityFeePerGas {tx.max_priority_fee_per_gas} is above "
                              f"maxFeePerGas {tx.max_fee_per_gas}")


def calldata_floor_gas(data: bytes) -> int:
    """EIP-7623's floor: the least gas a transaction with this calldata may be given (Prague
    makes one below it invalid). py-evm charges the floor but does not refuse such a
    transaction, so a block charged its sender more gas than its limit allowed."""
    zeros = data.count(0)
    tokens = zeros + (len(data) - zeros) * STANDARD_TOKEN_COST
    return GAS_TX + TOTAL_COST_FLOOR_PER_TOKEN * tokens


def creation_intrinsic_gas(tx: SignedTransactionAPI) -> int:
    """A contract creation's intrinsic gas with EIP-3860's initcode charge (2 gas per
    32-byte word), which Shanghai made part of it: py-evm charges it only once the initcode
    runs, so a creation given py-evm's intrinsic gas alone was mined as a failure that
    burned its gas, where the rule (and geth) refuses it."""
    return tx.intrinsic_gas + INITCODE_WORD_COST * ((len(tx.data) + 31) // 32)


def decode_transaction(raw: bytes) -> SignedTransactionAPI:
    """A signed transaction from its raw bytes, checked on its own (size, type, signature
    values, fee caps, chain id) with its sender recovered and cached; TxRejected says what
    is wrong."""
    if len(raw) > MAX_TX_BYTES:
        raise TxRejected(f"oversized transaction: {len(raw)} bytes, the limit is {MAX_TX_BYTES}")
    try:
        tx = PragueTransactionBuilder.decode(raw)
    except Exception as exc:
        raise TxRejected(f"transaction could not be decoded: {exc}") from exc
    if tx.type_id == BLOB_TX_TYPE:
        raise TxRejected("blob transactions (type 3) are not supported")
    if tx.type_id == SET_CODE_TX_TYPE:  # an account's code set by a signature: not offered
        raise TxRejected("set-code transactions (type 4, EIP-7702) are not supported")
    if tx.s > SECPK1_N // 2:  # its twin (n - s) signs the same: py-evm's VM refuses it (EIP-2)
        raise TxRejected("invalid signature: s is above secp256k1n/2 (EIP-2)")
    try:
        tx.validate()
        validate_fee_caps(tx)
    except ValidationError as exc:
        if tx.gas < tx.intrinsic_gas:  # py-evm's "Insufficient gas" (legacy and type 1 only;
            # the node checks every type): geth's words, as for the others
            raise TxRejected(f"intrinsic gas too low: {tx.gas} < {tx.intrinsic_gas}") from exc
        raise TxRejected(f"invalid transaction: {exc}") from exc
    if tx.chain_id is None:
        raise TxRejected("transaction is not replay-protected (EIP-155 chain id required)")
    if tx.chain_id != CHAIN_ID:
        raise TxRejected(f"invalid chain id {tx.chain_id}; this chain is {CHAIN_ID}")
    try:
        tx.sender  # noqa: B018  (recovers and caches the signer)
    except Exception as exc:
        raise TxRejected(f"invalid signature: {exc}") from exc
    return tx


def check_prague_limits(tx: SignedTransactionAPI) -> None:
    """Prague's validity rules on a transaction's gas and data that py-evm does not enforce:
    EIP-7623's calldata floor (py-evm mined a transaction below it and charged the floor,
    gasUsed above the gas limit the sender signed), EIP-3860's initcode limit and its
    initcode charge in the intrinsic gas (both mined as failures that burned all their
    gas). TxRejected says which; the node applies it to every transaction it admits
    (Node._admit)."""
    floor = calldata_floor_gas(tx.data)
    if tx.gas < floor:
        raise TxRejected(f"intrinsic gas too low: gas {tx.gas} is below the calldata floor "
                         f"{floor} (EIP-7623)")
    if not tx.to and len(tx.data) > MAX_INITCODE_SIZE:
        raise TxRejected(f"max initcode size exceeded: {len(tx.data)} bytes, the limit is "
                         f"{MAX_INITCODE_SIZE} (EIP-3860)")
    if not tx.to and tx.gas < (intrinsic := creation_intrinsic_gas(tx)):
        raise TxRejected(f"intrinsic gas too low: gas {tx.gas} is below the intrinsic gas "
                         f"{intrinsic} of a creation with {len(tx.data)} bytes of initcode "
                         "(EIP-3860)")


def decode_all(raws: list[bytes]) -> list[SignedTransactionAPI | TxRejected]:
    """Each raw transaction decoded, or the reason it was rejected."""
    decoded: list[SignedTransactionAPI | TxRejected] = []
    for raw in raws:
        try:
            decoded.append(decode_transaction(raw))
        except TxRejected as exc:
            decoded.append(exc)
    return decoded


def _exit_with(parent: int) -> None:
    """Worker side: end this process once its parent is gone (killed nodes leave none)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class BatchDecoder:
    """``decode_all`` in one worker process (spawned, not forked: the node runs threads),
    started at the first large batch; in place if the worker breaks."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def decode_all(self, raws: list[bytes]) -> list[SignedTransactionAPI | TxRejected]:
        if len(raws) < MIN_WORKER_BATCH:
            return decode_all(raws)
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_exit_with, initargs=(os.getpid(),))
        try:
            return self._pool.submit(decode_all, raws).result()
        except BrokenProcessPool:
            log.warning("transaction decoder process failed; decoding in place")
            return decode_all(raws)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
