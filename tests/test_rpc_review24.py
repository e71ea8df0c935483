"""JSON-RPC conformance with what web3.py and geth clients send, against a real node process
over HTTP with real signed transactions. References: web3.py's block_identifier given as a
block hash (geth's BlockNumberOrHash reads a 66-character block parameter as one), geth's
state override set for eth_call and eth_estimateGas (checked against the chain's own storage,
balances and CREATE addresses), eth_feeHistory's reward percentiles weighted by gas used
(geth's definition, computed here from the receipts), `"params": null` (geth takes it as no
params) and filter ids that outlive nothing (geth's are random). Each test fails on the node
before its fix."""
import json

import httpx
import pytest
import rlp
from eth_hash.auto import keccak
from web3 import HTTPProvider, Web3

from chain.devnet import dev_accounts
from chain.launch import NodeProcess
from chain.node import Node, NodeConfig
from chain.params import CHAIN_ID
from chain.rpc import Rpc

pytestmark = pytest.mark.timeout(180)
HTTP_TIMEOUT = 30  # every answer here is immediate, or a mined block away
GWEI = 10**9
EMPTY = "0x" + "5a" * 20  # an address with no code, no balance, no storage
# returns the storage word at the slot given as the call's first 32 bytes
SLOT_READER = bytes.fromhex("600035546000526020" "6000f3")
# returns the caller's balance
CALLER_BALANCE = bytes.fromhex("33316000526020" "6000f3")
# creates an empty contract and returns its address (the creator's nonce picks it)
CREATOR = bytes.fromhex("600060006000f0" "6000526020" "6000f3")


def rpc(url: str, method: str, *params) -> dict:
    return httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": method,
                                 "params": list(params)}, timeout=HTTP_TIMEOUT).json()


def result(url: str, method: str, *params):
    reply = rpc(url, method, *params)
    assert "result" in reply, reply
    return reply["result"]


def word(value: int) -> str:
    return "0x" + value.to_bytes(32, "big").hex()


def send(url: str, account, **fields) -> str:
    """Sign and send a type-2 transaction of `account`; its hash."""
    tx = {"to": "0x" + "00" * 19 + "01", "value": 0, "gas": 21_000, "maxFeePerGas": 10**11,
          "maxPriorityFeePerGas": 1, "chainId": CHAIN_ID, "type": 2, **fields}
    raw = "0x" + bytes(account.sign_transaction(tx).raw_transaction).hex()
    return result(url, "eth_sendRawTransaction", raw)


def mined(url: str, *hashes: str) -> list[dict]:
    """The receipts of `hashes` once they left the mempool (the node's long poll)."""
    answer = httpx.get(f"{url}/wait", params={"tx": list(hashes), "timeout": 30},
                       timeout=60).json()
    assert None not in answer["receipts"], answer
    return answer["receipts"]


def nonce_of(url: str, account) -> int:
    return int(result(url, "eth_getTransactionCount", account.address, "pending"), 16)


def deploy_reader(url: str, account) -> str:
    """SLOT_READER deployed with slot 0 = 7 and slot 1 = 9 stored by its constructor."""
    stores = bytes.fromhex("6007600055" "6009600155")
    copy = bytes([0x60, len(SLOT_READER), 0x80, 0x60, len(stores) + 11, 0x60, 0, 0x39,
                  0x60, 0, 0xF3])
    receipt, = mined(url, send(url, account, to=None, gas=200_000, nonce=nonce_of(url, account),
                               data=stores + copy + SLOT_READER))
    assert receipt["status"] == "0x1", receipt
    return receipt["contractAddress"]


def test_a_block_hash_names_the_block_of_a_state_query(node):
    """web3.py sends a block_identifier given as a hash as a bare 66-character string, which
    geth reads as the block's hash; the node read it as a block number far beyond the head
    and answered 'block 1073...365 not found'. Each state query at a hash now equals the
    same query at that block's number (a transfer in between tells them apart)."""
    account = dev_accounts(2)[1]
    w3 = Web3(HTTPProvider(node.url, request_kwargs={"timeout": HTTP_TIMEOUT}))
    before = w3.eth.get_block("latest")
    mined(node.url, send(node.url, account, nonce=nonce_of(node.url, account), value=GWEI))
    by_number = w3.eth.get_balance(account.address, before.number)
    assert by_number != w3.eth.get_balance(account.address, "latest")
    assert w3.eth.get_balance(account.address, before.hash) == by_number
    assert w3.eth.get_transaction_count(account.address, before.hash) == \
        w3.eth.get_transaction_count(account.address, before.number)
    assert w3.eth.get_code(account.address, before.hash) == b""
    unknown = rpc(node.url, "eth_getBalance", account.address, "0x" + "ab" * 32)
    assert unknown["error"]["code"] == -32000 and "not found" in unknown["error"]["message"]


