"""JSON-RPC gaps against geth, on a real node process with real signed transactions and
contracts assembled here by hand: a log filter from a block still to come, the revert errors
of eth_call/eth_estimateGas (Error(string), Panic(uint256), no data), and the methods
eth_getRawTransactionByHash, eth_blobBaseFee and eth_createAccessList. References: the raw
bytes eth-account signed, eth-abi's encoding of the revert payloads, geth's panic reasons,
EIP-4844's fee formula over the head's excessBlobGas, eth_getLogs and the receipt of a real
access-list transaction. Each test fails on the node before its fix."""
import httpx
import pytest
from eth_abi import encode as abi_encode
from test_rpc_review25 import HTTP_TIMEOUT, MAX_FEE, mined, nonce_of, rpc, send_batch, signed

from chain.devnet import dev_accounts
from chain.params import CHAIN_ID

pytestmark = pytest.mark.timeout(180)
# runtime code: LOG0 of the calldata; REVERT with the calldata as revert data; SLOAD of the
# slot in calldata word 0 and BALANCE of the address in word 1
LOGGER = bytes.fromhex("365f5f37365fa000")
REVERTER = bytes.fromhex("365f5f37365ffd")
READER = bytes.fromhex("5f355450602035315000")


def init_code(runtime: bytes) -> bytes:
    """Creation code that returns `runtime` (CODECOPY of what follows its 10 bytes)."""
    n = len(runtime)
    return bytes([0x60, n, 0x60, 10, 0x5F, 0x39, 0x60, n, 0x5F, 0xF3]) + runtime


def reply_of(url: str, method: str, *params) -> dict:
    return httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": method,
                                 "params": list(params)}, timeout=HTTP_TIMEOUT).json()


def transaction(account, nonce: int, **fields) -> str:
    """A raw dynamic-fee transaction of `account` (a creation unless `to` is given)."""
    tx = {"value": 0, "gas": 200_000, "nonce": nonce, "chainId": CHAIN_ID, "data": "0x",
          "maxFeePerGas": MAX_FEE, "maxPriorityFeePerGas": 1, **fields}
    return "0x" + bytes(account.sign_transaction(tx).raw_transaction).hex()


@pytest.fixture(scope="module")
def contracts(node) -> dict[str, str]:
    """The three contracts, deployed by real transactions; their addresses by name."""
    account = dev_accounts(1)[0]
    nonce = nonce_of(node, account)
    names = {"logger": LOGGER, "reverter": REVERTER, "reader": READER}
    raws = [transaction(account, nonce + i, data="0x" + init_code(code).hex())
            for i, code in enumerate(names.values())]
    receipts = mined(node, *send_batch(node, raws))
    assert all(r["status"] == "0x1" for r in receipts), receipts
    return dict(zip(names, (r["contractAddress"] for r in receipts), strict=True))


def test_a_log_filter_from_a_block_still_to_come_reports_its_logs_once_sealed(node, contracts):
    """geth installs a filter whose fromBlock is ahead of the head; the node refused it
    ("block N not found"). Polls before that block come report nothing, and none of the
    blocks before it (a poll moved the filter's start back to the head)."""
    account = dev_accounts(2)[1]
    head = int(rpc(node.url, "eth_blockNumber"), 16)
    start = head + 2
    fid = rpc(node.url, "eth_newFilter", {"fromBlock": hex(start),
                                          "address": contracts["logger"]})
    assert rpc(node.url, "eth_getFilterChanges", fid) == []
    assert rpc(node.url, "eth_getFilterLogs", fid) == []
    nonce = nonce_of(node, account)
    early, = mined(node, *send_batch(node, [transaction(account, nonce, to=contracts["logger"],
                                                         data="0x0a")]))
    assert int(early["blockNumber"], 16) < start
    assert rpc(node.url, "eth_getFilterChanges", fid) == []
    late, = mined(node, *send_batch(node, [transaction(account, nonce + 1,
                                                        to=contracts["logger"], data="0x0b")]))
    assert int(late["blockNumber"], 16) >= start
    expected = rpc(node.url, "eth_getLogs", {"fromBlock": late["blockNumber"],
                                             "toBlock": late["blockNumber"],
                                             "address": contracts["logger"]})
    assert [log["data"] for log in expected] == ["0x0b"]
    assert rpc(node.url, "eth_getFilterChanges", fid) == expected
    assert rpc(node.url, "eth_getFilterChanges", fid) == []
    assert rpc(node.url, "eth_getFilterLogs", fid) == expected


ERROR_STRING = bytes.fromhex("08c379a0") + abi_encode(["string"], ["not enough stake"])
PANIC_OVERFLOW = bytes.fromhex("4e487b71") + abi_encode(["uint256"], [0x11])
PANIC_UNKNOWN = bytes.fromhex("4e487b71") + abi_encode(["uint256"], [0x99])


