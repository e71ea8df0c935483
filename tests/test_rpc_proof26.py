"""eth_getProof (EIP-1186, as geth answers it) on a real node process with real signed
transactions. Every proof is checked here, by a verifier of its own (not the node's code
path): its nodes are walked from the block's stateRoot (eth_getBlockByNumber), each node
must hash to the reference its parent holds, and the leaf reached (or the place where the
key leaves the trie) must be the account or slot value the node answered. The values are
compared with eth_getBalance, eth_getTransactionCount, eth_getCode, eth_getStorageAt and
the market's own totalStaked(). The method was "method not found" before."""
import sqlite3

import httpx
import pytest
import rlp
from eth_hash.auto import keccak
from eth_utils import to_checksum_address
from test_rpc_methods26 import contracts, reply_of, transaction  # noqa: F401 (a fixture)
from test_rpc_review25 import mined, nonce_of, rpc, send_batch

from chain.db import DATABASE_FILE
from chain.devnet import dev_accounts
from chain.launch import NodeProcess

pytestmark = pytest.mark.timeout(180)
MARKET = to_checksum_address("0x000000000000000000000000000000000000c0de")
BLANK_ROOT = keccak(rlp.encode(b""))
EMPTY_CODE_HASH = keccak(b"")
ABSENT = to_checksum_address("0x" + "de" * 20)
STAKE = 10**18  # the market's minStake
SLOTS = range(16)  # the market's plain variables lie in its first slots


def proven_value(root: bytes, key: bytes, proof: list[str]) -> bytes:
    """The value the `proof` proves at `key` in the trie at `root` (b"": no such key). Each
    node must be the one its parent refers to (by keccak, or inlined in it), from the root
    down, and the proof must hold no node besides those on the key's path."""
    nodes = [bytes.fromhex(node[2:]) for node in proof]
    path, ref, used = key.hex(), root, 0  # the path as hex digits: one nibble each
    if root == BLANK_ROOT:
        assert nodes == []
        return b""
    while True:
        if isinstance(ref, list):  # a node under 32 bytes, inlined in its parent
            node = ref
        else:
            assert used < len(nodes), "the proof ends before the key's path does"
            assert keccak(nodes[used]) == ref, f"node {used} is not the one its parent names"
            node, used = rlp.decode(nodes[used]), used + 1
        if len(node) == 17:  # a branch
            if not path:
                value = node[16]
                break
            ref, path = node[int(path[0], 16)], path[1:]
            if ref == b"":
                value = b""
                break
            continue
        flag = node[0][0] >> 4  # hex-prefix: bit 1 a leaf, bit 0 an odd path
        node_path = node[0].hex()[2 - (flag & 1):]
        if flag & 2:
            value = node[1] if node_path == path else b""
            break
        if not path.startswith(node_path):
            value = b""
            break
        ref, path = node[1], path[len(node_path):]
    assert used == len(nodes), "the proof holds nodes off the key's path"
    return value


def state_root(node, block: str) -> bytes:
    return bytes.fromhex(rpc(node.url, "eth_getBlockByNumber", block, False)["stateRoot"][2:])


def checked_proof(node, address: str, keys: list[str], block: str) -> dict:
    """eth_getProof's answer at `block`, its account and slot proofs verified."""
    answer = rpc(node.url, "eth_getProof", address, keys, block)
    root = state_root(node, block)
    leaf = proven_value(root, keccak(bytes.fromhex(address[2:])), answer["accountProof"])
    fields = rlp.decode(leaf) if leaf else [b"", b"", BLANK_ROOT, EMPTY_CODE_HASH]
    assert [int.from_bytes(fields[0], "big"), int.from_bytes(fields[1], "big"),
            fields[2], fields[3]] == [int(answer["nonce"], 16), int(answer["balance"], 16),
                                      bytes.fromhex(answer["storageHash"][2:]),
                                      bytes.fromhex(answer["codeHash"][2:])]
    assert answer["address"].lower() == address.lower()
    assert [entry["key"] for entry in answer["storageProof"]] == keys
    for entry in answer["storageProof"]:
        slot = int(entry["key"], 16).to_bytes(32, "big")
        value = proven_value(fields[2], keccak(slot), entry["proof"])
        assert int(entry["value"], 16) == int.from_bytes(rlp.decode(value) if value else b"",
                                                         "big")
    return answer


