"""Batched storage-trie updates (chain/tries.py ``update_trie``) against py-trie's HexaryTrie,
key by key: inserts, overwrites, deletes (collapsing branches and merging paths) and deletes
of absent keys, on 32-byte hashed keys like storage tries and on short keys that are
prefixes of each other (branch values, inline nodes); then the flat state's storage roots."""
import os
import random

import pytest
import rlp
from eth.constants import BLANK_ROOT_HASH
from eth.db.account import AccountDB
from eth.db.atomic import AtomicDB
from eth.rlp.accounts import Account
from eth.rlp.logs import Log
from eth.rlp.receipts import Receipt
from eth.vm.forks.prague import PragueVM
from eth.vm.forks.prague.blocks import PragueBlockHeader
from eth_hash.auto import keccak
from rlp.sedes import BigEndianInt
from trie import HexaryTrie

from chain.flatstate import FlatAccountDB
from chain.tries import (
    MissingNode,
    encode_account,
    encode_header,
    encode_node,
    encode_receipt,
    trie_get,
    update_trie,
)


def test_encode_node_is_rlp():
    rng = random.Random(2)

    def item(depth):
        if depth > 3 or rng.random() < 0.4:
            return os.urandom(rng.choice([0, 1, 1, 2, 31, 55, 56, 300, 70000]))
        return [item(depth + 1) for _ in range(rng.choice([0, 1, 2, 17]))]
    for _ in range(300):
        value = item(0)
        assert encode_node(value) == rlp.encode(value)
    assert encode_node(b"\x7f") == b"\x7f" and encode_node(b"\x80") == b"\x81\x80"


def random_batch(rng: random.Random, present: dict, new_key, size: int) -> dict:
    changes = {}
    for _ in range(size):
        roll = rng.random()
        if present and roll < 0.3:
            changes[rng.choice(sorted(present))] = b""  # delete
        elif present and roll < 0.5:
            changes[rng.choice(sorted(present))] = os.urandom(rng.choice([1, 5, 40]))
        elif roll < 0.55:
            changes[new_key()] = b""  # delete of an absent key: no effect
        else:
            changes[new_key()] = os.urandom(rng.choice([1, 5, 40]))
    return changes


def test_encode_receipt_is_receipt_encode():
    rng = random.Random(4)
    typed = PragueVM.get_receipt_builder().typed_receipt_class
    for i in range(300):
        logs = [Log(rng.randbytes(20), [rng.choice([0, 1, 2**256 - 1, rng.getrandbits(256)])
                                        for _ in range(rng.randrange(5))],
                    rng.randbytes(rng.choice([0, 1, 31, 55, 56, 300])))
                for _ in range(rng.choice([0, 0, 1, 2, 7]))]
        inner = Receipt(rng.choice([b"", b"\x01"]), rng.choice([0, 1, 21_000, 2**63]), logs)
        receipt = inner if i % 5 == 0 else typed(1 + i % 4, inner)
        assert encode_receipt(receipt) == receipt.encode()


def test_encode_account_is_rlp():
    rng = random.Random(4)
    edges = [0, 1, 127, 128, 255, 256, 2**64 - 1, 2**255, 2**256 - 1]
    for nonce in edges[:7]:
        for balance in edges + [rng.getrandbits(rng.randrange(1, 257)) for _ in range(5)]:
            account = Account(nonce, balance, os.urandom(32), os.urandom(32))
            assert encode_account(*account) == rlp.encode(account, sedes=Account)


def test_encode_header_is_rlp():
    """Prague headers with zero, small, 2**k boundary and random integer fields and byte
    fields of every length their sedes allow."""
    rng = random.Random(5)
    ints = [0, 1, 127, 128, 255, 256, 2**64 - 1, 2**255]
    for _ in range(200):
        fields = {}
        for name, sedes in PragueBlockHeader._meta.fields:
            if name == "bloom":
                fields[name] = rng.choice([0, 1, rng.getrandbits(2048)])
            elif isinstance(sedes, BigEndianInt):
                fields[name] = rng.choice(ints + [rng.getrandbits(rng.randrange(1, 200))])
            else:
                sizes = [size for size in (0, 1, 8, 20, 32, 55, 56, 80)
                         if sedes.min_length <= size <= sedes.max_length]
                fields[name] = os.urandom(rng.choice(sizes))
        header = PragueBlockHeader(**fields)
        assert encode_header(header) == rlp.encode(header, sedes=PragueBlockHeader)


