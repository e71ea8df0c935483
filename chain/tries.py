"""Merkle-Patricia tries built and updated in one pass: a block's transaction and receipt
tries, and a block's worth of storage writes.

py-trie inserts one key at a time, decoding and re-encoding the nodes on the key's path at
every insert: about 15 % of sealing a block of ``submitJob`` transactions for the block
tries, and 28 % for the market's storage trie (four new slots per job). Here the keys are
sorted once; new tries are built bottom-up and existing ones updated top-down, so each node
on a changed path is decoded, encoded and hashed exactly once. Roots are the same (the
trie is canonical for its contents; tests compare with py-trie). Nodes are content-addressed,
so decoded ones are kept in one process-wide LRU cache, valid whatever database they came
from; storage reads (``trie_get``) walk the trie through it.
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import rlp
from eth.abc import BlockHeaderAPI, ReceiptAPI
from eth.constants import BLANK_ROOT_HASH
from eth_hash.auto import keccak
from eth_typing import Hash32
from lru import LRU

Node = list  # [path, value] (leaf or extension) or 17 items (branch)
Nibbles = bytes  # one nibble per byte
BLANK = b""  # an empty node or child slot
_decoded: LRU = LRU(1 << 16)  # node hash -> decoded node (never mutated)


class MissingNode(Exception):
    """A trie node the database does not hold (a corrupt or partial database); not a
    KeyError, which py-evm's storage reads take for an empty slot."""


def encode_node(item: Node | bytes) -> bytes:
    """RLP (yellow paper, appendix B) of a trie node: nested lists of byte strings. A list's
    byte-string items (a branch's 17 children are mostly hashes and blanks) are encoded in
    its own loop: a call per child was most of hashing a branch."""
    if isinstance(item, bytes):
        return _encode_bytes(item)
    parts = []
    for child in item:
        if type(child) is bytes:
            length = len(child)
            if length < 56 and (length != 1 or child[0] >= 0x80):
                parts.append(_SHORT_PREFIXES[length])
            elif length != 1:
                parts.append(_length_prefix(length, 0x80))
            parts.append(child)
        else:
            parts.append(encode_node(child))
    payload = b"".join(parts)
    return _length_prefix(len(payload), 0xC0) + payload


def _encode_bytes(item: bytes) -> bytes:
    if len(item) == 1 and item[0] < 0x80:
        return item
    return _length_prefix(len(item), 0x80) + item


_SHORT_PREFIXES = [bytes([0x80 + length]) for length in range(56)]


