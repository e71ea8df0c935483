"""Log filters whose range starts in the past, as geth keeps them, on a real node process: a
poll returns only the logs of blocks sealed since the filter was installed (the first poll
returned all the past's, so web3's get_all_entries then get_new_entries saw every old log
twice), eth_getFilterLogs returns the whole range, the sealed part of a range that runs past
the head included, and eth_getLogs refuses a range past the head with geth's -32602. Also
eth_call given both `data` and `input`, unequal: refused, as geth does."""
import pytest
from eth_hash.auto import keccak
from test_rpc_review23 import deploy, mine, rpc
from web3 import HTTPProvider, Web3

from chain.devnet import dev_accounts

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def emitter(node):
    """A contract that logs one topic per call, and the log of a first call."""
    account = dev_accounts(18)[17]
    topic = keccak(b"filters29")
    address = deploy(node, account, b"\x7f" + topic + bytes.fromhex("60006000a100"))  # LOG1
    return account, address, mine(node, account, to=address)["logs"]


def test_a_filter_from_the_past_polls_only_new_logs(node, emitter):
    account, address, old = emitter
    fid = rpc(node, "eth_newFilter", {"address": address, "fromBlock": "0x0"})["result"]
    assert rpc(node, "eth_getFilterChanges", fid)["result"] == []
    new = mine(node, account, to=address)["logs"]
    assert rpc(node, "eth_getFilterChanges", fid)["result"] == new
    assert rpc(node, "eth_getFilterChanges", fid)["result"] == []
    assert rpc(node, "eth_getFilterLogs", fid)["result"][-2:] == old + new


def test_web3_sees_each_log_once(node, emitter):
    account, address, _ = emitter
    w3 = Web3(HTTPProvider(node.url))
    log_filter = w3.eth.filter({"address": address, "fromBlock": "earliest"})
    past = log_filter.get_all_entries()
    assert len(past) >= 1 and log_filter.get_new_entries() == []
    mine(node, account, to=address)
    assert len(log_filter.get_new_entries()) == 1
    assert len(log_filter.get_all_entries()) == len(past) + 1


def test_a_range_past_the_head_is_refused_by_get_logs_and_cut_to_the_head_by_a_filter(
        node, emitter):
    account, address, _ = emitter
    head = int(rpc(node, "eth_blockNumber")["result"], 16)
    criteria = {"address": address, "fromBlock": "0x0", "toBlock": hex(head + 100)}
    refused = rpc(node, "eth_getLogs", criteria)["error"]
    assert refused == {"code": -32602, "message": "invalid params: block range extends "
                                                  f"beyond current head block {head}"}
    fid = rpc(node, "eth_newFilter", criteria)["result"]
    sealed = rpc(node, "eth_getLogs", {**criteria, "toBlock": hex(head)})["result"]
    assert len(sealed) >= 1 and rpc(node, "eth_getFilterLogs", fid)["result"] == sealed
    new = mine(node, account, to=address)["logs"]
    assert rpc(node, "eth_getFilterChanges", fid)["result"] == new


def test_a_call_with_unequal_data_and_input_is_refused(node, emitter):
    """Both fields, unequal: `data` ran and `input` was ignored without a word; geth refuses
    them (and takes `input` where only it is given, or both are equal)."""
    account = emitter[0]
    size = deploy(node, account, bytes.fromhex("365f5260205ff3"))  # returns CALLDATASIZE
    for fields, answer in [({"input": "0x1234"}, 2), ({"data": "0x123456"}, 3),
                           ({"input": "0xaa", "data": "0xaa"}, 1), ({"input": "0x"}, 0)]:
        reply = rpc(node, "eth_call", {"to": size, **fields}, "latest")
        assert int(reply["result"], 16) == answer, (fields, reply)
    refused = rpc(node, "eth_call", {"to": size, "input": "0x12", "data": "0x1234"}, "latest")
    assert refused["error"] == {"code": -32602, "message": 'invalid params: both "data" and '
                                "\"input\" are set and not equal; use \"input\" to pass the call "
                                "data"}, refused
