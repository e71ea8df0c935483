"""The one-pass block-trie builder against py-trie's incremental HexaryTrie, alone and in
blocks the node seals (header roots, transactions read back from the stored trie nodes)."""
import os

import pytest
import rlp
from eth.constants import BLANK_ROOT_HASH
from trie import HexaryTrie
from web3 import Web3

from chain.compile import compiled_market
from chain.devnet import dev_accounts
from chain.node import Node, NodeConfig
from chain.params import CHAIN_ID, MARKET_ADDRESS
from chain.tries import trie_root_and_nodes


class Encoded:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def encode(self) -> bytes:
        return self.data


def reference_root(values: list[bytes]) -> bytes:
    trie = HexaryTrie({}, BLANK_ROOT_HASH)
    for index, value in enumerate(values):
        trie[rlp.encode(index)] = value
    return trie.root_hash


# counts around the nibble and key-length boundaries of rlp(index): 16, 128, 256
@pytest.mark.parametrize("count", [0, 1, 2, 15, 16, 17, 127, 128, 129, 256, 257, 300])
@pytest.mark.parametrize("size", [1, 120])  # values inline in their parent or hashed
def test_root_and_nodes_match_py_trie(count, size):
    values = [os.urandom(size) for _ in range(count)]
    root, nodes = trie_root_and_nodes([Encoded(v) for v in values])
    assert root == reference_root(values)
    stored = HexaryTrie(nodes, root)
    assert [stored[rlp.encode(i)] for i in range(count)] == values
    assert rlp.encode(count) not in stored


def test_sealed_block_roots_match_py_trie_and_survive_restart(tmp_path):
    market = Web3().eth.contract(address=Web3.to_checksum_address(MARKET_ADDRESS),
                                 abi=compiled_market()["abi"])
    node = Node(NodeConfig(tmp_path / "a", block_time=0))
    raws = []
    for s, account in enumerate(dev_accounts(3)):
        for nonce in range(44):  # 132 transactions: keys up to rlp(131)
            data = market.encode_abi("submitJob", args=[bytes([s, nonce]) * 16, b"\1" * 32,
                                                        1, 8, 8, 8, 1, 50])
            tx = {"to": market.address, "data": data, "value": 10**12, "gas": 300_000,
                  "maxFeePerGas": 10**10, "maxPriorityFeePerGas": 1, "nonce": nonce,
                  "chainId": CHAIN_ID, "type": 2}
            raws.append(account.sign_transaction(tx).raw_transaction)
    for raw in raws:
        node.admit(raw)
    block = node.seal()
    assert len(block.transactions) == len(raws)
    receipts = block.get_receipts(node.chain.chaindb)
    assert all(r.state_root == b"\x01" and len(r.logs) == 1 for r in receipts)  # succeeded
    assert block.header.transaction_root == reference_root([tx.encode() for tx in
                                                            block.transactions])
    assert block.header.receipt_root == reference_root([r.encode() for r in receipts])
    node.stop()

    again = Node(NodeConfig(tmp_path / "a", block_time=0))
    stored = again.chain.get_canonical_block_by_number(block.number)
    assert [tx.encode() for tx in stored.transactions] == raws
    assert [r.encode() for r in stored.get_receipts(again.chain.chaindb)] == \
        [r.encode() for r in receipts]
    again.stop()
