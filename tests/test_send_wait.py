"""POST /wait: a raw transaction admitted as eth_sendRawTransaction admits it, then the long
poll for its receipt, in one request; and ChainClient.send_and_wait on it and without it.

References: the node's own eth_sendRawTransaction (same errors) and
eth_getTransactionReceipt (same receipts), on a real node process."""
import threading

import httpx
import pytest
from eth_utils import keccak
from helpers import dev_clients
from web3.exceptions import Web3RPCError

from chain.client import ChainClient, TransactionReverted
from chain.devnet import dev_accounts

pytestmark = pytest.mark.timeout(120)
ETHER = 10**18


@pytest.fixture(scope="module")
def clients(node):
    with dev_clients(node.url, 4, timeout=4.0) as made:
        yield made


def rpc(node, method: str, *params):
    return httpx.post(node.url, json={"jsonrpc": "2.0", "id": 1, "method": method,
                                      "params": list(params)}).json()


def post_wait(node, raw: bytes | str, **params) -> httpx.Response:
    body = raw if isinstance(raw, str) else '"0x' + raw.hex() + '"'
    return httpx.post(f"{node.url}/wait", params={"timeout": 30, **params}, content=body,
                      timeout=60)


def register(client) -> bytes:
    return client.sign(client.market.functions.register(), value=ETHER, gas=200_000)


def test_one_request_admits_and_answers_the_receipts(node, clients):
    """The node advertises POST /wait; its answer carries the hash (keccak of the raw
    transaction) and the receipts of the query's `tx` and then the sent one, each as
    eth_getTransactionReceipt gives it."""
    client = clients[0]
    assert httpx.get(f"{node.url}/info").json()["send_and_wait"] is True
    first = register(client)
    first_hash = client.send_raw(first)
    second = client.sign(client.market.functions.workerStake(client.address), gas=100_000)
    answer = post_wait(node, second, tx="0x" + first_hash.hex()).json()
    assert answer["hash"] == "0x" + keccak(second).hex()
    expected = [rpc(node, "eth_getTransactionReceipt", h)["result"]
                for h in ("0x" + first_hash.hex(), answer["hash"])]
    assert answer["receipts"] == expected and answer["receipt"] == expected[0]
    assert [r["status"] for r in expected] == ["0x1", "0x1"]
    head = int(rpc(node, "eth_blockNumber")["result"], 16)
    assert answer["head"] == head and answer["gas_price"] > 0


def test_a_refused_transaction_answers_eth_sendRawTransactions_error(node, clients):
    """Replayed, corrupt (bad signature) and wrong-chain transactions get the error object
    eth_sendRawTransaction gives for the same bytes; a body that is not JSON gets JSON-RPC's
    parse error; a bad query is refused (400) before the transaction is admitted."""
    client = clients[1]
    raw = register(client)
    assert client.send_and_wait(raw)[1][0]["status"] == 1
    corrupt = bytearray(client.sign(client.market.functions.register(), value=ETHER,
                                    gas=200_000))
    client.forget_nonce()
    corrupt[-5] ^= 0xFF  # inside s: another signer or none
    wrong_chain = client.account.sign_transaction({
        "to": client.market.address, "value": 0, "gas": 50_000, "gasPrice": 10**9,
        "nonce": 0, "chainId": client.chain_id + 1}).raw_transaction
    for bad in (raw, bytes(corrupt), bytes(wrong_chain)):
        answer = post_wait(node, bad).json()
        reference = rpc(node, "eth_sendRawTransaction", "0x" + bad.hex())
        assert "error" in answer and answer["error"] == reference["error"]
        assert answer["id"] is None and "receipts" not in answer
    with pytest.raises(Web3RPCError, match="eth_sendRawTransaction refused.*already known|"
                                           "eth_sendRawTransaction refused.*nonce too low"):
        client.send_and_wait(raw)
    assert post_wait(node, "0x12 not json").json()["error"]["code"] == -32700
    pending = rpc(node, "eth_getTransactionCount", client.address, "pending")["result"]
    fresh = register(client)
    refused = post_wait(node, fresh, tx="0xzz")
    assert refused.status_code == 400 and "is not hex" in refused.json()["error"]
    assert rpc(node, "eth_getTransactionCount", client.address, "pending")["result"] == pending
    assert client.send_and_wait(fresh)[1][0]["status"] == 1


def test_a_poll_that_times_out_leaves_the_transaction_admitted(node, clients):
    """A transaction behind a nonce gap stays pending: POST /wait answers after its timeout
    with a null receipt and the transaction stays admitted; ChainClient.send_and_wait goes
    on waiting (its poll is capped at half its timeout) and returns the receipt once the
    gap is filled."""
    client = clients[2]
    first, second, third = (register(client) for _ in range(3))
    answer = post_wait(node, second, timeout=0.3).json()
    assert answer["receipts"] == [None] and answer["hash"] == "0x" + keccak(second).hex()
    assert rpc(node, "eth_getTransactionByHash", answer["hash"])["result"]["blockNumber"] \
        is None
    filler = threading.Timer(2.5, client.send_raw, (first,))  # after the 2 s poll
    filler.start()
    try:
        tx_hash, receipts = client.send_and_wait(third)
    finally:
        filler.join()
    assert tx_hash == keccak(third) and receipts[0]["status"] == 1
    assert receipts[0] == client.w3.eth.get_transaction_receipt(tx_hash)
    assert client.w3.eth.get_transaction_receipt(keccak(second))["status"] == 1


def test_client_sends_and_confirms_with_and_without_post_wait(node, clients):
    """ChainClient.send_signed confirms calls posted before it and its own, names a revert;
    without the node advertising POST /wait (another EVM node) it sends and polls in two
    requests with the same receipts."""
    client = clients[3]
    f = client.market.functions
    posted = [(f.register(), client.post(f.register(), value=ETHER, gas=200_000))]
    stake = f.workerStake(client.address)
    receipts = client.send_signed(stake, client.sign(stake, gas=100_000), after=posted)
    assert [r["status"] for r in receipts] == [1, 1]
    assert receipts == [client.w3.eth.get_transaction_receipt(r["transactionHash"])
                        for r in receipts]
    reverting = f.commitJobs([1], [b"\1" * 32] * 2)
    with pytest.raises(TransactionReverted, match="commitJobs reverted.*length mismatch"):
        client.send_signed(reverting, client.sign(reverting, gas=300_000))
    old_style = ChainClient(node.url, dev_accounts(4)[3].key, timeout=4.0)
    try:
        del old_style.info["send_and_wait"]
        receipt = old_style.send(stake, gas=100_000)
        assert receipt == old_style.w3.eth.get_transaction_receipt(receipt["transactionHash"])
        assert receipt["from"] == client.address and receipt["status"] == 1
    finally:
        old_style.close()