def test_an_accounts_proof_proves_its_balance_nonce_and_code(node, contracts):  # noqa: F811
    """An EOA with balance and a nonce, and a contract with code and no storage."""
    sender = dev_accounts(1)[0].address
    for address in (sender, contracts["reader"]):
        answer = checked_proof(node, address, [], "latest")
        assert answer["balance"] == rpc(node.url, "eth_getBalance", address, "latest")
        assert answer["nonce"] == rpc(node.url, "eth_getTransactionCount", address, "latest")
        code = bytes.fromhex(rpc(node.url, "eth_getCode", address, "latest")[2:])
        assert answer["codeHash"] == "0x" + keccak(code).hex()
        assert answer["storageProof"] == []
    assert int(rpc(node.url, "eth_getBalance", sender, "latest"), 16) > 0
    assert int(rpc(node.url, "eth_getTransactionCount", sender, "latest"), 16) > 0
    reader = checked_proof(node, contracts["reader"], ["0x0"], "latest")
    assert reader["storageHash"] == "0x" + BLANK_ROOT.hex()
    assert reader["storageProof"] == [{"key": "0x0", "value": "0x0", "proof": []}]


def test_the_markets_slots_set_and_unset_are_proven(node):
    """Two workers stake in the market (real storage writes); its first slots, set or not,
    and a slot never written are proven at their eth_getStorageAt values, the stake total
    among them. A key is answered back as geth does: a 32-byte key as sent, else a
    quantity."""
    workers = dev_accounts(12)[10:]
    register = "0x" + keccak(b"register()")[:4].hex()
    receipts = mined(node, *send_batch(node, [
        transaction(worker, nonce_of(node, worker), to=MARKET, value=STAKE, data=register)
        for worker in workers]))
    assert all(receipt["status"] == "0x1" for receipt in receipts), receipts
    unset = "0x" + "ab" * 32
    keys = [hex(slot) for slot in SLOTS] + [unset, "0x" + "00" * 31 + "04"]
    answer = checked_proof(node, MARKET, keys, "latest")
    values = [int(entry["value"], 16) for entry in answer["storageProof"]]
    expected = [int(rpc(node.url, "eth_getStorageAt", MARKET, key, "latest"), 16)
                for key in keys]
    assert values == expected
    total = rpc(node.url, "eth_call", {"to": MARKET,
                                       "data": "0x" + keccak(b"totalStaked()")[:4].hex()})
    assert int(total, 16) == len(workers) * STAKE
    assert values.count(int(total, 16)) >= 1  # totalStaked's slot, proven set
    assert values[len(SLOTS)] == 0 and answer["storageProof"][len(SLOTS)]["proof"]
    assert answer["storageProof"][len(SLOTS)]["key"] == unset
    assert answer["storageProof"][-1]["key"] == "0x" + "00" * 31 + "04"
    assert answer["storageHash"] != "0x" + BLANK_ROOT.hex()


def test_an_absent_account_gets_an_exclusion_proof_of_the_empty_account(node):
    answer = checked_proof(node, ABSENT, ["0x1"], "latest")
    assert answer["accountProof"]
    assert {key: answer[key] for key in ("balance", "nonce", "codeHash", "storageHash")} == {
        "balance": "0x0", "nonce": "0x0", "codeHash": "0x" + EMPTY_CODE_HASH.hex(),
        "storageHash": "0x" + BLANK_ROOT.hex()}
    assert answer["storageProof"] == [{"key": "0x1", "value": "0x0", "proof": []}]