def test_state_overrides_change_what_a_call_sees(node):
    """geth's state override set (eth_call's third parameter: balance, nonce, code, and the
    whole storage or some slots per address) was accepted and ignored: a call to code set
    by an override answered "0x", one paying value from an empty account was 'insufficient
    funds'. The references are the chain's own storage and balances, and the CREATE
    address of the overridden nonce; the chain itself is left as it was."""
    url, account = node.url, dev_accounts(3)[2]
    reader = deploy_reader(url, account)
    slot = [word(0), word(1)]

    def call(to: str, data: str = "0x", **overrides) -> str:
        return result(url, "eth_call", {"to": to, "data": data}, "latest", overrides)

    assert [call(reader, s) for s in slot] == [word(7), word(9)]
    assert [call(reader, s, **{reader: {"stateDiff": {slot[1]: word(5)}}}) for s in slot] == \
        [word(7), word(5)]
    assert [call(reader, s, **{reader: {"state": {slot[1]: word(5)}}}) for s in slot] == \
        [word(0), word(5)]
    assert call(EMPTY, slot[0], **{EMPTY: {"code": "0x" + SLOT_READER.hex(),
                                           "stateDiff": {slot[0]: word(42)}}}) == word(42)
    rich = {"from": EMPTY, "to": reader, "value": hex(GWEI)}
    funded = {EMPTY: {"balance": hex(3 * GWEI)}}
    assert result(url, "eth_call", rich, "latest", funded) == word(7)
    assert int(result(url, "eth_estimateGas", rich, "latest", funded), 16) >= 21_000
    assert result(url, "eth_call", {"from": EMPTY, "to": account.address}, "latest",
                  {account.address: {"code": "0x" + CALLER_BALANCE.hex()}, **funded}) == \
        word(3 * GWEI)
    created = keccak(rlp.encode([bytes.fromhex(EMPTY[2:]), 5]))[12:]
    assert call(EMPTY, **{EMPTY: {"code": "0x" + CREATOR.hex(), "nonce": "0x5"}}) == \
        "0x" + created.rjust(32, b"\0").hex()
    assert result(url, "eth_getStorageAt", reader, "0x0") == word(7)
    assert result(url, "eth_getCode", EMPTY) == "0x"
    assert result(url, "eth_getBalance", EMPTY) == "0x0"


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "stock"])
def test_overridden_slots_are_original_values_on_both_execution_paths(tmp_path, fast):
    """Overrides act as if an earlier transaction had written them (geth finalises them
    before the call): SSTORE of a new value to an overridden slot costs a clean slot's
    2,900 gas plus 2,100 cold (EIP-2929/2200), not a dirty one's 100. On py-evm's stock path
    an override's storage failed the call with -32603 ('No checkpoint ... was found')."""
    node = Node(NodeConfig(tmp_path / "data", fast_execution=fast))
    try:
        # PUSH1 2, PUSH1 0, SSTORE, GAS, then the gas left is returned
        code = "0x6002600055" "5a" "6000526020" "6000f3"
        reply = Rpc(node).handle({"jsonrpc": "2.0", "id": 1, "method": "eth_call", "params": [
            {"to": EMPTY}, "latest", {EMPTY: {"code": code, "stateDiff": {word(0): word(1)}}}]})
        message_gas = node.head().gas_limit - 21_000
        assert reply.get("result") == word(message_gas - 3 - 3 - (2_100 + 2_900) - 2), reply
    finally:
        node.stop()


