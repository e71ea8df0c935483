"""Malformed requests and refused transactions against a real node process: each gets the
documented error (docs/chain.md "JSON-RPC", docs/protocol.md "long poll") at once, naming
what is wrong, and nothing is admitted or mined. A block built around admission with a
transaction that breaks EIP-1559's fee rule does not include it."""
import httpx
import pytest
import rlp
from eth.vm.forks.prague.transactions import PragueTransactionBuilder
from eth_hash.auto import keccak
from web3 import HTTPProvider, Web3
from web3.exceptions import Web3RPCError

from chain.client import ChainClient
from chain.devnet import dev_accounts
from chain.node import Node, NodeConfig
from chain.params import CHAIN_ID

pytestmark = pytest.mark.timeout(120)
SECP256K1_N = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141
POOL = "0x0000000000000000000000000000000000000FEE"
MARKET = "0x000000000000000000000000000000000000c0DE"
HTTP_TIMEOUT = 10  # every answer here is immediate; a hang fails the test


def rpc(node, method: str, *params) -> dict:
    return httpx.post(node.url, json={"jsonrpc": "2.0", "id": 1, "method": method,
                                      "params": list(params)}, timeout=HTTP_TIMEOUT).json()


def transfer(account, nonce: int, **fields) -> bytes:
    tx = {"to": POOL, "value": 1, "gas": 21_000, "maxFeePerGas": 10**11,
          "maxPriorityFeePerGas": 1, "nonce": nonce, "chainId": CHAIN_ID, "type": 2, **fields}
    return bytes(account.sign_transaction(tx).raw_transaction)


def with_high_s(raw: bytes) -> bytes:
    """The same type-2 transaction signed by the same key with the other valid signature,
    (r, n - s) and the other y parity: what a malleating relay could send."""
    fields = rlp.decode(raw[1:])
    y_parity, s = int.from_bytes(fields[-3], "big"), int.from_bytes(fields[-1], "big")
    return raw[:1] + rlp.encode([*fields[:-3], 1 - y_parity, fields[-2], SECP256K1_N - s])


def pending_nonce(node, account) -> int:
    return int(rpc(node, "eth_getTransactionCount", account.address, "pending")["result"], 16)


def assert_refused(node, raw: bytes, code: int, *words: str) -> None:
    """eth_sendRawTransaction refuses `raw` with `code`, naming `words`; nothing pending."""
    reply = rpc(node, "eth_sendRawTransaction", "0x" + raw.hex())
    assert reply["error"]["code"] == code, reply
    assert all(word in reply["error"]["message"] for word in words), reply
    assert rpc(node, "eth_getTransactionByHash", "0x" + keccak(raw).hex())["result"] is None


def test_a_high_s_signature_is_refused_at_admission(node):
    """EIP-2: a malleable twin (s > n/2) recovers the same sender but is refused at once,
    and the original, low-s transaction with the same nonce is then admitted and mined."""
    account = dev_accounts(4)[3]
    nonce = pending_nonce(node, account)
    original = transfer(account, nonce)
    twin = with_high_s(original)
    recovered = PragueTransactionBuilder.decode(twin)
    assert recovered.sender.hex() == account.address[2:].lower()
    assert recovered.s > SECP256K1_N // 2
    assert_refused(node, twin, -32000, "invalid signature")
    assert pending_nonce(node, account) == nonce
    tx_hash = rpc(node, "eth_sendRawTransaction", "0x" + original.hex())["result"]
    receipt = httpx.get(f"{node.url}/wait", params={"tx": tx_hash, "timeout": 30},
                        timeout=60).json()["receipt"]
    assert receipt["status"] == "0x1"


def test_a_tip_above_the_fee_cap_is_refused_at_admission(node):
    account = dev_accounts(5)[4]
    nonce = pending_nonce(node, account)
    raw = transfer(account, nonce, maxFeePerGas=10**11, maxPriorityFeePerGas=10**11 + 1)
    assert_refused(node, raw, -32000, "maxPriorityFeePerGas", "maxFeePerGas")
    assert pending_nonce(node, account) == nonce


