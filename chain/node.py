"""The chain node: admits signed transactions to a mempool and seals blocks.

One lock guards the py-evm chain, another the mempool: transactions are admitted (checked
against the head's state) while the next block is sealing. A producer thread seals a block
as soon as a transaction was admitted (``seal_on_pending``; under load it first keeps
gathering while more arrive, up to ``gather_s``; one waiting behind a nonce gap is left
pending) and at least every ``block_time`` seconds; each sealed block is flushed to sqlite
in one transaction.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eth.abc import SignedTransactionAPI
from eth.chains.base import Chain
from eth.db.atomic import AtomicDB
from eth.db.chain import ChainDB
from eth.exceptions import CanonicalHeadNotFound
from eth.vm.forks.london.headers import calculate_expected_base_fee_per_gas

from chain.admission import (
    BatchDecoder,
    TxRejected,
    check_prague_limits,
    decode_all,
    decode_transaction,
)
from chain.blobs import DEFAULT_MAX_BLOB_BYTES, BlobStore
from chain.consensus import verified_work, work_seal
from chain.db import DATABASE_FILE, DataDirError, SqliteDB, lock_data_dir, unreadable
from chain.genesis import genesis_params, genesis_state
from chain.journal import JOURNAL_FILE, PendingJournal
from chain.params import REWARD_POOL_ADDRESS
from chain.timeline import mark
from chain.vm import build_chain_class, with_fields

log = logging.getLogger(__name__)

MAX_FUTURE_NONCES = 1024
ADMISSION_POLL_S = 0.0005
PRIORITY_FEE = 10**9  # the tip eth_gasPrice and eth_maxPriorityFeePerGas suggest
RECENT_BLOCKS = 64  # sealed blocks kept with their receipts for the long polls, at most
# what a kept transaction with its receipt holds besides its calldata and its logs' data and
# topics (py-evm's objects, roughly): the recent blocks' bytes are counted with it
RECENT_TX_OVERHEAD = 1024


@dataclass
class NodeConfig:
    data_dir: Path
    block_time: float = 1.0
    seal_on_pending: bool = True
    max_block_txs: int = 5000
    # once transactions are pending, keep gathering while more keep arriving (at most
    # gather_s): a block's fixed cost (tries, persist, flush) is then shared by many.
    # A lone pending transaction (an idle node: a job's next step) is sealed as soon as no
    # other admission is in progress (a batch request's next transaction, say); gathering
    # starts from gather_min_txs pending, i.e. under load.
    gather_s: float = 0.25
    quiet_s: float = 0.02
    gather_min_txs: int = 2
    max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES
    blob_reserve_bytes: int | None = None  # free disk kept by blob uploads (BlobStore's default)
    # chain.interpreter's opcode loop and per-block storage tries; False: stock py-evm
    # (same blocks, see tests/test_chain_fast_evm.py; bench/chain_tps.py compares the two)
    fast_execution: bool = True
    # decode and recover the senders of batched raw transactions in a second process
    # (started at the first batch of chain.admission.MIN_WORKER_BATCH or more)
    decode_process: bool = True
    # pending transactions (or bytes of them) beyond which only ones the next block can take
    # are admitted: one behind a nonce gap costs nothing until mined, so senders could pile
    # them up unbounded (by bytes: 16384 of 128 KiB each held 2 GiB)
    max_pending: int = 1 << 14
    max_pending_bytes: int = 64 << 20
    # the recent blocks kept for the long polls (RECENT_BLOCKS), at most these bytes of them
    # (``recent_block_bytes``; the latest is always kept): 64 blocks of 128 KiB transactions
    # held gigabytes. Older blocks are read from the database (the long polls' clients then
    # ask eth_getTransactionReceipt and eth_getLogs)
    recent_bytes: int = 64 << 20


@dataclass
class Mempool:
    """Pending transactions by sender and nonce, and by hash in arrival order. Its own lock
    (not the chain's) guards it: admission goes on while a block is sealing."""

    by_sender: dict[bytes, dict[int, SignedTransactionAPI]] = field(default_factory=dict)
    by_hash: dict[bytes, SignedTransactionAPI] = field(default_factory=dict)
    committed: dict[bytes, int] = field(default_factory=dict)  # max cost of a sender's txs
    arrival: dict[bytes, int] = field(default_factory=dict)  # by hash: the order of admission
    size: int = 0  # bytes of the pending transactions, encoded
    lock: threading.RLock = field(default_factory=threading.RLock)
    _arrivals: itertools.count = field(default_factory=itertools.count)

    @staticmethod
    def max_cost(tx: SignedTransactionAPI) -> int:
        return tx.gas * tx.max_fee_per_gas + tx.value

    def add(self, tx: SignedTransactionAPI) -> None:
        with self.lock:
            self.by_sender.setdefault(tx.sender, {})[tx.nonce] = tx
            self.by_hash[tx.hash] = tx
            self.committed[tx.sender] = self.committed.get(tx.sender, 0) + self.max_cost(tx)
            self.arrival[tx.hash] = next(self._arrivals)
            self.size += len(tx.encode())

    def remove(self, tx: SignedTransactionAPI) -> None:
        with self.lock:
            if self.by_hash.pop(tx.hash, None) is None:
                return
            pending = self.by_sender[tx.sender]
            del pending[tx.nonce]
            self.committed[tx.sender] -= self.max_cost(tx)
            del self.arrival[tx.hash]
            self.size -= len(tx.encode())
            if not pending:
                del self.by_sender[tx.sender]
                del self.committed[tx.sender]

    def __len__(self) -> int:
        return len(self.by_hash)


def recent_block_bytes(block, receipts: list) -> int:
    """The memory a sealed block kept with its receipts takes, roughly: its transactions'
    calldata and their logs' data and topics, with RECENT_TX_OVERHEAD per transaction."""
    logs = sum(len(log.data) + 32 * len(log.topics) for receipt in receipts
               for log in receipt.logs)
    return logs + sum(len(tx.data) + RECENT_TX_OVERHEAD for tx in block.transactions)


def next_nonce(nonce: int, pending: dict[int, SignedTransactionAPI]) -> int:
    """The first nonce from `nonce` on that a sender's pending transactions leave free."""
    while nonce in pending:
        nonce += 1
    return nonce


class Node:
    """A single block-producing node over a data directory, which it locks until ``stop``
    (``chain.db.DataDirError`` if another node holds it)."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self._data_dir_lock = lock_data_dir(config.data_dir)
        try:
            self.blobs = BlobStore(config.data_dir / "blobs", config.max_blob_bytes,
                                   config.blob_reserve_bytes)
            if discarded := self.blobs.discard_partial_uploads():  # the data dir is ours alone
                log.info("discarded %d partial blob uploads left by an earlier run", discarded)
            self.db = SqliteDB(config.data_dir / DATABASE_FILE)
        except BaseException:
            self._data_dir_lock.close()
            raise
        try:
            self.chain: Chain = self._load_chain(
                build_chain_class(self.blobs, fast=config.fast_execution))
            self.journal = PendingJournal(config.data_dir)
        except BaseException:
            self.db.close()
            self._data_dir_lock.close()
            raise
        # lock order: the chain's lock, then the mempool's; admission takes only the latter
        self.lock = threading.RLock()
        self.mempool = Mempool()
        self._wake = threading.Condition(self.mempool.lock)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._view = None
        self._head = self.chain.get_canonical_head()
        self.decoder = BatchDecoder() if config.decode_process else None
        # called (on the producer thread) after every sealed block: the long polls' wake-up
        self.on_sealed: list[Callable[[], None]] = []
        # the latest sealed blocks with their receipts, by number: long polls answer from
        # them without taking the lock (the next block may be sealing meanwhile)
        self.recent: OrderedDict[int, tuple] = OrderedDict()
        self._recent_size = 0  # recent_block_bytes of the blocks in `recent`
        self.gas_price = self._gas_price(self._head)
        # a transaction was admitted since the last block took the pending ones (under the
        # mempool's lock): only then may the mempool hold one that block did not include (a
        # pending transaction behind a nonce gap must not make the producer seal empty
        # blocks back to back)
        self._admitted_since_seal = False
        self._admitting = 0  # admissions in progress (read by the producer)
        self._admissions = threading.Lock()
        self._readmit_journaled()

    def _load_chain(self, chain_class: type[Chain]) -> Chain:
        """The stored chain, or a new one from genesis in an empty database. A database sqlite
        cannot read, or one that holds data but no head, is a DataDirError naming the file:
        writing a genesis over it would silently reset the chain."""
        base_db = AtomicDB(self.db)
        try:
            ChainDB(base_db).get_canonical_head()
            return chain_class(base_db)
        except CanonicalHeadNotFound:
            pass
        except sqlite3.DatabaseError as exc:
            raise unreadable(self.db.path, exc) from None
        if self.db.holds_data():
            raise DataDirError(f"database {self.db.path} holds data but no chain head: it is "
                               "damaged or not a chain database")
        if earlier := self._earlier_run():
            raise DataDirError(f"database {self.db.path} is empty, but {earlier} of an earlier "
                               "run: the database was lost or truncated. Restore it, or start "
                               "a new chain in a new data dir")
        chain = chain_class.from_genesis(base_db, genesis_params(), genesis_state())
        self.db.flush()
        return chain

    def _earlier_run(self) -> str | None:
        """What in the data dir shows that a chain ran here before (a fresh one has neither):
        a genesis written beside it would replay its journal onto a new chain."""
        journal = self.config.data_dir / JOURNAL_FILE
        if journal.is_file() and journal.stat().st_size:
            return f"{journal} holds transactions"
        if any(not entry.name.startswith(".") for entry in self.blobs.directory.iterdir()):
            return f"{self.blobs.directory} holds blobs"
        return None

    def _readmit_journaled(self) -> None:
        """Admit again what the journal holds: what the last run acknowledged and did not
        seal, after a stop (behind a nonce gap) or a crash. Those sealed meanwhile are
        refused as nonce too low; any other refusal is logged. The journal is then compacted
        to the pool (the old file stays until the new one replaces it)."""
        raws = self.journal.read()
        readmitted = 0
        for raw in raws:
            try:
                self._admit(decode_transaction(raw), from_journal=True)
                readmitted += 1
            except TxRejected as exc:
                if not str(exc).startswith("nonce too low"):
                    log.warning("dropped a journaled transaction: %s", exc)
        if readmitted:
            log.info("admitted again %d transactions acknowledged by the last run and not "
                     "sealed", readmitted)
        if raws:
            self._compact_journal()

    def _compact_journal(self) -> None:
        """The journal rewritten to the pending transactions, in the order of admission
        (under the mempool's lock, so no append falls between). One that fails (disk full)
        leaves the old file whole, and appends go on to it."""
        with self.mempool.lock:
            try:
                self.journal.rewrite([tx.encode() for tx in self.mempool.by_hash.values()])
            except OSError as exc:
                log.warning("cannot compact the journal of pending transactions: %s", exc)

    # --- state ---------------------------------------------------------------------------------
    def head(self):
        return self._head

    def _admission_view(self):
        """(head, state, next base fee), rebuilt once per head: admission reads it many times.
        Under the mempool's lock only: the head's state is sealed and flushed, so reading it
        while the next block is sealing is safe (its trie nodes are content-addressed)."""
        head = self.head()
        if self._view is None or self._view[0] is not head:
            base_fee = calculate_expected_base_fee_per_gas(head)
            self._view = (head, self.state_at(head), base_fee)
        return self._view

    def state_at(self, header=None):
        return self.chain.get_vm(header or self.head()).state

    def pending_nonce(self, address: bytes) -> int:
        with self.mempool.lock:
            nonce = self._admission_view()[1].get_nonce(address)
            return next_nonce(nonce, self.mempool.by_sender.get(address, {}))

    def next_base_fee(self) -> int:
        with self.mempool.lock:
            return self._admission_view()[2]

    def _gas_price(self, head) -> int:
        """What eth_gasPrice answers on top of `head`: next base fee + the priority fee."""
        return calculate_expected_base_fee_per_gas(head) + PRIORITY_FEE

    # --- admission -----------------------------------------------------------------------------
    def admit(self, raw: bytes) -> bytes:
        """Validate a signed raw transaction against the head state and queue it."""
        with self._admissions:
            self._admitting += 1
        try:
            return self._admit(decode_transaction(raw))
        finally:
            with self._admissions:
                self._admitting -= 1

    def decode_many(self, raws: list[bytes]) -> list[SignedTransactionAPI | TxRejected]:
        """Raw transactions decoded (senders recovered), large batches in the decoder process;
        each then goes to ``admit_decoded``."""
        return self.decoder.decode_all(raws) if self.decoder else decode_all(raws)

    def admit_decoded(self, tx: SignedTransactionAPI) -> bytes:
        """``admit`` for a transaction ``decode_many`` decoded."""
        with self._admissions:
            self._admitting += 1
        try:
            return self._admit(tx)
        finally:
            with self._admissions:
                self._admitting -= 1

    def _admit(self, tx: SignedTransactionAPI, from_journal: bool = False) -> bytes:
        """Checked against the head and the pending transactions under the mempool's lock;
        a block being sealed meanwhile moves both together (``_set_head``); journaled before
        its hash is answered. `from_journal`: admitted by an earlier run, so already in the
        journal, and a max fee under the next base fee is admitted, to wait for a cheaper
        block (as ``_select`` keeps one the base fee overtook)."""
        with self.mempool.lock:
            if tx.hash in self.mempool.by_hash:
                raise TxRejected(f"already known: transaction 0x{tx.hash.hex()} is pending")
            head, state, base_fee = self._admission_view()
            nonce = state.get_nonce(tx.sender)
            if tx.nonce < nonce:
                raise TxRejected(f"nonce too low: next nonce of 0x{tx.sender.hex()} is {nonce}, "
                                 f"transaction has {tx.nonce}")
            if tx.nonce > nonce + MAX_FUTURE_NONCES:
                raise TxRejected(f"nonce too high: next nonce is {nonce}, "
                                 f"transaction has {tx.nonce}")
            pending = self.mempool.by_sender.get(tx.sender, {})
            if tx.nonce in pending:
                raise TxRejected(f"nonce {tx.nonce} already used by a pending transaction "
                                 "(replacement is not supported)")
            if self._pool_full(tx):
                executable = next_nonce(nonce, pending)
                if tx.nonce != executable:
                    raise TxRejected(f"transaction pool is full ({len(self.mempool)} pending, "
                                     f"{self.mempool.size} bytes): only the sender's next "
                                     f"nonce {executable} is admitted, not {tx.nonce}")
            if tx.gas > head.gas_limit:
                raise TxRejected(f"gas {tx.gas} exceeds the block gas limit {head.gas_limit}")
            if tx.gas < tx.intrinsic_gas:
                raise TxRejected(f"intrinsic gas too low: {tx.gas} < {tx.intrinsic_gas}")
            check_prague_limits(tx)
            if tx.max_fee_per_gas < base_fee and not from_journal:
                raise TxRejected(f"max fee per gas {tx.max_fee_per_gas} is below the base fee "
                                 f"{base_fee}")
            committed = self.mempool.committed.get(tx.sender, 0)
            cost = Mempool.max_cost(tx)
            balance = state.get_balance(tx.sender)
            if balance < committed + cost:
                raise TxRejected(f"insufficient funds: balance {balance} (with {committed} "
                                 f"committed to pending transactions) < cost {cost}")
            if not from_journal:
                self._journal(tx)
            self.mempool.add(tx)
            mark("node admitted")
            self._admitted_since_seal = True
            if self.config.seal_on_pending:
                self._wake.notify()
        return tx.hash

    def _journal(self, tx: SignedTransactionAPI) -> None:
        """Append `tx` to the journal; a node that cannot (disk full) refuses it rather than
        answer a hash a crash would lose."""
        try:
            self.journal.append(tx.encode())
        except OSError as exc:
            log.error("cannot journal a transaction: %s", exc)
            raise TxRejected(f"the node cannot journal the transaction: {exc.strerror or exc}; "
                             "try again later") from None

    def _pool_full(self, tx: SignedTransactionAPI) -> bool:
        """Whether the pool, with `tx`, holds more than its bounds (count and bytes)."""
        return len(self.mempool) >= self.config.max_pending or \
            self.mempool.size + len(tx.encode()) > self.config.max_pending_bytes

    # --- block production ----------------------------------------------------------------------
    def _select(self, head_state, base_fee: int) -> list[SignedTransactionAPI]:
        """Pending transactions with consecutive nonces from each sender's next, in the order
        they were admitted (a sender's nonces in order). Taken sender by sender, one sender's
        queue filled every block while it kept topping it up, and kept out for ever what
        others had sent before its later transactions. One whose max fee the block's
        `base_fee` overtook stays pending with its sender's later ones, as in geth, until the
        base fee falls: before, the block dropped it, its sender's long poll saw it leave the pool
        without a receipt, and the later nonces waited behind the gap for ever."""
        selected: list[SignedTransactionAPI] = []
        with self.mempool.lock:
            self._admitted_since_seal = False
            heads = []
            for sender, pending in list(self.mempool.by_sender.items()):
                nonce = head_state.get_nonce(sender)
                for stale in [n for n in pending if n < nonce]:
                    self.mempool.remove(pending[stale])
                if nonce in pending and pending[nonce].max_fee_per_gas >= base_fee:
                    heads.append(self._place(pending[nonce]))
            heapq.heapify(heads)
            while heads and len(selected) < self.config.max_block_txs:
                tx = heapq.heappop(heads)[-1]
                selected.append(tx)
                following = self.mempool.by_sender[tx.sender].get(tx.nonce + 1)
                if following is not None and following.max_fee_per_gas >= base_fee:
                    heapq.heappush(heads, self._place(following))
        return selected

    def _place(self, tx: SignedTransactionAPI) -> tuple[int, SignedTransactionAPI]:
        """`tx`'s place in a block, smallest first: its arrival (unique, so the transaction
        itself is never compared). Not by tip, as geth orders: ChainClient signs with none, and
        any sender paying one would keep workers' deadline-bound commits out of full blocks."""
        return self.mempool.arrival[tx.hash], tx

    def seal(self) -> object:
        """Build, validate, persist and flush one block from the pending transactions."""
        with self.lock:
            parent = self.head()
            timestamp = max(int(time.time()), parent.timestamp + 1)
            vm_class = self.chain.get_vm_class_for_block_number(parent.block_number + 1)
            # prevrandao from the sealer alone: the block, and so its hash, which seeds the
            # Freivalds check of the jobs committed in it, cannot be computed in advance. With
            # a constant mix_hash a worker predicted the hash of the block its commit would
            # land in, and re-signed the commit until a wrong float C drew a passing seed.
            header = with_fields(vm_class.child_header(parent, REWARD_POOL_ADDRESS, timestamp),
                                 mix_hash=os.urandom(32))
            vm = self.chain.get_vm(header)
            candidates = self._select(vm.state, header.base_fee_per_gas)
            vm.block_preprocessing(vm.get_block())
            header = vm.get_header()
            included, receipts = [], []
            # senders whose next transaction was just dropped, or did not fit in the gas the
            # block had left (ending the block there kept the smaller ones after it out)
            held: set[bytes] = set()
            for tx in candidates:
                if tx.sender in held:  # behind the gap it left: pending, as admitted
                    continue
                if header.gas_used + tx.gas > header.gas_limit:
                    held.add(tx.sender)
                    continue
                snapshot = vm.state.snapshot()
                try:
                    receipt, _ = vm.apply_transaction(header, tx)
                except Exception as exc:  # invalid now (e.g. funds spent): drop, never stall
                    vm.state.revert(snapshot)
                    self.mempool.remove(tx)
                    held.add(tx.sender)
                    log.warning("dropped tx 0x%s: %s", tx.hash.hex(), exc)
                    continue
                header = vm.add_receipt_to_header(header, receipt)
                included.append(tx)
                receipts.append(receipt)
            try:
                sealed = vm.seal_block(header, included, receipts,
                                       work_seal(verified_work(receipts)))
                # seal_block validated the block as it built it: store it without a second
                # validation, nor reading it back (Chain.persist_block would do both)
                self.chain.chaindb.persist_block(sealed)
                self.db.flush()
            except BaseException:
                self.db.discard()
                raise
            self._keep_recent(sealed, receipts)
            self.gas_price = self._gas_price(sealed.header)
            self._set_head(sealed.header, included)
        for callback in self.on_sealed:
            callback()
        return sealed

    def _set_head(self, header, included: list[SignedTransactionAPI]) -> None:
        """The new head and the mempool without its transactions, together for admission."""
        with self.mempool.lock:
            self._head = header
            for tx in included:
                self.mempool.remove(tx)
            if self.journal.outgrew(self.mempool.size):
                self._compact_journal()

    def _keep_recent(self, block, receipts: list) -> None:
        """Keep a sealed block for the long polls (before it becomes the head: a long poll
        that sees the new head finds it here)."""
        self.recent[block.number] = (block, receipts)
        self._recent_size += recent_block_bytes(block, receipts)
        while len(self.recent) > RECENT_BLOCKS or \
                (self._recent_size > self.config.recent_bytes and len(self.recent) > 1):
            self._recent_size -= recent_block_bytes(*self.recent.popitem(last=False)[1])

    def _gather(self) -> None:
        deadline = time.monotonic() + self.config.gather_s
        while self._admitting and len(self.mempool) < self.config.gather_min_txs and \
                time.monotonic() < deadline:
            time.sleep(ADMISSION_POLL_S)
        size = len(self.mempool)
        while time.monotonic() < deadline and \
                self.config.gather_min_txs <= size < self.config.max_block_txs:
            time.sleep(self.config.quiet_s)
            grown = len(self.mempool)
            if grown == size:
                return
            size = grown

    def _produce(self) -> None:
        last = time.monotonic()
        while True:
            with self.mempool.lock:
                while not self._stop:
                    due = self.config.block_time > 0 and time.monotonic() - last >= \
                        self.config.block_time
                    if due or (self.config.seal_on_pending and self._admitted_since_seal):
                        break
                    timeout = self.config.block_time - (time.monotonic() - last) \
                        if self.config.block_time > 0 else None
                    self._wake.wait(timeout)
                if self._stop:
                    return
            mark("node producer awake")
            self._gather()
            mark("node gathered")
            try:
                block = self.seal()
                mark("node sealed")
                more = bool(block.transactions)  # a full block may have left some behind
            except Exception:
                log.exception("sealing a block failed")
                time.sleep(0.1)
                more = True
            if more and len(self.mempool):
                with self.mempool.lock:
                    self._admitted_since_seal = True
            last = time.monotonic()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._produce, name="block-producer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop producing; transactions admitted (their hashes answered) but not yet sealed
        are sealed first, and those that cannot be (behind a nonce gap) stay in the journal
        for the next start, as after a crash."""
        with self.mempool.lock:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._thread is None or not self._thread.is_alive():
            self._seal_pending()
        if self.decoder is not None:
            self.decoder.close()
        self._release_data_dir()

    def _seal_pending(self) -> None:
        """Seal blocks while the pending transactions go into them. What is left waits
        behind a nonce gap and cannot be sealed: the journal keeps it."""
        try:
            while len(self.mempool) and self.seal().transactions:
                pass
            self._compact_journal()
        except Exception:  # noqa: BLE001 - stopping goes on; the journal holds the rest
            log.exception("sealing the pending transactions at stop failed")

    def _release_data_dir(self) -> None:
        self.journal.close()
        self.db.close()
        self._data_dir_lock.close()
