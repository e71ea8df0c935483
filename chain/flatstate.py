"""A block's account and storage state in plain dicts, written into py-evm's tries once.

py-evm's ``AccountDB`` sends every read and write of a transaction through journals, caches
and rlp-encoded ``Account`` objects (four layers per storage slot, an encode per balance or
nonce change), and snapshots record a checkpoint in every journal. Here the state a block
touches lives in dicts: accounts as ``(nonce, balance, code_hash)`` (``None``: no such
account), slots as ints, plus the transaction's warm addresses and slots and each written
slot's value at the start of the transaction (EIP-2200's "original"). Every change appends
``(dict, key, old value)`` to one undo log; a snapshot is a position in it, a revert pops
back to it. When the state root is asked for (block end, ``persist``) each changed account's
storage trie takes the account's slot writes in one pass, then the account trie takes the
changed accounts in one pass (``chain.tries.update_trie``); the new nodes go into py-evm's
batch, which ``persist`` commits. py-evm's own journals, caches and per-account storage
objects stay empty. Same semantics as py-evm's ``AccountDB``, compared operation by operation
in tests/test_chain_fast_flatstate.py and block by block by the stock re-import in
tests/test_chain_fast_evm.py.
"""
from __future__ import annotations

import rlp
from eth.constants import BLANK_ROOT_HASH, EMPTY_SHA3
from eth.db.account import AccountDB
from eth.db.journal import get_next_checkpoint
from eth.db.witness import MetaWitness
from eth.typing import JournalDBCheckpoint
from eth.validation import validate_canonical_address, validate_is_bytes
from eth.vm.interrupt import MissingBytecode
from eth_hash.auto import keccak
from eth_typing import Address, Hash32
from eth_utils import ValidationError

from chain.tries import encode_account, encode_node, trie_get, update_trie

UINT64_MAX = 2**64 - 1
UINT256_MAX = 2**256 - 1
EMPTY_ACCOUNT = (0, 0, EMPTY_SHA3)  # what py-evm reads for an absent account
MISSING = object()  # undo-log marker: the key was absent