def test_a_block_does_not_include_a_tip_above_the_fee_cap(tmp_path):
    """The rule is the VM's too: a transaction put in the mempool past admission is dropped
    when the block is built, and its sender's state is unchanged."""
    node = Node(NodeConfig(tmp_path / "node", block_time=0, seal_on_pending=False,
                           decode_process=False))
    try:
        account = dev_accounts(1)[0]
        tx = PragueTransactionBuilder.decode(transfer(account, 0, maxFeePerGas=10**11,
                                                      maxPriorityFeePerGas=10**11 + 1))
        balance = node.state_at().get_balance(tx.sender)
        node.mempool.add(tx)
        block = node.seal()
        assert block.transactions == ()
        assert node.state_at().get_balance(tx.sender) == balance
        assert node.state_at().get_nonce(tx.sender) == 0
    finally:
        node.stop()


def test_a_call_sending_more_than_the_balance_is_insufficient_funds(node):
    """eth_call and eth_estimateGas with a value above the sender's balance answer geth's
    -32000 "insufficient funds for transfer" (web3 raises it); the whole balance is fine."""
    sender = dev_accounts(6)[5].address
    balance = int(rpc(node, "eth_getBalance", sender, "latest")["result"], 16)
    for method in ("eth_call", "eth_estimateGas"):
        too_much = rpc(node, method, {"from": sender, "to": POOL, "value": hex(balance + 1)})
        assert too_much["error"] == {"code": -32000, "message": "insufficient funds for transfer"}
        assert "result" in rpc(node, method, {"from": sender, "to": POOL, "value": hex(balance)})
    w3 = Web3(HTTPProvider(node.url))
    with pytest.raises(Web3RPCError, match="insufficient funds for transfer"):
        w3.eth.call({"from": sender, "to": POOL, "value": balance + 1})


ADDRESS = dev_accounts(1)[0].address
MISSING_HASH = "0x" + "00" * 32
BAD_PARAMS = [  # method, params, words the -32602 message names
    pytest.param("eth_getBalance", [ADDRESS, -1], ["block"], id="negative-block"),
    pytest.param("eth_getBalance", [ADDRESS, {"blockHash": "0x12"}], ["blockHash", "32 bytes"],
                 id="short-block-hash-object"),
    pytest.param("eth_getStorageAt", [MARKET, hex(2**256), "latest"], ["slot"],
                 id="slot-above-uint256"),
    pytest.param("eth_getLogs", [5], ["filter"], id="filter-not-an-object"),
    pytest.param("eth_getLogs", [{"address": "nope"}], ["address"], id="bad-log-address"),
    pytest.param("eth_getLogs", [{"address": MARKET, "topics": ["0x12"]}],
                 ["topics[0]", "32 bytes"], id="short-topic"),
    pytest.param("eth_newFilter", [{"topics": [None, ["0x12"]]}], ["topics[1]"],
                 id="short-topic-in-a-set"),
    pytest.param("eth_getBlockByNumber", ["zz", False], ["block"], id="bad-block-number"),
    pytest.param("eth_getBlockByNumber", ["1f", False], ["block"], id="hex-without-0x"),
    pytest.param("eth_getBlockByNumber", ["0x_1", False], ["block"], id="hex-underscore"),
    pytest.param("eth_getBlockByNumber", [True, False], ["block"], id="bool-block-number"),
    pytest.param("eth_getBlockByNumber", [1.5, False], ["block"], id="float-block-number"),
    pytest.param("eth_feeHistory", [" 0x2", "latest", []], ["blockCount"],
                 id="quantity-with-space"),
    pytest.param("eth_getBlockByHash", ["0x12", False], ["blockHash", "32 bytes"],
                 id="short-block-hash"),
    pytest.param("eth_getTransactionReceipt", ["0x12"], ["hash", "32 bytes"],
                 id="short-tx-hash"),
    pytest.param("eth_feeHistory", ["0x2", "latest", [500, -1]],
                 ["rewardPercentiles", "0 and 100"], id="percentiles-out-of-range"),
    pytest.param("eth_feeHistory", ["0x2", "latest", [50, 10]],
                 ["rewardPercentiles", "non-decreasing"], id="percentiles-decreasing"),
    pytest.param("eth_getBalance", [], ["eth_getBalance", "missing parameter 1 (address)"],
                 id="missing-address"),
    pytest.param("eth_getStorageAt", [MARKET], ["eth_getStorageAt",
                                                "missing parameter 2 (slot)"], id="missing-slot"),
    pytest.param("eth_chainId", [1], ["eth_chainId", "at most 0 parameters, got 1"],
                 id="extra-param"),
]


@pytest.mark.parametrize(("method", "params", "words"), BAD_PARAMS)
def test_bad_params_are_invalid_params_naming_the_parameter(node, method, params, words):
    error = rpc(node, method, *params)["error"]
    assert error["code"] == -32602, error
    assert all(word in error["message"] for word in words), error
    assert "rpc_" not in error["message"] and "Rpc." not in error["message"], error