@pytest.mark.parametrize("key_kind", ["hashed", "short"])
@pytest.mark.parametrize("seed", range(4))
def test_batched_updates_match_py_trie(key_kind, seed):
    rng = random.Random(seed)
    if key_kind == "hashed":
        def new_key():
            return keccak(os.urandom(8))
    else:  # 1-3 bytes from a small alphabet: many shared prefixes, keys ending in branches
        def new_key():
            return bytes(rng.choice([0, 1, 0x10, 0x11, 0xFF]) for _ in range(rng.randint(1, 3)))
    reference = HexaryTrie({}, BLANK_ROOT_HASH)
    db: dict = {}
    root = BLANK_ROOT_HASH
    present: dict = {}
    for size in [1, 1, 2, 5, 30, 200, 50, 3, 400, 1]:
        changes = random_batch(rng, present, new_key, size)
        for key, value in changes.items():
            reference[key] = value  # py-trie: a blank value deletes
            if value:
                present[key] = value
            else:
                present.pop(key, None)
        root = update_trie(db, root, changes)
        assert root == reference.root_hash
        stored = HexaryTrie(db, root)  # every node of the new trie was written
        assert all(stored[key] == value for key, value in present.items())
        for key in [*present, new_key(), new_key()]:  # reads through the node cache
            assert trie_get(db, root, key) == reference[key]
    with pytest.raises(MissingNode):  # a root whose node the database does not hold
        trie_get(db, keccak(b"no such node"), keccak(b"x"))
    # delete everything: back to the blank root
    root = update_trie(db, root, dict.fromkeys(present, b""))
    assert root == BLANK_ROOT_HASH


def test_update_splits_extensions_like_py_trie():
    """Inserts only (no deletion) that leave an extension's shared path at its first nibble,
    at a later one, at its end, or before it ends: the branch made at the split must collapse
    again when it keeps one child (a fast path for branches that lose nothing must not apply
    to it)."""
    base = [bytes.fromhex("12ab") + b"\1" * 30, bytes.fromhex("12cd") + b"\2" * 30]
    inserts = [[bytes.fromhex("13") + b"\3" * 31], [bytes.fromhex("23") + b"\3" * 31],
               [bytes.fromhex("12ab") + b"\4" * 30], [b"\x12"], [b"\x12\xab"],
               [bytes.fromhex("13") + b"\3" * 31, bytes.fromhex("1234") + b"\5" * 30],
               [bytes.fromhex("1f") + b"\3" * 31, b"\x12\xcd"]]
    for keys in inserts:
        db: dict = {}
        reference = HexaryTrie({})
        for key in base:
            reference[key] = b"v" * 40
        root = update_trie(db, BLANK_ROOT_HASH, dict.fromkeys(base, b"v" * 40))
        for key in keys:
            reference[key] = b"w" * 40
        assert update_trie(db, root, dict.fromkeys(keys, b"w" * 40)) == reference.root_hash


def test_flat_account_storage_matches_py_evm():
    """Random storage writes (zeroing slots included), reverted checkpoints and wiped
    accounts over several blocks, into storage tries of a few hundred slots: the same state
    roots as py-evm's AccountDB, and the persisted storage reads back from a fresh database
    object (chain/flatstate.py's one-pass storage and account trie updates)."""
    rng = random.Random(11)
    stock, batched = (cls(AtomicDB(), BLANK_ROOT_HASH) for cls in (AccountDB, FlatAccountDB))
    addresses = [bytes([i]) * 20 for i in range(1, 4)]
    expected: dict = {}
    for _ in range(6):  # blocks
        for _ in range(40):  # transactions
            checkpoints = [db.record() for db in (stock, batched)]
            writes = [(rng.choice(addresses), rng.randrange(64),
                       rng.choice([0, 1, rng.getrandbits(256)])) for _ in range(rng.randint(1, 6))]
            wipe = rng.random() < 0.05 and rng.choice(addresses)
            for db in (stock, batched):
                for address, slot, value in writes:
                    db.set_storage(address, slot, value)
                if wipe:
                    db.delete_account(wipe)
            keep = rng.random() < 0.8
            for db, checkpoint in zip((stock, batched), checkpoints, strict=True):
                (db.commit if keep else db.discard)(checkpoint)
            if keep:
                for address, slot, value in writes:
                    expected[address, slot] = value
                if wipe:
                    expected = {k: v for k, v in expected.items() if k[0] != wipe}
            for db in (stock, batched):
                db.lock_changes()
        roots = [db.make_state_root() for db in (stock, batched)]
        assert roots[0] == roots[1]
        for db in (stock, batched):
            db.persist()
    reread = FlatAccountDB(batched._raw_store_db, roots[1])
    assert all(reread.get_storage(a, s) == v for (a, s), v in expected.items())