@pytest.mark.parametrize("method", ["eth_call", "eth_estimateGas"])
@pytest.mark.parametrize("revert_data, message", [
    (ERROR_STRING, "execution reverted: not enough stake"),
    (PANIC_OVERFLOW, "execution reverted: arithmetic underflow or overflow"),
    (PANIC_UNKNOWN, "execution reverted: unknown panic code: 0x99"),
    (b"", "execution reverted"),
], ids=["error-string", "panic", "unknown-panic", "no-data"])
def test_a_revert_is_reported_as_geth_reports_it(node, contracts, method, revert_data,
                                                 message):
    """As geth: a revert is code 3 with its data and, for Error(string) and Panic(uint256),
    the decoded reason in the message (geth's words for the panic codes); a revert without
    data has no data field. A panic read "execution reverted" only, and an empty revert
    came with data "0x"."""
    call = {"from": dev_accounts(1)[0].address, "to": contracts["reverter"],
            "data": "0x" + revert_data.hex()}
    error = reply_of(node.url, method, call)["error"]
    expected = {"code": 3, "message": message}
    if revert_data:
        expected["data"] = "0x" + revert_data.hex()
    assert error == expected


def test_a_raw_transaction_is_the_signed_bytes_pending_or_mined(node):
    """eth_getRawTransactionByHash (web3's get_raw_transaction) was "method not found"."""
    account = dev_accounts(3)[2]
    nonce = nonce_of(node, account)
    raws = [signed(account, nonce + t, t) for t in range(3)]
    gapped = signed(account, nonce + 4, 2)  # waits on nonce + 3: stays pending
    hashes = send_batch(node, [*raws, gapped])
    mined(node, *hashes[:3])
    for tx_hash, raw in zip(hashes, [*raws, gapped], strict=True):
        assert rpc(node.url, "eth_getRawTransactionByHash", tx_hash) == raw
    assert rpc(node.url, "eth_getTransactionByHash", hashes[3])["blockNumber"] is None
    assert rpc(node.url, "eth_getRawTransactionByHash", "0x" + "ab" * 32) is None


def fake_exponential(factor: int, numerator: int, denominator: int) -> int:
    """EIP-4844's integer approximation of factor * e ** (numerator / denominator)."""
    i, output, accumulator = 1, 0, factor * denominator
    while accumulator > 0:
        output += accumulator
        accumulator = accumulator * numerator // (denominator * i)
        i += 1
    return output // denominator


def test_the_blob_base_fee_is_the_heads_by_eip_4844(node):
    """eth_blobBaseFee (web3's blob_base_fee, viem's getBlobBaseFee) was "method not
    found"; geth answers the fee of the head's excessBlobGas (Prague's update fraction)."""
    head = rpc(node.url, "eth_getBlockByNumber", "latest", False)
    expected = fake_exponential(1, int(head["excessBlobGas"], 16), 5_007_716)
    assert int(rpc(node.url, "eth_blobBaseFee"), 16) == expected


def test_an_access_list_lists_what_the_call_touched_and_its_gas_is_the_real_one(node,
                                                                               contracts):
    """eth_createAccessList was "method not found". The list (geth's: the slots read or
    written, the other accounts touched, less the sender, the recipient without slots and
    the precompiles) sent in a real access-list transaction costs what the node said."""
    account = dev_accounts(4)[3]
    other = dev_accounts(5)[4].address
    slot = 7
    data = "0x" + abi_encode(["uint256", "address"], [slot, other]).hex()
    call = {"from": account.address, "to": contracts["reader"], "data": data}
    answer = rpc(node.url, "eth_createAccessList", call)
    assert sorted(answer["accessList"], key=lambda entry: entry["address"]) == sorted([
        {"address": contracts["reader"], "storageKeys": ["0x" + f"{slot:064x}"]},
        {"address": other, "storageKeys": []},
    ], key=lambda entry: entry["address"])
    assert "error" not in answer
    raw = transaction(account, nonce_of(node, account), to=contracts["reader"], data=data,
                      accessList=answer["accessList"])
    receipt, = mined(node, *send_batch(node, [raw]))
    assert receipt["status"] == "0x1"
    assert receipt["gasUsed"] == answer["gasUsed"]


def test_a_gas_estimate_pays_for_the_calls_access_list(node, contracts):
    """web3's build_transaction estimates a type-1 transaction with its accessList in the
    call; the node ignored the list, whose entries are paid for (2400 gas an address, 1900 a
    slot, EIP-2930), and the transaction sent with that estimate was refused."""
    account = dev_accounts(6)[5]
    data = "0x" + abi_encode(["uint256", "address"], [3, account.address]).hex()
    access_list = [{"address": "0x" + f"{i:040x}",
                    "storageKeys": ["0x" + f"{k:064x}" for k in range(5)]}
                   for i in range(0x100, 0x105)]
    call = {"from": account.address, "to": contracts["reader"], "data": data,
            "accessList": access_list}
    estimate = int(rpc(node.url, "eth_estimateGas", call), 16)
    raw = transaction(account, nonce_of(node, account), to=contracts["reader"], data=data,
                      accessList=access_list, gas=estimate)
    receipt, = mined(node, *send_batch(node, [raw]))
    assert receipt["status"] == "0x1"
    assert int(receipt["gasUsed"], 16) <= estimate


def test_the_html_docs_pages_are_off_and_the_schema_stays(node):
    """FastAPI's /docs and /redoc load their scripts from a CDN: blank on an offline node,
    third-party code on the node's origin where they load."""
    for page in ("/docs", "/redoc"):
        assert httpx.get(node.url + page, timeout=HTTP_TIMEOUT).status_code == 404, page
    schema = httpx.get(node.url + "/openapi.json", timeout=HTTP_TIMEOUT)
    assert schema.status_code == 200 and "/info" in schema.json()["paths"]