def _check_uint(value: int, limit: int, title: str) -> None:
    """py-evm's ``validate_uint64``/``validate_uint256`` checks, with its messages."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValidationError(f"{title} must be an integer: Got: {type(value)}")
    if value < 0:
        raise ValidationError(f"{title} cannot be negative: Got: {value}")
    if value > limit:
        size = "uint64" if limit == UINT64_MAX else "uint256"
        raise ValidationError(f"{title} exceeds maximum {size} size.  Got: {value}")


class FlatAccountDB(AccountDB):
    """py-evm's account database with a block's reads and writes kept in dicts until the
    state root is computed."""

    def __init__(self, db, state_root: Hash32 = BLANK_ROOT_HASH) -> None:
        super().__init__(db, state_root)
        self._root = state_root
        self._log: list[tuple[dict, object, object]] = []
        self._checkpoints: dict[JournalDBCheckpoint, int] = {}
        self._code: dict[Hash32, bytes] = {}  # by hash: valid for any state
        self._clear_block()
        self._clear_transaction()

    def _clear_block(self) -> None:
        """Forget the block's changes (written into the tries) and cached reads."""
        self._accounts: dict[Address, tuple[int, int, bytes] | None] = {}
        self._slots: dict[Address, dict[int, int]] = {}
        self._wiped: dict[Address, bool] = {}  # storage wiped: unwritten slots read 0
        self._changed_accounts: dict[Address, None] = {}  # insertion-ordered set
        self._changed_slots: dict[Address, set[int]] = {}
        self._new_code: dict[Hash32, bytes] = {}
        self._storage_roots: dict[Address, Hash32] = {}  # as of the last state root
        self._log.clear()
        self._checkpoints.clear()

    def _clear_transaction(self) -> None:
        self._warm: dict[object, bool] = {}  # addresses and (address, slot) pairs
        self._originals: dict[tuple[Address, int], int] = {}

    def _change(self, table: dict, key, value) -> None:
        self._log.append((table, key, table.get(key, MISSING)))
        table[key] = value

    # --- accounts -------------------------------------------------------------------------
    def _account(self, address: Address) -> tuple[int, int, bytes] | None:
        account = self._accounts.get(address, MISSING)
        if account is MISSING:
            account = self._load(address)
        return account

    def _storage_root(self, address: Address) -> Hash32:
        """The account's storage root as of the last state root."""
        root = self._storage_roots.get(address)
        if root is None:
            self._load(address)
            root = self._storage_roots[address]
        return root

    def _load(self, address: Address) -> tuple[int, int, bytes] | None:
        """The stored account, read through ``chain.tries``' node cache and decoded as plain
        RLP (rlp's ``Account`` sedes was a fifth of computing a small block's state root);
        its fields are kept as the account (unless the block changed it) and its storage
        root."""
        encoded = trie_get(self._batchtrie, self._root, keccak(address))
        if encoded:
            nonce, balance, root, code_hash = rlp.decode(encoded)
            account = (int.from_bytes(nonce, "big"), int.from_bytes(balance, "big"), code_hash)
        else:
            account, root = None, BLANK_ROOT_HASH
        self._accounts.setdefault(address, account)
        self._storage_roots[address] = root
        return account

    def _set_fields(self, address: Address, account: tuple[int, int, bytes] | None) -> None:
        self._change(self._accounts, address, account)
        self._changed_accounts[address] = None

    def get_balance(self, address: Address) -> int:
        validate_canonical_address(address, title="Storage Address")
        return (self._account(address) or EMPTY_ACCOUNT)[1]

    def set_balance(self, address: Address, balance: int) -> None:
        validate_canonical_address(address, title="Storage Address")
        _check_uint(balance, UINT256_MAX, "Account Balance")
        nonce, _, code_hash = self._account(address) or EMPTY_ACCOUNT
        self._set_fields(address, (nonce, balance, code_hash))

    def get_nonce(self, address: Address) -> int:
        validate_canonical_address(address, title="Storage Address")
        return (self._account(address) or EMPTY_ACCOUNT)[0]

    def set_nonce(self, address: Address, nonce: int) -> None:
        validate_canonical_address(address, title="Storage Address")
        _check_uint(nonce, UINT64_MAX, "Nonce")
        _, balance, code_hash = self._account(address) or EMPTY_ACCOUNT
        self._set_fields(address, (nonce, balance, code_hash))

    def increment_nonce(self, address: Address) -> None:
        self.set_nonce(address, self.get_nonce(address) + 1)

    def get_code_hash(self, address: Address) -> Hash32:
        validate_canonical_address(address, title="Storage Address")
        return (self._account(address) or EMPTY_ACCOUNT)[2]

    def get_code(self, address: Address) -> bytes:
        code_hash = self.get_code_hash(address)
        if code_hash == EMPTY_SHA3:
            return b""
        code = self._code.get(code_hash)
        if code is None:
            try:
                code = self._new_code.get(code_hash) or self._journaldb[code_hash]
            except KeyError:
                raise MissingBytecode(code_hash) from KeyError
            self._code[code_hash] = code
        return code

    def set_code(self, address: Address, code: bytes) -> None:
        validate_canonical_address(address, title="Storage Address")
        validate_is_bytes(code, title="Code")
        code_hash = keccak(code)
        self._new_code[code_hash] = code
        nonce, balance, _ = self._account(address) or EMPTY_ACCOUNT
        self._set_fields(address, (nonce, balance, code_hash))

    def delete_code(self, address: Address) -> None:
        validate_canonical_address(address, title="Storage Address")
        nonce, balance, _ = self._account(address) or EMPTY_ACCOUNT
        self._set_fields(address, (nonce, balance, EMPTY_SHA3))

    def account_has_code_or_nonce(self, address: Address) -> bool:
        nonce, _, code_hash = self._account(address) or EMPTY_ACCOUNT
        return nonce != 0 or code_hash != EMPTY_SHA3

    def account_is_empty(self, address: Address) -> bool:
        return (self._account(address) or EMPTY_ACCOUNT) == EMPTY_ACCOUNT

    def account_exists(self, address: Address) -> bool:
        validate_canonical_address(address, title="Storage Address")
        return self._account(address) is not None

    def touch_account(self, address: Address) -> None:
        """Writes the account as it is, creating an empty one (as py-evm does)."""
        validate_canonical_address(address, title="Storage Address")
        self._set_fields(address, self._account(address) or EMPTY_ACCOUNT)

    def delete_account(self, address: Address) -> None:
        validate_canonical_address(address, title="Storage Address")
        self._wipe(address)
        self._set_fields(address, None)

    # --- storage --------------------------------------------------------------------------
    def _wipe(self, address: Address) -> None:
        self._change(self._slots, address, {})
        self._change(self._wiped, address, True)

    def delete_storage(self, address: Address) -> None:
        """Empties the storage and, like py-evm (which sets the empty storage root), writes
        the account, creating it if absent."""
        validate_canonical_address(address, title="Storage Address")
        self._set_fields(address, self._account(address) or EMPTY_ACCOUNT)
        self._wipe(address)

    def get_storage(self, address: Address, slot: int, from_journal: bool = True) -> int:
        """The slot's value; ``from_journal=False``: its value when the transaction began."""
        validate_canonical_address(address, title="Storage Address")
        _check_uint(slot, UINT256_MAX, "Storage Slot")
        if not from_journal:
            original = self._originals.get((address, slot))
            if original is not None:  # else unwritten in this transaction: the current value
                return original
        slots = self._slots.get(address)
        if slots is None:
            slots = self._slots[address] = {}
        value = slots.get(slot)
        if value is None:
            value = 0 if address in self._wiped else self._stored_value(address, slot)
            slots[slot] = value  # a cached read: reverts need not restore it
        return value

    def _stored_value(self, address: Address, slot: int) -> int:
        """The slot's value in the storage trie, read through ``chain.tries``' node cache."""
        encoded = trie_get(self._batchtrie, self._storage_root(address),
                           keccak(slot.to_bytes(32, "big")))
        return int.from_bytes(rlp.decode(encoded), "big") if encoded else 0

    def set_storage(self, address: Address, slot: int, value: int) -> None:
        _check_uint(value, UINT256_MAX, "Storage Value")
        current = self.get_storage(address, slot)
        key = (address, slot)
        if key not in self._originals:
            self._originals[key] = current
        self._change(self._slots[address], slot, value)
        self._changed_slots.setdefault(address, set()).add(slot)

    # --- EIP-2929 access sets (per transaction, reverted with their frame) ------------------
    def is_storage_warm(self, address: Address, slot: int) -> bool:
        return (address, slot) in self._warm

    def mark_storage_warm(self, address: Address, slot: int) -> None:
        if (address, slot) not in self._warm:
            self._change(self._warm, (address, slot), True)

    def is_address_warm(self, address: Address) -> bool:
        return address in self._warm

    def mark_address_warm(self, address: Address) -> None:
        if address not in self._warm:
            self._change(self._warm, address, True)

    # --- snapshots ------------------------------------------------------------------------
    def record(self) -> JournalDBCheckpoint:
        checkpoint = get_next_checkpoint()
        self._checkpoints[checkpoint] = len(self._log)
        return checkpoint

    def _position(self, checkpoint: JournalDBCheckpoint) -> int:
        try:
            return self._checkpoints.pop(checkpoint)
        except KeyError:
            raise ValidationError(f"No checkpoint {checkpoint} was found") from None

    def discard(self, checkpoint: JournalDBCheckpoint) -> None:
        position, log = self._position(checkpoint), self._log
        while len(log) > position:
            table, key, old = log.pop()
            if old is MISSING:
                table.pop(key, None)
            else:
                table[key] = old

    def commit(self, checkpoint: JournalDBCheckpoint) -> None:
        self._position(checkpoint)  # its changes stay in the log for an enclosing revert

    def lock_changes(self) -> None:
        """End of a transaction: new access sets and original values for the next one."""
        self._clear_transaction()

    # --- the tries ---------------------------------------------------------------------
    @property
    def state_root(self) -> Hash32:
        return self._root

    @state_root.setter
    def state_root(self, value: Hash32) -> None:
        """Set by a state revert (the root at the snapshot: unchanged within a block)."""
        if value != self._root:
            self._clear_block()
            self._root = value

    def make_state_root(self) -> Hash32:
        """The block's changes into the tries, one pass per trie, in py-evm's semantics: a
        wiped account's storage restarts from the empty trie; an account absent at the end
        is deleted, unless slots were written after it went (py-evm then stores an empty
        account holding that storage); an account only whose slots changed is rewritten
        with its new storage root. New nodes and code go into py-evm's batches."""
        accounts: dict[bytes, bytes] = {}
        for address in {**self._changed_accounts, **self._wiped, **self._changed_slots}:
            account = self._account(address)
            wiped = address in self._wiped
            root = BLANK_ROOT_HASH if wiped else self._storage_root(address)
            slots = self._changed_slots.get(address)
            if slots:
                root = update_trie(self._batchtrie, root, self._slot_changes(address, slots))
            if account is None:
                if root != BLANK_ROOT_HASH:
                    account = EMPTY_ACCOUNT
                elif address in self._changed_accounts:
                    accounts[keccak(address)] = b""
                    continue
                else:
                    continue
            elif not (address in self._changed_accounts or wiped or root !=
                      self._storage_root(address)):
                continue
            nonce, balance, code_hash = account
            if code_hash in self._new_code:
                self._batchdb[code_hash] = self._new_code[code_hash]
            accounts[keccak(address)] = encode_account(nonce, balance, root, code_hash)
        self._root = update_trie(self._batchtrie, self._root, accounts)
        self._clear_block()
        return self._root

    def _slot_changes(self, address: Address, slots: set[int]) -> dict[bytes, bytes]:
        """Hashed slot -> RLP value (b"": zero, deleted) of the slots written in the block.
        A slot without a value was wiped after its write: the wiped trie has no entry."""
        values = self._slots.get(address, {})
        changes = {}
        for slot in slots:
            value = values.get(slot)
            if value is not None:
                changes[keccak(slot.to_bytes(32, "big"))] = \
                    encode_node(value.to_bytes((value.bit_length() + 7) // 8, "big")) \
                    if value else b""
        return changes

    def persist(self) -> MetaWitness:
        """The state root, then the new trie nodes and code into the database in one batch.
        No witness of the nodes read is kept (py-evm logs its size at debug level only)."""
        self.make_state_root()
        with self._raw_store_db.atomic_batch() as write_batch:
            self._batchtrie.commit_to(write_batch, apply_deletes=False)
            self._batchdb.commit_to(write_batch, apply_deletes=False)
        self._root_hash_at_last_persist = self._root
        return MetaWitness(set(), {})
