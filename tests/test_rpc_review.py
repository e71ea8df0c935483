"""JSON-RPC 2.0 conformance and transaction admission against a real node process over HTTP,
with real signed transactions. The references are the JSON-RPC 2.0 specification (ids,
notifications, batches, error codes), RFC 8259 (what JSON is), geth's reading of log filters
(EIP-234, null in a topic list), and the Prague transaction-validity rules (EIP-7623's
calldata floor, EIP-3860's initcode limit): each test fails on the node before its fix."""
import json
import sqlite3

import httpx
import pytest
from eth_hash.auto import keccak
from web3 import HTTPProvider, Web3
from web3.exceptions import Web3RPCError

from chain.client import ChainClient
from chain.compile import compiled_market
from chain.db import DATABASE_FILE, SqliteDB
from chain.devnet import dev_accounts
from chain.params import CHAIN_ID

pytestmark = pytest.mark.timeout(180)
HTTP_TIMEOUT = 15  # every answer here is immediate, or a mined block away
MARKET = "0x000000000000000000000000000000000000c0DE"
POOL = "0x0000000000000000000000000000000000000FEE"
EOA = "0x" + "22" * 20  # an address with no code


def post(node, body) -> httpx.Response:
    """POST a JSON-RPC body (bytes as they are, anything else as JSON)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(node.url, content=content, timeout=HTTP_TIMEOUT,
                      headers={"content-type": "application/json"})


def strict_json(response: httpx.Response):
    """The reply parsed as RFC 8259 JSON: NaN and Infinity are not JSON."""
    def refuse(name):
        raise AssertionError(f"reply is not JSON: it holds {name}: {response.text[:200]}")
    return json.loads(response.content, parse_constant=refuse)


def rpc(node, method: str, *params):
    return strict_json(post(node, {"jsonrpc": "2.0", "id": 1, "method": method,
                                   "params": list(params)}))


def pending_nonce(node, address: str) -> int:
    return int(rpc(node, "eth_getTransactionCount", address, "pending")["result"], 16)


def sign(account, **fields) -> str:
    tx = {"to": POOL, "value": 1, "gas": 21_000, "maxFeePerGas": 10**11,
          "maxPriorityFeePerGas": 1, "chainId": CHAIN_ID, "type": 2, **fields}
    return "0x" + bytes(account.sign_transaction(tx).raw_transaction).hex()


def tx_hash(raw: str) -> str:
    return "0x" + keccak(bytes.fromhex(raw[2:])).hex()


def receipt_of(node, raw: str) -> dict | None:
    """The receipt once the transaction left the mempool (the node's long poll)."""
    return httpx.get(f"{node.url}/wait", params={"tx": tx_hash(raw), "timeout": 30},
                     timeout=60).json()["receipt"]


# --- JSON-RPC 2.0 framing ------------------------------------------------------------------------

def test_deeply_nested_json_is_refused_and_the_node_lives(node):
    """~100k nested arrays (200 kB) overflowed the C stack in json.loads (py_ecc raises the
    recursion limit to 100,000) and killed the node with SIGSEGV. Now it is an error, the node
    answers on, and brackets inside strings do not count as nesting."""
    for body in (b"[" * 100_000 + b"]" * 100_000,
                 b'{"jsonrpc":"2.0","id":1,"method":"eth_chainId","params":' + b"[" * 60_000,
                 b'{"x":' * 100_000):
        reply = strict_json(post(node, body))
        assert reply["id"] is None and reply["error"]["code"] in (-32600, -32700), reply
    assert rpc(node, "eth_chainId")["result"] == hex(CHAIN_ID)
    odd_id = '\\"' + "[" * 5_000 + "{" * 5_000 + "\\\\"  # brackets in a string, escapes
    body = ('{"jsonrpc":"2.0","id":"' + odd_id + '","method":"eth_chainId"}').encode()
    reply = strict_json(post(node, body))
    assert reply["result"] == hex(CHAIN_ID)
    assert reply["id"] == json.loads('"' + odd_id + '"')
    nested_ok = {"jsonrpc": "2.0", "id": 2, "method": "eth_chainId", "params": []}
    batch = [nested_ok] * 300  # many brackets in all, little depth: served as usual
    assert [r["result"] for r in strict_json(post(node, batch))] == [hex(CHAIN_ID)] * 300


def test_notifications_are_never_answered(node):
    """JSON-RPC 2.0: 'The Server MUST NOT reply to a Notification, including those that are
    within a batch request' (not even with an error), and a batch of notifications only is
    answered with nothing at all, not an empty array. A notification still runs."""
    for notification in ({"jsonrpc": "2.0", "method": "no_such_method"},
                         {"jsonrpc": "2.0", "method": "eth_getBalance", "params": ["0x12"]},
                         {"jsonrpc": "2.0", "method": "eth_chainId", "params": {"a": 1}},
                         [{"jsonrpc": "2.0", "method": "eth_chainId"},
                          {"jsonrpc": "2.0", "method": "no_such_method"}]):
        reply = post(node, notification)
        assert reply.status_code == 204 and reply.content == b"", (notification, reply.text)
    mixed = strict_json(post(node, [{"jsonrpc": "2.0", "method": "no_such_method"},
                                    {"jsonrpc": "2.0", "id": "x", "method": "eth_chainId"},
                                    {"jsonrpc": "2.0", "method": "eth_getBalance"}]))
    assert mixed == [{"jsonrpc": "2.0", "id": "x", "result": hex(CHAIN_ID)}]
    account = dev_accounts(11)[10]
    nonce = pending_nonce(node, account.address)
    raw = sign(account, nonce=nonce)
    sent = post(node, {"jsonrpc": "2.0", "method": "eth_sendRawTransaction", "params": [raw]})
    assert sent.status_code == 204
    assert receipt_of(node, raw)["status"] == "0x1"
    assert pending_nonce(node, account.address) == nonce + 1


@pytest.mark.parametrize("rid", ["abc", "", '"[{', 0, -7, 2**70, 1.5, -0.25, None],
                         ids=repr)
def test_ids_of_every_valid_type_are_echoed(node, rid):
    reply = strict_json(post(node, {"jsonrpc": "2.0", "id": rid, "method": "eth_chainId"}))
    assert reply == {"jsonrpc": "2.0", "id": rid, "result": hex(CHAIN_ID)}
    error = strict_json(post(node, {"jsonrpc": "2.0", "id": rid, "method": "no_such"}))
    assert error["id"] == rid and error["error"]["code"] == -32601


@pytest.mark.parametrize("body", [
    pytest.param(b'{"jsonrpc":"2.0","id":[1],"method":"eth_chainId"}', id="array-id"),
    pytest.param(b'{"jsonrpc":"2.0","id":{"a":1},"method":"eth_chainId"}', id="object-id"),
    pytest.param(b'{"jsonrpc":"2.0","id":true,"method":"eth_chainId"}', id="bool-id"),
    pytest.param(b'{"jsonrpc":"2.0","id":1e400,"method":"eth_chainId"}', id="overflowing-id"),
    pytest.param(b'{"jsonrpc":"1.0","id":1,"method":"eth_chainId"}', id="version-1.0"),
    pytest.param(b'{"id":1,"method":"eth_chainId"}', id="no-version"),
    pytest.param(b'{"jsonrpc":2.0,"id":1,"method":"eth_chainId"}', id="version-a-number"),
])
def test_invalid_request_objects_are_invalid_requests(node, body):
    """An id must be a string, a number or null, and "jsonrpc" exactly "2.0": otherwise the
    request is an Invalid Request (-32600) answered with id null, and the answer is JSON
    (an id of 1e400 was written back as the non-JSON `Infinity`)."""
    reply = strict_json(post(node, body))
    assert reply["id"] is None and reply["error"]["code"] == -32600, reply


@pytest.mark.parametrize("body", [b'{"jsonrpc":"2.0","id":NaN,"method":"eth_chainId"}',
                                  b'{"jsonrpc":"2.0","id":1,"method":"eth_feeHistory",'
                                  b'"params":["0x1","latest",[-Infinity]]}'],
                         ids=["nan-id", "infinity-param"])
def test_non_json_number_literals_are_a_parse_error(node, body):
    reply = strict_json(post(node, body))
    assert reply == {"jsonrpc": "2.0", "id": None,
                     "error": {"code": -32700, "message": "parse error: body is not JSON"}}


# --- methods ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def registration(node) -> dict:
    """A block with a market log: WorkerRegistered(worker indexed, stake)."""
    client = ChainClient(node.url, dev_accounts(14)[13].key)
    try:
        client.send(client.market.functions.register(), value=10**18)
    finally:
        client.close()
    logs = rpc(node, "eth_getLogs", {"fromBlock": "0x0", "address": MARKET,
                                     "topics": [None, "0x" + "00" * 12 +
                                                dev_accounts(14)[13].address[2:].lower()]})
    assert len(logs["result"]) == 1, logs
    return logs["result"][0]


def test_a_null_in_a_topic_list_matches_any_topic(node, registration):
    """geth reads a null among a position's alternatives as 'any topic there'; it was refused
    as malformed. The reference: the same filter with that position left open."""
    span = {"fromBlock": "0x0", "toBlock": registration["blockNumber"], "address": MARKET}
    reference = rpc(node, "eth_getLogs", {**span, "topics": [None, registration["topics"][1]]})
    assert registration in reference["result"]
    missing = "0x" + "00" * 32
    for first in ([None, missing], [missing, None], [None]):
        found = rpc(node, "eth_getLogs", {**span, "topics": [first, registration["topics"][1]]})
        assert found == reference, (first, found)
    none = rpc(node, "eth_getLogs", {**span, "topics": [[missing], registration["topics"][1]]})
    assert none["result"] == []


def test_malformed_log_filters_are_invalid_params(node, registration):
    """Five topic positions can match no log (LOG4 is the most) and gave a silent empty list
    (geth refuses them); EIP-234: blockHash excludes fromBlock/toBlock (the range was
    ignored)."""
    too_many = rpc(node, "eth_getLogs", {"fromBlock": "0x0", "topics": [None] * 5})
    assert too_many["error"]["code"] == -32602 and "topics" in too_many["error"]["message"]
    for extra in ({"fromBlock": "0x0"}, {"toBlock": "latest"}):
        both = rpc(node, "eth_getLogs", {"blockHash": registration["blockHash"], **extra})
        assert both["error"]["code"] == -32602, both
        assert "blockHash" in both["error"]["message"]
    alone = rpc(node, "eth_getLogs", {"blockHash": registration["blockHash"]})
    assert registration in alone["result"]
    assert rpc(node, "eth_newFilter", {"topics": [None] * 5})["error"]["code"] == -32602


@pytest.mark.parametrize("full", ["false", "yes", 0, 1, [True]], ids=repr)
def test_the_full_transactions_flag_must_be_a_boolean(node, registration, full):
    """eth_getBlockByNumber/ByHash's second parameter is a boolean; the string "false" was
    read by bool() as true and answered full transaction objects."""
    number, block_hash = registration["blockNumber"], registration["blockHash"]
    for method, block in (("eth_getBlockByNumber", number), ("eth_getBlockByHash", block_hash)):
        reply = rpc(node, method, block, full)
        assert reply["error"]["code"] == -32602 and "full" in reply["error"]["message"], reply
        hashes = rpc(node, method, block, False)["result"]["transactions"]
        assert hashes == [registration["transactionHash"]]
        objects = rpc(node, method, block, True)["result"]["transactions"]
        assert [t["hash"] for t in objects] == hashes
        assert rpc(node, method, block, None)["result"]["transactions"] == hashes  # as geth


def test_a_call_with_less_gas_than_intrinsic_is_a_clear_error(node):
    """eth_call with gas below the intrinsic 21000 was -32603 'internal error' (py-evm's
    negative message gas); it is geth's -32000 'intrinsic gas too low'."""
    sender = dev_accounts(1)[0].address
    for method in ("eth_call", "eth_estimateGas"):
        reply = rpc(node, method, {"from": sender, "to": EOA, "gas": "0x1"})
        assert reply["error"]["code"] == -32000, reply
        assert "intrinsic gas too low" in reply["error"]["message"]
    assert rpc(node, "eth_call", {"from": sender, "to": EOA, "gas": hex(21_000)})["result"] == "0x"


def test_estimate_gas_stays_within_the_callers_allowance(node):
    """geth: eth_estimateGas searches within the call's `gas` and fails with 'gas required
    exceeds allowance' when the call needs more; the node ignored `gas` and answered more
    than the caller allowed."""
    w3 = Web3(HTTPProvider(node.url))
    market = w3.eth.contract(address=MARKET, abi=compiled_market()["abi"])
    sender = dev_accounts(15)[14].address
    call = {"from": sender, "to": MARKET, "value": hex(10**18),
            "data": market.encode_abi("register")}
    needed = int(rpc(node, "eth_estimateGas", call)["result"], 16)
    assert needed > 30_000
    short = rpc(node, "eth_estimateGas", {**call, "gas": hex(30_000)})
    assert short["error"]["code"] == -32000, short
    assert "exceeds allowance" in short["error"]["message"]
    with pytest.raises(Web3RPCError, match="exceeds allowance"):
        w3.eth.estimate_gas({**call, "value": 10**18, "gas": 30_000})
    roomy = int(rpc(node, "eth_estimateGas", {**call, "gas": hex(10**7)})["result"], 16)
    assert roomy == needed


def floor_gas(data: bytes) -> int:
    """EIP-7623 as the EIP writes it: 21000 + 10 * (zero bytes + 4 * non-zero bytes)."""
    zeros = data.count(0)
    return 21_000 + 10 * (zeros + 4 * (len(data) - zeros))


def test_transactions_below_the_calldata_floor_are_refused(node):
    """EIP-7623 (Prague): a transaction whose gas limit is below its calldata floor is
    invalid. The node admitted one and mined it with gasUsed 61000 above its 37000 limit,
    charging the sender more than the gas it signed for; and eth_estimateGas answered less
    than the floor. Now admission refuses it, and the estimate is a gas limit that works."""
    account = dev_accounts(16)[15]
    data = b"\x01" * 1000
    intrinsic = 21_000 + 16 * len(data)
    floor = floor_gas(data)
    assert intrinsic < floor
    nonce = pending_nonce(node, account.address)
    balance = int(rpc(node, "eth_getBalance", account.address, "latest")["result"], 16)
    below = sign(account, nonce=nonce, to=EOA, value=0, gas=intrinsic, data=data)
    refused = rpc(node, "eth_sendRawTransaction", below)
    assert refused["error"]["code"] == -32000, refused
    assert "intrinsic gas too low" in refused["error"]["message"]
    assert rpc(node, "eth_getTransactionByHash", tx_hash(below))["result"] is None
    in_batch = strict_json(post(node, [{"jsonrpc": "2.0", "id": i, "method":
                                        "eth_sendRawTransaction", "params": [below]}
                                       for i in range(2)]))  # a batch decodes apart
    assert all("intrinsic gas too low" in r["error"]["message"] for r in in_batch), in_batch
    assert pending_nonce(node, account.address) == nonce
    assert int(rpc(node, "eth_getBalance", account.address, "latest")["result"], 16) == balance
    estimate = int(rpc(node, "eth_estimateGas", {"from": account.address, "to": EOA,
                                                 "data": "0x" + data.hex()})["result"], 16)
    assert estimate >= floor
    raw = sign(account, nonce=nonce, to=EOA, value=0, gas=estimate, data=data)
    assert rpc(node, "eth_sendRawTransaction", raw)["result"] == tx_hash(raw)
    receipt = receipt_of(node, raw)
    assert receipt["status"] == "0x1"
    assert int(receipt["gasUsed"], 16) == floor <= estimate  # never above the gas limit


def test_creations_above_the_initcode_limit_are_refused(node):
    """EIP-3860: initcode above 49152 bytes makes a creation invalid (geth's pool refuses it);
    the node admitted it and mined it as a failure that burned all its gas. The largest
    allowed initcode is admitted and deploys."""
    account = dev_accounts(17)[16]
    nonce = pending_nonce(node, account.address)
    balance = int(rpc(node, "eth_getBalance", account.address, "latest")["result"], 16)
    fields = {"to": None, "value": 0, "gas": 1_000_000, "maxFeePerGas": 10**10}
    too_big = sign(account, nonce=nonce, data=b"\x00" * 49_153, **fields)
    refused = rpc(node, "eth_sendRawTransaction", too_big)
    assert refused["error"]["code"] == -32000, refused
    assert "initcode" in refused["error"]["message"]
    assert rpc(node, "eth_getTransactionByHash", tx_hash(too_big))["result"] is None
    assert pending_nonce(node, account.address) == nonce
    assert int(rpc(node, "eth_getBalance", account.address, "latest")["result"], 16) == balance
    largest = sign(account, nonce=nonce, data=b"\x00" * 49_152, **fields)
    assert rpc(node, "eth_sendRawTransaction", largest)["result"] == tx_hash(largest)
    receipt = receipt_of(node, largest)
    assert receipt["status"] == "0x1" and receipt["contractAddress"] is not None


def test_set_code_transactions_are_refused(node):
    """EIP-7702 (type 4) lets a signature give an account code; the protocol offers legacy
    and EIP-1559 transactions only (docs/protocol.md), and the node admitted type 4 (its
    JSON even lacked the authorization list). Refused now, nothing spent; a type-2
    transaction from the same account is still admitted."""
    account, delegate = dev_accounts(19)[18], dev_accounts(20)[19]
    nonce = pending_nonce(node, account.address)
    auth = account.sign_authorization({"chainId": CHAIN_ID, "address": delegate.address,
                                       "nonce": nonce + 1})
    set_code = sign(account, nonce=nonce, type=4, gas=100_000, accessList=[],
                    authorizationList=[auth])
    refused = rpc(node, "eth_sendRawTransaction", set_code)
    assert refused["error"]["code"] == -32000, refused
    assert "type 4" in refused["error"]["message"]
    assert pending_nonce(node, account.address) == nonce
    plain = sign(account, nonce=nonce)
    assert rpc(node, "eth_sendRawTransaction", plain)["result"] == tx_hash(plain)
    assert receipt_of(node, plain)["status"] == "0x1"


def test_refused_and_repeated_transactions_lose_nothing(node):
    """Admission's nonce and balance rules through the wire: a transaction behind a nonce gap
    waits (pending nonce unchanged), the same bytes again are 'already known', wrong chain,
    unprotected, underpriced, unaffordable and malformed ones are refused with the reason;
    filling the gap mines both, and a replay of a mined one is 'nonce too low'."""
    account = dev_accounts(18)[17]
    nonce = pending_nonce(node, account.address)
    later = sign(account, nonce=nonce + 1)
    assert rpc(node, "eth_sendRawTransaction", later)["result"] == tx_hash(later)
    assert pending_nonce(node, account.address) == nonce
    again = rpc(node, "eth_sendRawTransaction", later)["error"]
    assert again["code"] == -32000 and "already known" in again["message"]
    legacy = {"to": POOL, "value": 1, "gas": 21_000, "gasPrice": 10**11, "nonce": nonce}
    refusals = [
        (sign(account, nonce=nonce, chainId=1), "chain id"),
        ("0x" + bytes(account.sign_transaction(legacy).raw_transaction).hex(),
         "replay-protected"),
        (sign(account, nonce=nonce, maxFeePerGas=1, maxPriorityFeePerGas=1), "base fee"),
        (sign(account, nonce=nonce, value=10**30), "insufficient funds"),
        (sign(account, nonce=nonce)[:-2], "decoded"),
    ]
    for raw, reason in refusals:
        error = rpc(node, "eth_sendRawTransaction", raw)["error"]
        assert error["code"] == -32000 and reason in error["message"], (reason, error)
        assert pending_nonce(node, account.address) == nonce
    first = sign(account, nonce=nonce)
    assert rpc(node, "eth_sendRawTransaction", first)["result"] == tx_hash(first)
    assert receipt_of(node, first)["status"] == "0x1"
    assert receipt_of(node, later)["status"] == "0x1"
    assert int(rpc(node, "eth_getTransactionCount", account.address, "latest")["result"],
               16) == nonce + 2
    replay = rpc(node, "eth_sendRawTransaction", first)["error"]
    assert replay["code"] == -32000 and "nonce too low" in replay["message"]
    unknown = rpc(node, "eth_getTransactionReceipt", "0x" + "ab" * 32)
    assert unknown == {"jsonrpc": "2.0", "id": 1, "result": None}


# --- the key-value store -----------------------------------------------------------------------

def test_a_block_whose_commit_fails_leaves_the_store_consistent(tmp_path):
    """A flush whose COMMIT fails (here a deferred constraint that a second connection put on
    the table; in a node an I/O error or a full disk) must leave nothing of the block: the
    transaction stayed open, so the store served the failed block's rows as if stored and
    every later block failed to flush ("cannot start a transaction within a transaction").
    After the failure, the node discards the block (as ``Node.seal`` does) and goes on; a
    reopened store holds exactly the blocks that were flushed."""
    path = tmp_path / DATABASE_FILE
    store = SqliteDB(path)
    store[b"block-1"] = b"one"
    store.flush()
    poison = sqlite3.connect(path)
    poison.executescript("""
        CREATE TABLE parent (id INTEGER PRIMARY KEY);
        CREATE TABLE child (p INTEGER REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED);
        CREATE TRIGGER poison AFTER INSERT ON kv WHEN NEW.key = x'ff'
            BEGIN INSERT INTO child VALUES (1); END;
    """)
    poison.close()
    store._conn.execute("PRAGMA foreign_keys=ON")  # checked at COMMIT, which then fails
    try:
        store[b"\xff"] = b"poison"
        store[b"block-2"] = b"two"
        with pytest.raises(sqlite3.IntegrityError):
            store.flush()
        store.discard()
        with pytest.raises(KeyError):
            store[b"block-2"]  # noqa: B018  (a read: the failed block is not stored)
        store[b"block-3"] = b"three"
        assert store.flush() == 1
    finally:
        store.close()
    reopened = SqliteDB(path)
    try:
        assert reopened[b"block-1"] == b"one" and reopened[b"block-3"] == b"three"
        for missing in (b"block-2", b"\xff"):
            with pytest.raises(KeyError):
                reopened[missing]  # noqa: B018
    finally:
        reopened.close()
