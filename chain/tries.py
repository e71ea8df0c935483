"""A block's transaction and receipt tries, built in one pass.

py-evm builds them by inserting one index key at a time into py-trie, which decodes and
re-encodes the nodes on the key's path at every insert: about 15 % of sealing a block of
``submitJob`` transactions. Here the keys (``rlp(index)``) are sorted once and the
Merkle-Patricia trie is built bottom-up, each node encoded and hashed exactly once. The
root is the same (tests compare with py-trie); the nodes are exactly the reachable ones.
"""
from __future__ import annotations

from collections.abc import Sequence

import rlp
from eth.constants import BLANK_ROOT_HASH
from eth_hash.auto import keccak
from eth_typing import Hash32

Node = list  # [path, value] (leaf or extension) or 17 items (branch)
Nibbles = bytes  # one nibble per byte


def _nibbles(key: bytes) -> Nibbles:
    return bytes(n for byte in key for n in (byte >> 4, byte & 15))


def _hex_prefix(nibbles: Nibbles, leaf: bool) -> bytes:
    """Compact (hex-prefix) encoding of a node path (yellow paper, appendix C)."""
    flag = 2 * leaf + len(nibbles) % 2
    padded = bytes([flag] + ([] if len(nibbles) % 2 else [0])) + nibbles
    return bytes(padded[i] << 4 | padded[i + 1] for i in range(0, len(padded), 2))


def _common_prefix(a: Nibbles, b: Nibbles) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def _build(items: Sequence[tuple[Nibbles, bytes]], depth: int,
           nodes: dict[Hash32, bytes]) -> Node:
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


def _reference(node: Node, nodes: dict[Hash32, bytes]) -> Node | Hash32:
    """How a parent refers to a node: inline below 32 encoded bytes, else by hash."""
    encoded = rlp.encode(node)
    if len(encoded) < 32:
        return node
    node_hash = keccak(encoded)
    nodes[node_hash] = encoded
    return node_hash


def trie_root_and_nodes(items: Sequence) -> tuple[Hash32, dict[Hash32, bytes]]:
    """Root hash and nodes of the trie mapping ``rlp(i)`` to ``items[i].encode()``
    (drop-in for ``eth.db.trie.make_trie_root_and_nodes``)."""
    if not items:
        return BLANK_ROOT_HASH, {}
    keyed = sorted((_nibbles(rlp.encode(index)), item.encode())
                   for index, item in enumerate(items))
    nodes: dict[Hash32, bytes] = {}
    encoded = rlp.encode(_build(keyed, 0, nodes))
    root = keccak(encoded)
    nodes[root] = encoded
    return root, nodes