def test_an_older_blocks_proof_is_of_its_own_state(node):
    """After the account sends a transaction (sealed in a later block), the proof at the
    earlier block still proves the earlier balance and nonce from that block's root."""
    account = dev_accounts(14)[13]
    before = rpc(node.url, "eth_blockNumber")
    old = checked_proof(node, account.address, [], before)
    receipt, = mined(node, *send_batch(node, [transaction(account, nonce_of(node, account),
                                                          to=ABSENT, value=5)]))
    assert int(receipt["blockNumber"], 16) > int(before, 16)
    again = checked_proof(node, account.address, [], before)
    assert again == old
    assert old["balance"] == rpc(node.url, "eth_getBalance", account.address, before)
    new = checked_proof(node, account.address, [], "latest")
    assert int(new["nonce"], 16) == int(old["nonce"], 16) + 1
    assert new["balance"] != old["balance"]
    assert int(checked_proof(node, ABSENT, [], "latest")["balance"], 16) >= 5


@pytest.mark.parametrize("params, code", [
    (["0x1234", []], -32602),  # an address of 2 bytes
    ([ABSENT, ["0x" + f"{k:064x}" for k in range(1025)]], -32602),  # too many keys
    ([ABSENT, ["0x" + "00" * 33]], -32602),  # a key longer than 32 bytes
    ([ABSENT, ["0xzz"]], -32602),  # a key that is not hex
    ([ABSENT, "0x01"], -32602),  # keys not an array
    ([ABSENT, [], "0xffffff"], -32000),  # a block past the head
    ([ABSENT, [], "0x" + "ab" * 32], -32000),  # an unknown block hash
], ids=["bad-address", "too-many-keys", "long-key", "non-hex-key", "keys-not-array",
        "future-block", "unknown-hash"])
def test_bad_requests_are_clear_errors(node, params, code):
    error = reply_of(node.url, "eth_getProof", *params)["error"]
    assert error["code"] == code, error


def test_many_keys_in_one_request_are_each_proven(node):
    """The most keys allowed (1024) are all answered, in order."""
    keys = ["0x" + f"{k:064x}" for k in range(1024)]
    answer = httpx.post(node.url, json={"jsonrpc": "2.0", "id": 1, "method": "eth_getProof",
                                        "params": [MARKET, keys, "latest"]},
                        timeout=60).json()["result"]
    assert [entry["key"] for entry in answer["storageProof"]] == keys


def test_a_block_whose_state_is_not_held_is_a_clear_error(tmp_path):
    """The node keeps every block's state; a database missing an old block's state root
    (deleted here from the stopped node's sqlite file) is answered -32000 naming the block,
    not an internal error, and the head's proofs still verify."""
    account = dev_accounts(15)[14]
    with NodeProcess(tmp_path / "data", block_time=0) as proc:
        mined(proc, *send_batch(proc, [transaction(account, 0, to=ABSENT, value=1)]))
        old = state_root(proc, "0x1")
        mined(proc, *send_batch(proc, [transaction(account, 1, to=ABSENT, value=1)]))
    with sqlite3.connect(tmp_path / "data" / DATABASE_FILE) as db:
        assert db.execute("DELETE FROM kv WHERE key = ?", (old,)).rowcount == 1
    with NodeProcess(tmp_path / "data", block_time=0) as proc:
        error = reply_of(proc.url, "eth_getProof", account.address, [], "0x1")["error"]
        assert error["code"] == -32000 and "block 1" in error["message"], error
        # other state queries: -32000 naming the node (was -32603 with a bytes repr)
        for method, params in (("eth_getBalance", [account.address, "0x1"]),
                               ("eth_getStorageAt", [account.address, "0x0", "0x1"])):
            error = reply_of(proc.url, method, *params)["error"]
            assert error == {"code": -32000, "message": f"missing trie node 0x{old.hex()}: "
                                                        "this block's state is not held"}
        checked_proof(proc, account.address, ["0x0"], "latest")
