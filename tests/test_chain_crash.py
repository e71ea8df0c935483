"""SIGKILL a node in the middle of a stream of transactions; the restarted node must hold
exactly the blocks, state roots and balances it had reported before the crash."""
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest
from web3 import Web3

from chain.compile import compiled_market
from chain.devnet import dev_accounts
from chain.launch import NodeProcess

MARKET = "0x000000000000000000000000000000000000c0DE"
POOL = "0x0000000000000000000000000000000000000FEE"
GENESIS_SUPPLY = 20 * 10_000 * 10**18 + 1_000_000 * 10**18


class Stream(threading.Thread):
    """Senders submitting jobs and transfers in batches until stopped (or the node dies)."""

    def __init__(self, url: str, accounts) -> None:
        super().__init__(daemon=True)
        self.url, self.accounts = url, accounts
        self.market = Web3().eth.contract(address=MARKET, abi=compiled_market()["abi"])
        self.stop = threading.Event()
        self.sent = 0

    def _raw(self, account, nonce: int, i: int) -> str:
        if i % 2:
            tx = {"to": dev_accounts(1)[0].address, "value": 10**12 + i, "gas": 21_000}
        else:
            tx = {"to": MARKET, "value": 10**13, "gas": 400_000,
                  "data": self.market.encode_abi("submitJob", args=[
                      i.to_bytes(32, "big"), b"\1" * 32, 1, 8, 8, 8, 1, 50])}
        tx.update(maxFeePerGas=10**11, maxPriorityFeePerGas=1, nonce=nonce, chainId=1414,
                  type=2)
        return "0x" + account.sign_transaction(tx).raw_transaction.hex()

    def run(self) -> None:
        nonces = {a.address: 0 for a in self.accounts}
        i = 0
        while not self.stop.is_set():
            batch = []
            for account in self.accounts:
                batch.append(self._raw(account, nonces[account.address], i))
                nonces[account.address] += 1
                i += 1
            try:
                httpx.post(self.url, timeout=10, json=[
                    {"jsonrpc": "2.0", "id": n, "method": "eth_sendRawTransaction",
                     "params": [raw]} for n, raw in enumerate(batch)])
            except httpx.HTTPError:
                return  # the node is gone
            self.sent += len(batch)


def snapshot(w3, number: int, addresses) -> tuple:
    block = w3.eth.get_block(number)
    return (block["hash"], block["stateRoot"],
            [w3.eth.get_balance(a, number) for a in addresses],
            [w3.eth.get_transaction_count(a, number) for a in addresses])


@pytest.mark.timeout(180)
def test_sigkill_mid_stream_resumes_from_last_sealed_block(tmp_path):
    data = tmp_path / "data"
    senders = dev_accounts(8)[4:8]
    watched = [a.address for a in senders] + [MARKET, POOL, dev_accounts(1)[0].address]
    node = NodeProcess(data, block_time=0.5).start()
    stream = Stream(node.url, senders)
    try:
        w3 = Web3(Web3.HTTPProvider(node.url))
        stream.start()
        seen = {}
        deadline = time.monotonic() + 60
        while len(seen) < 3 or stream.sent < 60:
            assert time.monotonic() < deadline, "the stream made no progress"
            number = w3.eth.block_number
            if number not in seen and w3.eth.get_block(number)["transactions"]:
                seen[number] = snapshot(w3, number, watched)
            time.sleep(0.1)
        node.kill()  # SIGKILL while transactions are still arriving
        stream.stop.set()
        stream.join(timeout=15)
    finally:
        stream.stop.set()
        node.stop()

    with NodeProcess(data, block_time=0.5) as restarted:
        w3 = Web3(Web3.HTTPProvider(restarted.url))
        head = w3.eth.block_number
        assert head >= max(seen)
        for number, before in seen.items():
            assert snapshot(w3, number, watched) == before
        # every account resumes at the nonce its mined transactions imply, and can go on
        for account in senders:
            mined = w3.eth.get_transaction_count(account.address)
            tx = {"to": POOL, "value": 1, "gas": 21_000, "maxFeePerGas": 10**11,
                  "maxPriorityFeePerGas": 1, "nonce": mined, "chainId": 1414, "type": 2}
            tx_hash = w3.eth.send_raw_transaction(account.sign_transaction(tx).raw_transaction)
            assert w3.eth.wait_for_transaction_receipt(tx_hash, timeout=30)["status"] == 1
        number = w3.eth.block_number
        blocks = httpx.post(restarted.url, timeout=30, json=[
            {"jsonrpc": "2.0", "id": n, "method": "eth_getBlockByNumber", "params": [hex(n), False]}
            for n in range(1, number + 1)]).json()
        burned = sum(int(b["result"]["gasUsed"], 16) * int(b["result"]["baseFeePerGas"], 16)
                     for b in blocks)
        holders = [a.address for a in dev_accounts(20)] + [MARKET, POOL]
        assert sum(w3.eth.get_balance(a, number) for a in holders) == GENESIS_SUPPLY - burned

    # offline re-validation of the recovered database: every block re-executes from genesis
    check = subprocess.run([sys.executable, "-m", "chain", "verify", "--data-dir", str(data)],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    replayed = re.search(r"blocks 1\.\.(\d+) re-executed", check.stdout)
    assert replayed and int(replayed.group(1)) >= number
