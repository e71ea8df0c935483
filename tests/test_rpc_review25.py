"""JSON-RPC methods web3.py (and viem, ethers) call that the node lacked or answered unlike
geth, driven through web3.py against a real node process with real signed transactions.
References: the node's own eth_getTransactionByHash, eth_getBlockByNumber and
eth_getTransactionReceipt (each transaction found by block and index, each block's receipts),
eth-account's encoding of a typed transaction (its JSON, signed again, must hash to the
transaction's hash) and the hashes the node itself returned for the transactions sent (the
pending-transaction filter). Each test fails on the node before its fix."""
import httpx
import pytest
from eth_account.typed_transactions import TypedTransaction
from eth_hash.auto import keccak
from web3 import HTTPProvider, Web3

from chain.devnet import dev_accounts
from chain.params import CHAIN_ID

pytestmark = pytest.mark.timeout(180)
HTTP_TIMEOUT = 30
MAX_FEE = 10**11
# the fields of a transaction's JSON that are not what its sender signed
NOT_SIGNED = ("hash", "from", "blockHash", "blockNumber", "transactionIndex", "input", "v", "r",
              "s", "yParity")


def rpc(url: str, method: str, *params):
    reply = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": method,
                                  "params": list(params)}, timeout=HTTP_TIMEOUT).json()
    assert "result" in reply, reply
    return reply["result"]


def web3_of(node) -> Web3:
    return Web3(HTTPProvider(node.url, request_kwargs={"timeout": HTTP_TIMEOUT}))


def signed(account, nonce: int, tx_type: int, **fields) -> str:
    """A raw transfer of 1 wei of `account` of type 0, 1 or 2."""
    tx = {"to": "0x" + "00" * 19 + "01", "value": 1, "gas": 30_000, "nonce": nonce,
          "chainId": CHAIN_ID, **fields}
    if tx_type == 2:
        tx.update(maxFeePerGas=MAX_FEE, maxPriorityFeePerGas=1)
    else:
        tx["gasPrice"] = MAX_FEE
    if tx_type == 1:
        tx["accessList"] = [{"address": "0x" + "00" * 19 + "02", "storageKeys": ["0x" + "07" * 32]}]
    return "0x" + bytes(account.sign_transaction(tx).raw_transaction).hex()


def send_batch(node, raws: list[str]) -> list[str]:
    """The raw transactions in one batch (so that blocks hold several); their hashes."""
    batch = [{"jsonrpc": "2.0", "id": i, "method": "eth_sendRawTransaction", "params": [raw]}
             for i, raw in enumerate(raws)]
    replies = httpx.post(node.url, json=batch, timeout=HTTP_TIMEOUT).json()
    assert all("result" in reply for reply in replies), replies
    return [reply["result"] for reply in sorted(replies, key=lambda r: r["id"])]


def mined(node, *hashes: str) -> list[dict]:
    """The receipts of `hashes` once they left the mempool (the node's long poll)."""
    answer = httpx.get(f"{node.url}/wait", params={"tx": list(hashes), "timeout": 30},
                       timeout=60).json()
    assert None not in answer["receipts"], answer
    return answer["receipts"]


def nonce_of(node, account) -> int:
    return int(rpc(node.url, "eth_getTransactionCount", account.address, "pending"), 16)


@pytest.fixture(scope="module")
def blocks(node) -> list[int]:
    """Blocks holding transactions of all three types from three senders."""
    raws = []
    for account in dev_accounts(6)[3:]:
        nonce = nonce_of(node, account)
        raws += [signed(account, nonce + t, t) for t in range(3)]
    receipts = mined(node, *send_batch(node, raws))
    return sorted({int(r["blockNumber"], 16) for r in receipts})


