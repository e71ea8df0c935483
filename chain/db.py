"""The chain's key-value store: sqlite3 (WAL) with writes buffered until the block is sealed.

py-evm writes trie nodes, headers and indices through this object as it builds a
block; nothing reaches disk until ``flush()``, which the node calls once per
sealed block inside one sqlite transaction. A crash therefore leaves the database
at the last sealed block, never between two.

Values read from or flushed to sqlite are kept in a bounded in-memory cache: a block reads
the same trie nodes again and again (each read a sqlite query), and only this object writes
the table, so a cached value is the stored one.
"""
from __future__ import annotations

import sqlite3
import threading
from os import PathLike
from pathlib import Path
from typing import TextIO

import rlp
from eth.abc import BlockAPI, BlockHeaderAPI
from eth.constants import GENESIS_PARENT_HASH
from eth.db.backends.base import BaseDB
from eth.db.chain import ChainDB
from eth.db.schema import SchemaV1
from eth_typing import Hash32
from lru import LRU
from rlp.sedes import big_endian_int, binary

from chain.dirlock import DirUnusable, claim_data_dir
from chain.tries import encode_node

_DELETED = None
_ABSENT = object()  # a key the write buffer does not mention
DATABASE_FILE = "chain.sqlite"
LOCK_FILE = "LOCK"  # held (flock) by the node using the data dir; holds its pid
CACHE_ENTRIES = 1 << 17  # trie nodes are ~100-600 bytes: tens of MB at most
HEADER_CACHE_ENTRIES = 512


class DataDirError(RuntimeError):
    """A data directory that cannot be used; the message names it and says why."""


def lock_data_dir(data_dir: Path) -> TextIO:
    """Create `data_dir` if needed and lock it for this process until the returned file is
    closed (or the process ends): two nodes sealing blocks into one database would fork it.
    A second locker fails at once, naming the holder's pid."""
    if data_dir.exists() and not data_dir.is_dir():
        raise DataDirError(f"data dir {data_dir} is not a directory")
    try:
        return claim_data_dir(data_dir, LOCK_FILE, "chain node")
    except DirUnusable as exc:
        raise DataDirError(str(exc)) from exc.__cause__


def unreadable(path: str | PathLike, error: sqlite3.DatabaseError) -> DataDirError:
    """The error for a database file sqlite cannot read (not sqlite, truncated, damaged):
    it names the file, where a traceback would not."""
    return DataDirError(f"database {path} cannot be read ({error}): it is damaged, truncated "
                        "or not a chain database")


def _connect(path: str | PathLike) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("CREATE TABLE IF NOT EXISTS kv (key BLOB PRIMARY KEY, value BLOB NOT NULL) "
                     "WITHOUT ROWID")
    except BaseException:
        conn.close()
        raise
    return conn