@pytest.mark.parametrize("overrides, block_overrides, named", [
    ({EMPTY: {"balance": "0x1", "codeHash": "0x00"}}, None, "codeHash"),
    ({EMPTY: {"state": {}, "stateDiff": {}}}, None, "both"),
    ({EMPTY: {"stateDiff": {"0x00": word(1)}}}, None, "32 bytes"),
    ([], None, "object"),
    (None, {"number": "0x1"}, "block overrides"),
])
def test_overrides_that_cannot_be_applied_are_invalid_params(node, overrides, block_overrides,
                                                             named):
    """An override the node cannot apply is refused naming it, never ignored."""
    for method in ("eth_call", "eth_estimateGas"):
        error = rpc(node.url, method, {"to": EMPTY}, "latest", overrides,
                    block_overrides)["error"]
        assert error["code"] == -32602 and named in error["message"], (method, error)


def geth_rewards(receipts: list[dict], tips: list[int], percentiles: list[float]) -> list[int]:
    """eth_feeHistory's rewards of one block by their definition: for each percentile p,
    the least tip whose transactions and all cheaper ones used at least p% of the block's
    gas."""
    used = [int(r["gasUsed"], 16) for r in receipts]
    total = sum(used)
    rewards = []
    for p in percentiles:
        enough = [t for t in sorted(set(tips))
                  if sum(u for u, tip in zip(used, tips, strict=True) if tip <= t)
                  >= int(total * p / 100)]
        rewards.append(enough[0] if enough else max(tips))
    return rewards


def test_fee_history_rewards_are_weighted_by_gas_used(node):
    """One block of three transactions (tips 3, 1, 2 gwei; the 2 gwei one uses most gas):
    each percentile's reward is the tip at which the gas used, cheapest first, reaches
    that share of the block's (geth's definition). The node counted transactions instead:
    its 25th percentile was 1 gwei and its 75th 3 gwei, where 2 gwei used that gas."""
    url, account = node.url, dev_accounts(4)[3]
    first = nonce_of(url, account)
    tips = [3 * GWEI, 1 * GWEI, 2 * GWEI]
    datas = ["0x", "0x", "0x" + "ff" * 1000]  # 40,000 gas of calldata floor (EIP-7623)
    # the later nonces wait behind the gap until the first arrives: all three in one block
    hashes = [send(url, account, nonce=first + i, maxPriorityFeePerGas=tips[i],
                   data=datas[i], gas=100_000) for i in (1, 2, 0)]
    receipts = mined(url, *hashes)
    assert len({r["blockNumber"] for r in receipts}) == 1, receipts
    block = receipts[0]["blockNumber"]
    percentiles = [0, 10, 25, 50, 75, 90, 100]
    history = result(url, "eth_feeHistory", "0x1", block, percentiles)
    assert history["oldestBlock"] == block
    in_sent_order = [tips[1], tips[2], tips[0]]  # as the receipts (sent 1, 2, 0)
    assert [int(r, 16) for r in history["reward"][0]] == \
        geth_rewards(receipts, in_sent_order, percentiles)
    assert history["reward"][0][2] == hex(2 * GWEI)  # 25 %: the cheapest used only 21,000


def test_null_params_are_no_params(node):
    """`"params": null` is read as no params by geth ("our own client used to send it");
    the node answered invalid params to eth_blockNumber."""
    reply = httpx.post(node.url, content=json.dumps({"jsonrpc": "2.0", "id": 7,
                                                     "method": "eth_blockNumber",
                                                     "params": None}),
                       headers={"content-type": "application/json"},
                       timeout=HTTP_TIMEOUT).json()
    assert reply == {"jsonrpc": "2.0", "id": 7, "result": result(node.url, "eth_blockNumber")}


def test_a_filter_id_from_before_a_restart_is_not_found(tmp_path):
    """Filter ids were counted from 1 at every start: after a restart, a client polling its
    log filter got the block hashes of a filter another client had just installed (web3's
    log formatter then fails on them) instead of 'filter not found', which tells it to
    install its filter again."""
    data_dir = tmp_path / "data"
    with NodeProcess(data_dir, block_time=0) as first:
        old = result(first.url, "eth_newFilter", {"fromBlock": "latest"})
    with NodeProcess(data_dir, block_time=0) as second:
        assert result(second.url, "eth_newBlockFilter")  # another client's, after the restart
        account = dev_accounts(1)[0]
        mined(second.url, send(second.url, account, nonce=nonce_of(second.url, account)))
        reply = rpc(second.url, "eth_getFilterChanges", old)
        assert reply.get("error", {}).get("code") == -32000, reply
        assert "not found" in reply["error"]["message"]