def test_transactions_are_found_by_block_and_index(node, blocks):
    w3 = web3_of(node)
    for number in blocks:
        block = w3.eth.get_block(number)
        assert w3.eth.get_block_transaction_count(number) == len(block.transactions)
        assert w3.eth.get_block_transaction_count(block.hash) == len(block.transactions)
        for index, tx_hash in enumerate(block.transactions):
            expected = w3.eth.get_transaction(tx_hash)
            assert w3.eth.get_transaction_by_block(number, index) == expected
            assert w3.eth.get_transaction_by_block(block.hash, index) == expected
        # past the last transaction, and a block the node does not have: null, as geth
        past = hex(len(block.transactions))
        assert rpc(node.url, "eth_getTransactionByBlockNumberAndIndex", hex(number), past) is None
        assert rpc(node.url, "eth_getTransactionByBlockHashAndIndex", "0x" + block.hash.hex(),
                   past) is None
    beyond = hex(w3.eth.block_number + 1000)
    assert rpc(node.url, "eth_getTransactionByBlockNumberAndIndex", beyond, "0x0") is None
    assert rpc(node.url, "eth_getBlockTransactionCountByNumber", beyond) is None
    assert rpc(node.url, "eth_getBlockTransactionCountByHash", "0x" + "ab" * 32) is None
    assert w3.net.peer_count == 0


def test_block_receipts_are_each_transactions_receipt(node, blocks):
    w3 = web3_of(node)
    for number in blocks:
        block = w3.eth.get_block(number)
        expected = [w3.eth.get_transaction_receipt(h) for h in block.transactions]
        assert w3.eth.get_block_receipts(number) == expected
        assert w3.eth.get_block_receipts(block.hash) == expected
    assert rpc(node.url, "eth_getBlockReceipts", hex(w3.eth.block_number + 1000)) is None


@pytest.mark.parametrize("tx_type", [1, 2])
def test_a_typed_transaction_signed_again_from_its_json_has_its_hash(node, tx_type):
    """A script that re-signs (or re-serialises) a transaction it fetched: eth-account takes
    the fields the node returns. An access-list transaction came back with maxFeePerGas and
    maxPriorityFeePerGas as well (geth gives them only from type 2 on), and eth-account
    refused the dict (TypeError: Unknown kwargs)."""
    w3 = web3_of(node)
    account = dev_accounts(7)[6]
    tx_hash = send_batch(node, [signed(account, nonce_of(node, account), tx_type)])[0]
    mined(node, tx_hash)
    tx = rpc(node.url, "eth_getTransactionByHash", tx_hash)
    fields = {key: value for key, value in tx.items() if key not in NOT_SIGNED}
    if tx_type == 2:  # a dynamic-fee transaction's gasPrice is the price it paid (geth's too)
        del fields["gasPrice"]
    fields.update(data=tx["input"], v=tx["yParity"], r=tx["r"], s=tx["s"])
    assert "0x" + keccak(TypedTransaction.from_dict(fields).encode()).hex() == tx_hash
    assert w3.eth.get_transaction(tx_hash)["type"] == tx_type


def test_a_pending_transaction_filter_reports_each_new_transaction_once(node):
    """web3's filter("pending"): hashes of transactions that reached the pool since the last
    poll, whether still pending or mined meanwhile; none pending before it was installed."""
    w3 = web3_of(node)
    early, late = dev_accounts(9)[7:]
    early_nonce, late_nonce = nonce_of(node, early), nonce_of(node, late)
    before, = send_batch(node, [signed(early, early_nonce + 1, 2)])  # waits on a nonce gap
    pending_filter = w3.eth.filter("pending")
    waiting, = send_batch(node, [signed(late, late_nonce + 1, 2)])
    assert pending_filter.get_new_entries() == [Web3.to_bytes(hexstr=waiting)]
    # fill both gaps: all four are mined before the next poll
    filler, early_filler = send_batch(node, [signed(late, late_nonce, 2),
                                             signed(early, early_nonce, 0)])
    mined(node, before, waiting, filler, early_filler)
    assert set(pending_filter.get_new_entries()) == {Web3.to_bytes(hexstr=h)
                                                     for h in (filler, early_filler)}
    assert pending_filter.get_new_entries() == []
    assert w3.eth.uninstall_filter(pending_filter.filter_id)
