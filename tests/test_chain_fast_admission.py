"""Batched admission through the decoder process (chain/admission.py): the same replies as
decoding in place, for valid and invalid transactions alike; the worker process ends with a
killed node."""
import os
import time
from pathlib import Path

import httpx
from web3 import Web3

from chain.admission import MIN_WORKER_BATCH
from chain.compile import compiled_market
from chain.devnet import dev_accounts
from chain.launch import NodeProcess
from chain.node import Node, NodeConfig
from chain.params import CHAIN_ID, MARKET_ADDRESS
from chain.rpc import Rpc

MARKET = Web3().eth.contract(address=Web3.to_checksum_address(MARKET_ADDRESS),
                             abi=compiled_market()["abi"])


def signed_jobs(account, count: int, chain_id: int = CHAIN_ID, first_nonce: int = 0) -> list:
    raws = []
    for nonce in range(first_nonce, first_nonce + count):
        data = MARKET.encode_abi("submitJob", args=[nonce.to_bytes(32, "big"), b"\1" * 32,
                                                    1, 8, 8, 8, 1, 100])
        tx = {"to": MARKET.address, "data": data, "value": 10**12, "gas": 300_000,
              "maxFeePerGas": 10**11, "maxPriorityFeePerGas": 1, "nonce": nonce,
              "chainId": chain_id, "type": 2}
        raws.append("0x" + bytes(account.sign_transaction(tx).raw_transaction).hex())
    return raws


def batch_with_every_outcome() -> list[dict]:
    alice, bob = dev_accounts(2)
    good = signed_jobs(alice, MIN_WORKER_BATCH)
    corrupt_signature = good[0][:-4] + ("00" if good[0][-2:] != "00" else "01") + good[0][-2:]
    params = [*good, good[3],  # a duplicate
              *signed_jobs(bob, 2, chain_id=CHAIN_ID + 1),  # wrong chain
              "0x00", "0xf8", "not hex", corrupt_signature,
              *signed_jobs(bob, 1, first_nonce=5)]  # accepted (a future nonce)
    batch = [{"jsonrpc": "2.0", "id": i, "method": "eth_sendRawTransaction", "params": [p]}
             for i, p in enumerate(params)]
    batch.insert(4, {"jsonrpc": "2.0", "id": "n", "method": "eth_blockNumber", "params": []})
    return batch


def test_batch_replies_match_in_place_decoding(tmp_path):
    replies = []
    for decode_process in (True, False):
        node = Node(NodeConfig(tmp_path / str(decode_process), block_time=0,
                               decode_process=decode_process))
        try:
            replies.append(Rpc(node).handle(batch_with_every_outcome()))
            assert len(node.mempool) == MIN_WORKER_BATCH + 1
        finally:
            node.stop()
    assert replies[0] == replies[1]
    errors = [r["error"]["message"] for r in replies[0] if "error" in r]
    for reason in ("already known", "invalid chain id", "could not be decoded",
                   "invalid params"):
        assert any(reason in message for message in errors), reason


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[1] == str(pid):
                found.append(int(stat.parent.name))
        except OSError:
            continue
    return found


def test_decoder_process_ends_with_a_killed_node(tmp_path):
    with NodeProcess(tmp_path / "data") as node:
        replies = httpx.post(node.url, json=batch_with_every_outcome(), timeout=60).json()
        assert sum("result" in r for r in replies) == MIN_WORKER_BATCH + 2
        workers = children(node.proc.pid)
        assert workers  # the decoder (and multiprocessing's resource tracker)
        node.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in workers):
        time.sleep(0.1)
    alive = [p for p in workers if Path(f"/proc/{p}").exists()]
    for pid in alive:  # do not leave them behind even if the test fails
        os.kill(pid, 9)
    assert not alive
