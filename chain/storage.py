"""Account storage whose trie is updated once per state root, with all of a block's slot
writes at once (``chain.tries.update_trie``), instead of one py-trie insert per slot.

py-evm hands a block's storage changes to ``StorageLookup`` one slot at a time when it
computes the state root; each insert decodes, re-encodes and re-hashes the nodes on the
slot's path. Here the writes are buffered (reads see them) and applied in one pass when the
root is asked for, committed, or the storage is wiped; reads walk the trie through the
decoded-node cache of ``chain.tries``. Same roots and same trie nodes
reachable from them (tests/test_chain_fast_tries.py, tests/test_chain_fast_evm.py).
"""
from __future__ import annotations

from eth.constants import BLANK_ROOT_HASH
from eth.db.account import AccountDB
from eth.db.cache import CacheDB
from eth.db.journal import JournalDB
from eth.db.storage import AccountStorageDB, StorageLookup
from eth.rlp.accounts import Account
from eth.validation import validate_canonical_address, validate_uint64, validate_uint256
from eth_typing import Address, Hash32
from trie import HexaryTrie

from chain.tries import encode_node, keccak, trie_get, update_trie


def encode_account(account: Account) -> bytes:
    """RLP of an ``Account`` (nonce, balance, storage root, code hash) without rlp's sedes
    machinery: the same bytes as ``rlp.encode(account, sedes=Account)``."""
    nonce, balance = account.nonce, account.balance
    return encode_node([nonce.to_bytes((nonce.bit_length() + 7) // 8, "big"),
                        balance.to_bytes((balance.bit_length() + 7) // 8, "big"),
                        account.storage_root, account.code_hash])


class BatchedStorageLookup(StorageLookup):
    """``StorageLookup`` with slot writes buffered until the trie's root is needed."""

    def __init__(self, db, storage_root: Hash32, address: Address) -> None:
        self._pending: dict[bytes, bytes] = {}  # hashed slot -> rlp value, b"": deleted
        super().__init__(db, storage_root, address)

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self._pending[self._decode_key(key)] = value

    def __delitem__(self, key: bytes) -> None:
        self._pending[self._decode_key(key)] = b""

    def __getitem__(self, key: bytes) -> bytes:
        """The slot's rlp value, b"" when absent (as py-evm's lookup, through py-trie)."""
        hashed_slot = self._decode_key(key)
        value = self._pending.get(hashed_slot)
        if value is not None:
            return value
        if self._write_trie is None:
            return trie_get(self._db, self._starting_root_hash, hashed_slot)
        return trie_get(self._trie_nodes_batch, self._write_trie.root_hash, hashed_slot)

    def _exists(self, key: bytes) -> bool:
        return self[key] != b""

    def _apply_pending(self) -> None:
        if not self._pending:
            return
        write_trie = self._get_write_trie()
        root = update_trie(self._trie_nodes_batch, write_trie.root_hash, self._pending)
        self._write_trie = HexaryTrie(self._trie_nodes_batch, root_hash=root, prune=True)
        self._pending = {}

    @property
    def has_changed_root(self) -> bool:
        return bool(self._pending) or super().has_changed_root

    def get_changed_root(self) -> Hash32:
        self._apply_pending()
        return super().get_changed_root()

    def commit_to(self, db) -> None:
        self._apply_pending()
        super().commit_to(db)

    def new_trie(self) -> int:
        self._apply_pending()  # the writes so far belong to the trie being set aside
        return super().new_trie()

    def rollback_trie(self, trie_index: int) -> None:
        self._pending = {}  # writes to the discarded trie
        super().rollback_trie(trie_index)


class BatchedAccountStorageDB(AccountStorageDB):
    """py-evm's account storage over a ``BatchedStorageLookup``."""

    def __init__(self, db, storage_root: Hash32, address: Address) -> None:
        super().__init__(db, storage_root, address)
        self._storage_lookup = BatchedStorageLookup(db, storage_root, address)
        self._storage_cache = CacheDB(self._storage_lookup)
        self._locked_changes = JournalDB(self._storage_cache)
        self._journal_storage = JournalDB(self._locked_changes)


class BatchedAccountDB(AccountDB):
    """py-evm's account database with batched storage tries; balance and nonce updates build
    the new ``Account`` directly (rlp's ``copy`` deep-copies the unchanged fields, a third of
    the cost of a transaction's five balance and nonce updates), and accounts are encoded by
    ``encode_account`` (rlp's serializer was the rest of it)."""

    def set_balance(self, address: Address, balance: int) -> None:
        validate_canonical_address(address, title="Storage Address")
        validate_uint256(balance, title="Account Balance")
        account = self._get_account(address)
        self._set_account(address, Account(account.nonce, balance, account.storage_root,
                                           account.code_hash))

    def set_nonce(self, address: Address, nonce: int) -> None:
        validate_canonical_address(address, title="Storage Address")
        validate_uint64(nonce, title="Nonce")
        account = self._get_account(address)
        self._set_account(address, Account(nonce, account.balance, account.storage_root,
                                           account.code_hash))

    def _set_account(self, address: Address, account: Account) -> None:
        self._account_cache[address] = account
        self._journaltrie[address] = encode_account(account)

    def make_state_root(self) -> Hash32:
        """py-evm's ``make_state_root`` with the account trie updated in one pass
        (``update_trie``) instead of one py-trie insert per changed account: in a small block
        those inserts were a third of sealing."""
        for _address, store in self._dirty_account_stores():
            store.make_storage_root()
        for address, storage_root in self._get_changed_roots():
            if self.account_exists(address) or storage_root != BLANK_ROOT_HASH:
                self._set_storage_root(address, storage_root)
        self._journaldb.persist()
        diff = self._journaltrie.diff()
        changes = {keccak(address): b"" for address in diff.deleted_keys()}
        changes.update((keccak(address), rlp) for address, rlp in diff.pending_items())
        if changes:
            self._trie.root_hash = update_trie(self._batchtrie, self._trie.root_hash, changes)
        self._journaltrie.reset()
        self._trie_cache.reset_cache()
        return self.state_root

    def _get_address_store(self, address: Address) -> AccountStorageDB:
        if address not in self._account_stores:
            self._account_stores[address] = BatchedAccountStorageDB(
                self._raw_store_db, self._get_storage_root(address), address)
        return self._account_stores[address]