def _length_prefix(length: int, offset: int) -> bytes:
    if length < 56:
        return bytes([offset + length])
    size = length.to_bytes((length.bit_length() + 7) // 8, "big")
    return bytes([offset + 55 + len(size)]) + size


_HEX_DIGIT_VALUES = bytes.maketrans(b"0123456789abcdef", bytes(range(16)))


def _nibbles(key: bytes) -> Nibbles:
    """One nibble per byte, high nibble first (through hex digits: one C-level pass)."""
    return key.hex().encode().translate(_HEX_DIGIT_VALUES)


_NIBBLE_HEX_DIGITS = bytes.maketrans(bytes(range(16)), b"0123456789abcdef")


def _hex_prefix(nibbles: Nibbles, leaf: bool) -> bytes:
    """Compact (hex-prefix) encoding of a node path (yellow paper, appendix C): the flag
    nibble, a zero nibble when the path is even, the path; packed through hex digits."""
    odd = len(nibbles) % 2
    flag = "0123"[2 * leaf + odd] + ("" if odd else "0")
    return bytes.fromhex(flag + nibbles.translate(_NIBBLE_HEX_DIGITS).decode())


def _common_prefix(a: Nibbles, b: Nibbles) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def _build(items: Sequence[tuple[Nibbles, bytes]], depth: int,
           nodes: MutableMapping[Hash32, bytes]) -> Node:
    """The node for sorted (path, value) items that share their first ``depth`` nibbles."""
    if len(items) == 1:
        path, value = items[0]
        return [_hex_prefix(path[depth:], leaf=True), value]
    shared = _common_prefix(items[0][0][depth:], items[-1][0][depth:])
    if shared:
        child = _build(items, depth + shared, nodes)
        return [_hex_prefix(items[0][0][depth:depth + shared], leaf=False),
                _reference(child, nodes)]
    branch: Node = [b""] * 17
    start = 0
    if len(items[0][0]) == depth:  # a key ending here keeps its value in the branch
        branch[16] = items[0][1]
        start = 1
    while start < len(items):
        nibble = items[start][0][depth]
        end = start
        while end < len(items) and items[end][0][depth] == nibble:
            end += 1
        branch[nibble] = _reference(_build(items[start:end], depth + 1, nodes), nodes)
        start = end
    return branch


def _reference(node: Node, nodes: MutableMapping[Hash32, bytes]) -> Node | Hash32:
    """How a parent refers to a node: inline below 32 encoded bytes, else by hash."""
    encoded = encode_node(node)
    if len(encoded) < 32:
        return node
    node_hash = keccak(encoded)
    nodes[node_hash] = encoded
    _decoded[node_hash] = node
    return node_hash


def encode_account(nonce: int, balance: int, storage_root: Hash32, code_hash: Hash32) -> bytes:
    """RLP of an account (nonce, balance, storage root, code hash): the same bytes as
    ``rlp.encode(Account(...), sedes=Account)`` without rlp's sedes machinery."""
    return encode_node([nonce.to_bytes((nonce.bit_length() + 7) // 8, "big"),
                        balance.to_bytes((balance.bit_length() + 7) // 8, "big"),
                        storage_root, code_hash])


def encode_header(header: BlockHeaderAPI) -> bytes:
    """``rlp.encode(header)`` by the small encoder (rlp's serializer took ~0.1 ms a header,
    paid for its hash): integers big-endian, minimal or of their field's fixed length (the
    bloom's 256 bytes), byte strings as they are."""
    items = []
    for (_, sedes), value in zip(type(header)._meta.fields, header, strict=True):
        if isinstance(value, int):
            value = value.to_bytes(getattr(sedes, "length", None) or
                                   (value.bit_length() + 7) // 8, "big")
        items.append(value)
    return encode_node(items)


def encode_receipt(receipt: ReceiptAPI) -> bytes:
    """``receipt.encode()`` by the small encoder: rlp's sedes machinery took a twelfth of
    sealing a block of ``submitJob`` (EIP-2718: a typed receipt is its type byte and the
    RLP of [status, cumulative gas, bloom, logs])."""
    gas = receipt.gas_used
    logs = [[log.address, [topic.to_bytes(32, "big") for topic in log.topics], log.data]
            for log in receipt.logs]
    body = encode_node([receipt.state_root, gas.to_bytes((gas.bit_length() + 7) // 8, "big"),
                        receipt.bloom.to_bytes(256, "big"), logs])
    return body if receipt.type_id is None else bytes([receipt.type_id]) + body


def trie_root_and_nodes(items: Sequence) -> tuple[Hash32, dict[Hash32, bytes]]:
    """Root hash and nodes of the trie mapping ``rlp(i)`` to ``items[i].encode()``
    (drop-in for ``eth.db.trie.make_trie_root_and_nodes``)."""
    if not items:
        return BLANK_ROOT_HASH, {}
    keyed = sorted((_nibbles(rlp.encode(index)),
                    encode_receipt(item) if isinstance(item, ReceiptAPI) else item.encode())
                   for index, item in enumerate(items))
    nodes: dict[Hash32, bytes] = {}
    encoded = encode_node(_build(keyed, 0, nodes))
    root = keccak(encoded)
    nodes[root] = encoded
    return root, nodes


# --- reading and updating a stored trie ------------------------------------------------------


def _path_of(encoded_path: bytes) -> tuple[Nibbles, bool]:
    """(nibbles, is_leaf) of a hex-prefix encoded path."""
    flag = encoded_path[0] >> 4
    nibbles = _nibbles(encoded_path)[2 - (flag & 1):]
    return nibbles, bool(flag & 2)


def _resolve(ref: Node | bytes, db: Mapping[bytes, bytes]) -> Node | bytes:
    """The node a parent refers to (a hash is looked up; inline nodes and BLANK as they are)."""
    if not (isinstance(ref, bytes) and len(ref) == 32):
        return ref
    node = _decoded.get(ref)
    if node is None:
        try:
            node = rlp.decode(db[ref])
        except KeyError as exc:
            raise MissingNode(ref) from exc
        _decoded[ref] = node
    return node


def trie_get(db: Mapping[bytes, bytes], root: Hash32, key: bytes) -> bytes:
    """The value at ``key`` in the trie at ``root`` (``b""`` when absent, as py-trie)."""
    path = _nibbles(key)
    node = _resolve(BLANK if root == BLANK_ROOT_HASH else root, db)
    while node != BLANK:
        if len(node) == 17:
            if not path:
                return node[16]
            node, path = _resolve(node[path[0]], db), path[1:]
            continue
        node_path, is_leaf = _path_of(node[0])
        if is_leaf:
            return node[1] if node_path == path else BLANK
        if path[:len(node_path)] != node_path:
            return BLANK
        node, path = _resolve(node[1], db), path[len(node_path):]
    return BLANK


def _update(ref: Node | bytes, changes: list[tuple[Nibbles, bytes]],
            db: Mapping[bytes, bytes], nodes: MutableMapping[Hash32, bytes]) -> Node | bytes:
    """The node replacing ``ref`` after the sorted ``changes`` (value BLANK deletes), keys
    relative to this node. Returns a decoded node; children it creates are referenced."""
    node = _resolve(ref, db)
    if node == BLANK or len(node) == 2 and _path_of(node[0])[1]:  # empty or a leaf: rebuild
        merged = {} if node == BLANK else {_path_of(node[0])[0]: node[1]}
        merged.update(changes)
        items = sorted((path, value) for path, value in merged.items() if value != BLANK)
        return _build(items, 0, nodes) if items else BLANK
    if len(node) == 2:  # extension
        prefix, _ = _path_of(node[0])
        if all(path[:len(prefix)] == prefix for path, _ in changes):
            child = _update(node[1], [(path[len(prefix):], value) for path, value in changes],
                            db, nodes)
            return _canonical_extension(prefix, child, nodes)
        # some key leaves the shared prefix: the same trie as a branch at its first nibble
        branch: Node = [BLANK] * 17
        rest = prefix[1:]
        branch[prefix[0]] = _reference([_hex_prefix(rest, leaf=False), node[1]], nodes) \
            if rest else node[1]
        node = branch
    branch = list(node)
    start = 0
    if changes and not changes[0][0]:  # a key ending at this branch sets its value
        branch[16] = changes[0][1]
        start = 1
    children: dict[int, Node | bytes] = {}
    while start < len(changes):
        nibble = changes[start][0][0]
        end = start
        while end < len(changes) and changes[end][0][0] == nibble:
            end += 1
        children[nibble] = _update(branch[nibble], [(path[1:], value) for path, value
                                                    in changes[start:end]], db, nodes)
        start = end
    occupied = [i for i in range(16) if (children[i] if i in children else branch[i]) != BLANK]
    if len(occupied) > 1 or (occupied and branch[16] != BLANK):
        for nibble, child in children.items():
            branch[nibble] = _reference(child, nodes) if child != BLANK else BLANK
        return branch
    if not occupied:  # only a value (or nothing) is left
        return [_hex_prefix(b"", leaf=True), branch[16]] if branch[16] != BLANK else BLANK
    only = occupied[0]  # one child left: the branch collapses into it
    child = children[only] if only in children else _resolve(branch[only], db)
    return _canonical_extension(bytes([only]), child, nodes)


def _canonical_extension(prefix: Nibbles, child: Node | bytes,
                         nodes: MutableMapping[Hash32, bytes]) -> Node | bytes:
    """``prefix`` followed by ``child`` in canonical form: nothing under an empty child, a
    leaf's or extension's path extended, a branch behind an extension node."""
    if child == BLANK or not prefix:
        return child
    if len(child) == 2:
        path, is_leaf = _path_of(child[0])
        return [_hex_prefix(prefix + path, leaf=is_leaf), child[1]]
    return [_hex_prefix(prefix, leaf=False), _reference(child, nodes)]


def update_trie(db: MutableMapping[bytes, bytes], root: Hash32,
                changes: Mapping[bytes, bytes]) -> Hash32:
    """Apply key -> value changes (value ``b""``: delete) to the trie at ``root`` in ``db``
    in one pass; the new nodes are written to ``db``. Returns the new root hash."""
    if not changes:
        return root
    paths = sorted((_nibbles(key), value) for key, value in changes.items())
    node = _update(BLANK if root == BLANK_ROOT_HASH else root, paths, db, db)
    if node == BLANK:
        return BLANK_ROOT_HASH
    encoded = encode_node(node)
    new_root = keccak(encoded)
    db[new_root] = encoded
    _decoded[new_root] = node
    return new_root