def test_well_formed_params_of_missing_things_still_answer(node):
    """The boundaries of the checks above: the largest slot, an unknown block or hash (null,
    as geth), an empty topic match; each as an independent read says."""
    slot = rpc(node, "eth_getStorageAt", MARKET, hex(2**256 - 1), "latest")["result"]
    assert slot == "0x" + "00" * 32
    head = int(rpc(node, "eth_blockNumber")["result"], 16)
    assert rpc(node, "eth_getBlockByNumber", hex(head + 1000), False)["result"] is None
    assert rpc(node, "eth_getBlockByHash", MISSING_HASH, False)["result"] is None
    assert rpc(node, "eth_getBalance", ADDRESS, {"blockHash": MISSING_HASH})["error"][
        "code"] == -32000
    logs = rpc(node, "eth_getLogs", {"address": [MARKET.lower()], "fromBlock": "0x0",
                                     "topics": [MISSING_HASH]})
    assert logs["result"] == []
    client = ChainClient(node.url, dev_accounts(9)[8].key)  # a log to match: a registration
    client.send(client.market.functions.register(), value=10**18)
    client.close()
    head = int(rpc(node, "eth_blockNumber")["result"], 16)
    everything = {"address": [MARKET.lower()], "fromBlock": "0x0", "toBlock": hex(head)}
    any_topic = rpc(node, "eth_getLogs", {**everything, "topics": [[]]})["result"]
    assert any_topic and any_topic == rpc(node, "eth_getLogs", everything)["result"]  # [] is any
    backwards = rpc(node, "eth_getLogs", {"fromBlock": hex(head), "toBlock": "0x0"})
    assert backwards["error"]["code"] == -32602 and "fromBlock" in backwards["error"]["message"]
    as_int = rpc(node, "eth_getBlockByNumber", 0, False)["result"]  # a JSON integer, as
    assert as_int == rpc(node, "eth_getBlockByNumber", "0x0", False)["result"]  # some send
    history = rpc(node, "eth_feeHistory", "0x2", "latest", [0, 50, 50, 100])["result"]
    assert len(history["reward"]) == len(history["gasUsedRatio"])
    assert all(len(rewards) == 4 for rewards in history["reward"])


def test_a_json_null_body_is_an_invalid_request(node):
    for path in ("/", "/rpc"):
        reply = httpx.post(f"{node.url}{path}", content=b"null",
                           headers={"content-type": "application/json"}, timeout=HTTP_TIMEOUT)
        assert reply.status_code == 200
        assert reply.json()["error"]["code"] == -32600
    account = dev_accounts(8)[7]
    nonce = pending_nonce(node, account)
    for body in (b"null", b"5", b'{"raw": "0x00"}'):
        reply = httpx.post(f"{node.url}/wait", params={"timeout": 1}, content=body,
                           headers={"content-type": "application/json"}, timeout=HTTP_TIMEOUT)
        assert reply.status_code == 400 and "body" in reply.json()["error"], reply.text
    assert pending_nonce(node, account) == nonce


@pytest.mark.parametrize(("query", "named"), [
    pytest.param({"block": 999_999, "timeout": "nan"}, "timeout", id="nan-timeout"),
    pytest.param({"block": 999_999, "timeout": "inf"}, "timeout", id="inf-timeout"),
    pytest.param({"block": 999_999, "timeout": "-inf"}, "timeout", id="minus-inf-timeout"),
    pytest.param({"tx": "0x12", "timeout": 1}, "tx", id="short-tx"),
    pytest.param({"tx": [MISSING_HASH, "0x" + "00" * 31], "timeout": 1}, "tx",
                 id="second-tx-short"),
])
def test_a_bad_long_poll_parameter_is_a_400_naming_it(node, query, named):
    reply = httpx.get(f"{node.url}/wait", params=query, timeout=HTTP_TIMEOUT)
    assert reply.status_code == 400, reply.text
    assert named in reply.json()["error"]


def test_a_long_poll_with_a_finite_timeout_answers_with_the_head(node):
    head = int(rpc(node, "eth_blockNumber")["result"], 16)
    answer = httpx.get(f"{node.url}/wait", params={"block": head + 1000, "timeout": 0.2},
                       timeout=HTTP_TIMEOUT).json()
    assert answer["head"] >= head