class SqliteDB(BaseDB):
    """A py-evm ``BaseDB`` over one sqlite table, with an in-memory write buffer. A file sqlite
    cannot open is a ``DataDirError`` naming it."""

    def __init__(self, path: str | PathLike) -> None:
        self.path = path
        try:
            self._conn = _connect(path)
        except sqlite3.DatabaseError as exc:
            raise unreadable(path, exc) from None
        self._pending: dict[bytes, bytes | None] = {}
        self._cache: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    def _read(self, key: bytes) -> bytes | None:
        value = self._cache.get(key)
        if value is not None:
            return value
        with self._lock:  # remembered under the lock too: a flush then cannot come between
            row = self._conn.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
            if row is None:
                return None
            self._remember(key, row[0])
        return row[0]

    def _remember(self, key: bytes, value: bytes) -> None:
        if len(self._cache) >= CACHE_ENTRIES:
            self._cache.clear()
        self._cache[key] = value

    def __getitem__(self, key: bytes) -> bytes:
        value = self._pending.get(key, _ABSENT)  # one read: a flush may swap the dict
        if value is _ABSENT:
            value = self._read(key)
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self._pending[key] = bytes(value)

    def __delitem__(self, key: bytes) -> None:
        if not self._exists(key):
            raise KeyError(key)
        self._pending[key] = _DELETED

    def _exists(self, key: bytes) -> bool:
        value = self._pending.get(key, _ABSENT)
        return (self._read(key) if value is _ABSENT else value) is not None

    def holds_data(self) -> bool:
        """Whether anything was ever stored (a database without a head is then damaged)."""
        with self._lock:
            return self._conn.execute("SELECT 1 FROM kv LIMIT 1").fetchone() is not None

    def flush(self) -> int:
        """Write every buffered change in one transaction; returns how many keys changed.

        The cache takes the changes before the buffer is emptied, under the lock that reads
        of the file take: a reader during the commit, which finds a key in neither, gets its
        new value (it got the cache's older one: reads went back in time while a block was
        written)."""
        with self._lock:
            pending = self._pending
            for key, value in pending.items():
                if value is None:
                    self._cache.pop(key, None)
                else:
                    self._remember(key, value)
            self._pending = {}
            writes = [(k, v) for k, v in pending.items() if v is not None]
            deletes = [(k,) for k, v in pending.items() if v is None]
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                self._conn.executemany("INSERT OR REPLACE INTO kv VALUES (?, ?)", writes)
                self._conn.executemany("DELETE FROM kv WHERE key = ?", deletes)
                # a COMMIT that fails (I/O error, disk full) leaves the transaction open:
                # rolled back below, or every later flush failed ("cannot start a transaction
                # within a transaction") and reads saw the block's uncommitted rows
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                self._cache.clear()  # it took changes the file does not hold
                self._pending = {**pending, **self._pending}
                raise
        return len(pending)

    def discard(self) -> None:
        """Drop buffered writes (a block that failed to seal)."""
        self._pending = {}

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class NodeChainDB(ChainDB):
    """py-evm's ``ChainDB`` with two shortcuts for a node that mostly extends its own head.

    Headers it stored or read lately are kept decoded: each new block reads its parent's
    header twice in validation, and BLOCKHASH and the RPC read recent ones (py-evm's own
    cache is keyed by the header's RLP, so a header the node just stored was decoded again).
    Headers are immutable and addressed by their hash; one is served while the database
    holds it (not after the write of its block was discarded).

    A block that extends the canonical head of a chain with no gaps, without uncles or
    withdrawals (every block this node seals), is stored by writing py-evm's keys directly:
    the header, its score, the canonical number and head, both gap markers, the
    transactions' lookups. py-evm reached the same writes through ~0.3 ms of reads, decodes
    and checks per block; anything else goes through py-evm (tests/test_chain_core.py
    compares the databases both ways produce)."""

    def __init__(self, db) -> None:
        super().__init__(db)
        self._headers: LRU = LRU(HEADER_CACHE_ENTRIES)

    def get_block_header_by_hash(self, block_hash: Hash32) -> BlockHeaderAPI:
        header = self._headers.get(block_hash)
        if header is None or block_hash not in self.db:
            header = self._headers[block_hash] = super().get_block_header_by_hash(block_hash)
        return header

    def persist_block(self, block: BlockAPI, genesis_parent_hash: Hash32 = GENESIS_PARENT_HASH
                      ) -> tuple[tuple[Hash32, ...], tuple[Hash32, ...]]:
        header = block.header
        if header.block_number and not block.uncles and not block.withdrawals and \
                self.db.get(CANONICAL_HEAD) == header.parent_hash and \
                self.db.get(HEADER_GAPS) == self.db.get(CHAIN_GAPS) == \
                _no_gaps_below(header.block_number):
            persisted = self._extend_head(block)
        else:
            persisted = super().persist_block(block, genesis_parent_hash)
        self._headers[block.hash] = header
        return persisted

    def _extend_head(self, block: BlockAPI) -> tuple[tuple[Hash32, ...], tuple[Hash32, ...]]:
        """py-evm's writes for a new canonical head whose parent is the current one."""
        header, number = block.header, block.header.block_number
        parent_score = rlp.decode(self.db[SchemaV1.make_block_hash_to_score_lookup_key(
            header.parent_hash)], sedes=big_endian_int)
        score = parent_score + (header.difficulty or number)  # py-evm's PoS score
        with self.db.atomic_batch() as batch:
            batch[header.hash] = rlp.encode(header)
            batch[SchemaV1.make_block_hash_to_score_lookup_key(header.hash)] = rlp.encode(
                score, sedes=big_endian_int)
            batch[HEADER_GAPS] = batch[CHAIN_GAPS] = _no_gaps_below(number + 1)
            batch[SchemaV1.make_block_number_to_hash_lookup_key(number)] = rlp.encode(
                header.hash, sedes=binary)
            batch[CANONICAL_HEAD] = header.hash
            for index, transaction in enumerate(block.transactions):
                batch[SchemaV1.make_transaction_hash_to_block_lookup_key(transaction.hash)] = \
                    encode_node([_int_bytes(number), _int_bytes(index)])  # BlockDataKey's
        return (header.hash,), ()


# the raw transactions a stop could not seal (behind a nonce gap), for the next start to
# admit again; no py-evm key (32-byte hashes, SchemaV1's "v1:..." names) looks like it
CANONICAL_HEAD = SchemaV1.make_canonical_head_hash_lookup_key()
HEADER_GAPS = SchemaV1.make_header_chain_gaps_lookup_key()
CHAIN_GAPS = SchemaV1.make_chain_gaps_lookup_key()


def _no_gaps_below(number: int) -> bytes:
    """py-evm's gap marker (``chain_gaps``: no gaps, then the first block missing as a
    32-byte integer) of a chain holding every block below ``number``."""
    return encode_node([[], number.to_bytes(32, "big")])


def _int_bytes(value: int) -> bytes:
    return value.to_bytes((value.bit_length() + 7) // 8, "big")
