"""SIGKILL a chain node again and again at random moments while real clients send signed
transfers and job submissions naming blobs they uploaded; after every restart, what any
client was told succeeded must still hold, checked against a ledger the test keeps itself:
- every receipt a client saw (eth_getTransactionReceipt or POST /wait) is unchanged: same
  block number, block hash, status and gas;
- every block number seen keeps the hash it was seen with;
- every blob acknowledged 200 reads back byte-identical, and every file the store holds
  hashes to its name (no truncated blob under a valid id);
- the node restarts each time; at the end every sender's balance and nonce follow from the
  receipts of its mined transactions alone, the supply is conserved up to burned base fees,
  and `chain verify` re-executes the whole chain.
- every transaction whose hash the node answered is mined in the end (the node journals what
  it admits): only those whose answer the kill cut short may be lost, and a lost one never
  reappears in a later block (each sender's nonces are mined once each, without gaps)."""
import os
import random
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from web3 import Web3

from chain.blobs import blob_id, encode_array
from chain.compile import compiled_market
from chain.devnet import dev_accounts
from chain.launch import NodeProcess
from chain.params import DEV_ACCOUNT_BALANCE, DEV_ACCOUNT_COUNT, REWARD_POOL_GENESIS

MARKET = "0x000000000000000000000000000000000000c0DE"
POOL = "0x0000000000000000000000000000000000000FEE"
SINK = Web3.to_checksum_address("0x" + "aa" * 20)  # receives the transfers
KILLS = int(os.environ.get("CRASH26_KILLS", "12"))  # more for a longer soak by hand
TRANSFERS_EACH = 3  # per account and batch
SEED = int(os.environ.get("CRASH26_SEED", "26"))
FEE = 10**13


def _rpc(url: str, calls: list[tuple[str, list]], timeout: float = 30) -> list:
    """A JSON-RPC batch; each call's result (an error raises)."""
    if not calls:
        return []
    replies = httpx.post(url, timeout=timeout, json=[
        {"jsonrpc": "2.0", "id": i, "method": m, "params": p}
        for i, (m, p) in enumerate(calls)]).json()
    replies = sorted(replies, key=lambda r: r["id"])
    for reply in replies:
        assert "error" not in reply, reply
    return [r["result"] for r in replies]


class Ledger:
    """What clients were told: receipts, block hashes, transactions sent, blobs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.receipts: dict[str, dict] = {}  # tx hash -> receipt as first seen
        self.blocks: dict[int, str] = {}  # block number -> hash as first seen
        # every transaction sent (before it is sent: the kill may cut its answer short)
        self.sent: dict[str, tuple[str, int, int]] = {}  # hash -> (sender, nonce, value)
        self.blobs: dict[str, bytes] = {}  # id acknowledged 200 -> the bytes sent
        self.acknowledged: set[str] = set()  # hashes of sent transactions the node answered

    def saw_receipt(self, receipt: dict) -> None:
        with self.lock:
            self.receipts.setdefault(receipt["transactionHash"], receipt)
            self.saw_block(int(receipt["blockNumber"], 16), receipt["blockHash"])

    def saw_block(self, number: int, block_hash: str) -> None:
        first = self.blocks.setdefault(number, block_hash)
        assert first == block_hash, f"block {number} was {first}, now {block_hash}"


class Senders(threading.Thread):
    """Accounts sending transfers (JSON-RPC batches, receipts polled) and job submissions
    (POST /wait, the receipt in the answer) until stopped or the node is gone."""

    def __init__(self, url: str, blob_url: str, accounts, nonces: dict, ledger: Ledger,
                 rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.url, self.blob_url, self.accounts = url, blob_url, accounts
        self.nonces, self.ledger, self.rng = nonces, ledger, rng
        self.market = Web3().eth.contract(address=MARKET, abi=compiled_market()["abi"])
        self.stop = threading.Event()
        self.progress = 0  # receipts seen in this run
        self.error: BaseException | None = None  # what went wrong, but the node's death
        self.http = httpx.Client(timeout=10)

    def _sign(self, account, tx: dict) -> tuple[int, str, str]:
        """(nonce, hash, raw) of the next transaction of `account`."""
        nonce = self.nonces[account.address]
        tx.update(maxFeePerGas=10**11, maxPriorityFeePerGas=1, nonce=nonce, chainId=1414,
                  type=2)
        signed = account.sign_transaction(tx)
        self.nonces[account.address] += 1
        tx_hash = "0x" + signed.hash.hex().removeprefix("0x")
        return nonce, tx_hash, "0x" + signed.raw_transaction.hex().removeprefix("0x")

    def _upload(self, size: int) -> str:
        """A blob PUT to the blob port; its id, recorded once acknowledged."""
        rows = max(1, size // 64)
        data = encode_array(np.frombuffer(self.rng.randbytes(rows * 64), np.float32)
                            .reshape(rows, 16))
        id_ = "0x" + blob_id(data).hex()
        reply = self.http.put(f"{self.blob_url}/{id_}", content=data)
        assert reply.status_code == 200, reply.text
        with self.ledger.lock:
            self.ledger.blobs[id_] = data
        return id_

    def _submit(self, account) -> None:
        """Upload A and B, then submitJob naming them through POST /wait."""
        a_id = self._upload(self.rng.choice([256, 4096, 3 << 20]))
        b_id = self._upload(256)
        data = self.market.encode_abi("submitJob", args=[a_id, b_id, 1, 4, 16, 4, 1, 50])
        nonce, tx_hash, raw = self._sign(account, {"to": MARKET, "value": FEE, "gas": 400_000,
                                                   "data": data})
        with self.ledger.lock:
            self.ledger.sent[tx_hash] = (account.address, nonce, FEE)
        answer = self.http.post(f"{self.url}/wait?timeout=10", json=raw).json()
        assert answer.get("hash") == tx_hash, answer
        with self.ledger.lock:
            self.ledger.acknowledged.add(tx_hash)
        if answer["receipt"] is not None:
            self.ledger.saw_receipt(answer["receipt"])
            self.progress += 1

    def _transfers(self, accounts) -> None:
        sent = []
        for account in accounts * TRANSFERS_EACH:
            value = self.rng.randrange(1, 10**12)
            sent.append((account, value, *self._sign(account, {"to": SINK, "value": value,
                                                               "gas": 21_000})))
        with self.ledger.lock:
            for account, value, nonce, tx_hash, _ in sent:
                self.ledger.sent[tx_hash] = (account.address, nonce, value)
        results = _rpc(self.url, [("eth_sendRawTransaction", [raw]) for *_, raw in sent])
        assert results == [tx_hash for *_, tx_hash, _ in sent]
        with self.ledger.lock:
            self.ledger.acknowledged.update(results)
        for _ in range(20):
            receipts = _rpc(self.url, [("eth_getTransactionReceipt", [h]) for *_, h, _ in sent]
                            + [("eth_getBlockByNumber", ["latest", False])])
            latest = receipts.pop()
            with self.ledger.lock:
                self.ledger.saw_block(int(latest["number"], 16), latest["hash"])
            for receipt in filter(None, receipts):
                self.ledger.saw_receipt(receipt)
                self.progress += 1
            if all(receipts):
                return
            time.sleep(0.02)

    def run(self) -> None:
        submitter, *others = self.accounts
        try:
            while not self.stop.is_set():
                self._transfers(others)
                if self.rng.random() < 0.5:
                    self._submit(submitter)
        except (httpx.HTTPError, ValueError):
            return  # the node is gone (a reply cut short is no JSON)
        except BaseException as exc:  # noqa: BLE001 - raised again by the test
            self.error = exc


def check_recovered(url: str, blob_url: str, ledger: Ledger) -> int:
    """Everything the ledger holds is still so on the restarted node; returns the head."""
    head = int(_rpc(url, [("eth_blockNumber", [])])[0], 16)
    assert head >= max(ledger.blocks, default=0), "the node lost blocks it had announced"
    numbers = sorted(ledger.blocks)
    blocks = _rpc(url, [("eth_getBlockByNumber", [hex(n), False]) for n in numbers])
    for number, block in zip(numbers, blocks, strict=True):
        assert block["hash"] == ledger.blocks[number], f"block {number} changed"
    hashes = sorted(ledger.receipts)
    for tx_hash, now in zip(hashes, _rpc(url, [("eth_getTransactionReceipt", [h])
                                               for h in hashes]), strict=True):
        seen = ledger.receipts[tx_hash]
        assert now is not None, f"acknowledged transaction {tx_hash} was lost"
        keys = ("blockNumber", "blockHash", "transactionIndex", "status", "gasUsed",
                "effectiveGasPrice", "logs")
        assert {k: now[k] for k in keys} == {k: seen[k] for k in keys}, tx_hash
    with httpx.Client(timeout=30) as http:
        for id_, data in ledger.blobs.items():
            reply = http.get(f"{blob_url}/{id_}")
            assert reply.status_code == 200, f"acknowledged blob {id_} is gone"
            assert reply.content == data, f"blob {id_} changed"
    return head


def stored_blobs_match_their_names(blob_dir) -> None:
    """Every blob file is named by its content's hash (a partial upload under its final
    name would be a blob served truncated); no temp file outlives a restart."""
    for path in blob_dir.iterdir():
        assert not path.name.startswith(".tmp-"), f"partial upload {path.name} left"
        assert blob_id(path.read_bytes()).hex() == path.name, f"blob {path.name} damaged"


def wait_for_acknowledged(url: str, ledger: Ledger) -> None:
    """Until every transaction the node answered is mined (those a restart admitted again
    from the journal included); fails after 30 s naming one that is not."""
    missing = sorted(ledger.acknowledged)
    deadline = time.monotonic() + 30
    while missing:
        receipts = _rpc(url, [("eth_getTransactionReceipt", [h]) for h in missing], timeout=60)
        missing = [h for h, r in zip(missing, receipts, strict=True) if r is None]
        assert not missing or time.monotonic() < deadline, \
            f"{len(missing)} acknowledged transactions lost, e.g. {missing[0]}"
        time.sleep(0.1)


def check_books(url: str, ledger: Ledger, accounts) -> tuple[int, int]:
    """Balances and nonces of the senders from the receipts of the transactions they sent,
    and the supply over every block; (mined, lost) sent transactions."""
    hashes = sorted(ledger.sent)
    receipts = dict(zip(hashes, _rpc(url, [("eth_getTransactionReceipt", [h]) for h in hashes],
                                     timeout=60), strict=True))
    head = int(_rpc(url, [("eth_blockNumber", [])])[0], 16)
    spent = {a.address: 0 for a in accounts}
    mined_nonces = {a.address: set() for a in accounts}
    received = {MARKET: 0, SINK: 0}
    for tx_hash, receipt in receipts.items():
        if receipt is None:
            continue
        sender, nonce, value = ledger.sent[tx_hash]
        assert receipt["status"] == "0x1", receipt
        assert nonce not in mined_nonces[sender], f"nonce {nonce} of {sender} mined twice"
        mined_nonces[sender].add(nonce)
        spent[sender] += value + int(receipt["gasUsed"], 16) * \
            int(receipt["effectiveGasPrice"], 16)
        received[Web3.to_checksum_address(receipt["to"])] += value
    for account in accounts:
        address = account.address
        count, balance = (int(v, 16) for v in _rpc(url, [
            ("eth_getTransactionCount", [address, hex(head)]),
            ("eth_getBalance", [address, hex(head)])]))
        assert mined_nonces[address] == set(range(count)), address
        assert balance == DEV_ACCOUNT_BALANCE - spent[address], address
    for address, value in received.items():
        assert int(_rpc(url, [("eth_getBalance", [address, hex(head)])])[0], 16) == value
    blocks = _rpc(url, [("eth_getBlockByNumber", [hex(n), False]) for n in range(1, head + 1)],
                  timeout=60)
    burned = sum(int(b["gasUsed"], 16) * int(b["baseFeePerGas"], 16) for b in blocks)
    holders = [a.address for a in dev_accounts(DEV_ACCOUNT_COUNT)] + [MARKET, POOL, SINK]
    total = sum(int(v, 16) for v in _rpc(url, [("eth_getBalance", [a, hex(head)])
                                               for a in holders]))
    assert total == DEV_ACCOUNT_COUNT * DEV_ACCOUNT_BALANCE + REWARD_POOL_GENESIS - burned
    mined = sum(r is not None for r in receipts.values())
    return mined, len(receipts) - mined


@pytest.mark.timeout(240)
def test_repeated_sigkill_keeps_every_acknowledged_block_receipt_and_blob(tmp_path):
    rng = random.Random(SEED)
    groups = [dev_accounts(DEV_ACCOUNT_COUNT)[10:14], dev_accounts(DEV_ACCOUNT_COUNT)[14:18]]
    accounts = [a for group in groups for a in group]
    ledger = Ledger()
    data = tmp_path / "data"
    node = NodeProcess(data, block_time=0.2, extra_args=("--blob-reserve-mb", "0"))
    try:
        for _ in range(KILLS):
            node.start()
            blob_url = httpx.get(f"{node.url}/info").json()["blob_url"]
            check_recovered(node.url, blob_url, ledger)
            stored_blobs_match_their_names(data / "blobs")
            nonces = dict(zip([a.address for a in accounts], (int(n, 16) for n in _rpc(
                node.url, [("eth_getTransactionCount", [a.address, "pending"])
                           for a in accounts])), strict=True))
            streams = [Senders(node.url, blob_url, group, nonces, ledger,
                               random.Random(rng.random())) for group in groups]
            for stream in streams:
                stream.start()
            deadline = time.monotonic() + 20
            while sum(s.progress for s in streams) < 3 and all(s.is_alive() for s in streams):
                assert time.monotonic() < deadline, "no receipts within 20 s"
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.3))
            node.kill()  # while the senders are sending, uploading and waiting
            for stream in streams:
                stream.stop.set()
                stream.join(timeout=30)
                assert not stream.is_alive()
                if stream.error is not None:
                    raise stream.error
        node.start()
        blob_url = httpx.get(f"{node.url}/info").json()["blob_url"]
        check_recovered(node.url, blob_url, ledger)
        wait_for_acknowledged(node.url, ledger)
        mined, lost = check_books(node.url, ledger, accounts)
        print(f"{KILLS} kills: {len(ledger.receipts)} receipts seen, {mined} of "
              f"{len(ledger.sent)} sent transactions mined ({len(ledger.acknowledged)} "
              f"acknowledged), {lost} lost, "
              f"{len(ledger.blobs)} blobs, {len(ledger.blocks)} blocks seen")
        assert len(ledger.receipts) >= 3 * KILLS and len(ledger.blobs) >= 2
    finally:
        node.stop()
    stored_blobs_match_their_names(data / "blobs")
    check = subprocess.run([sys.executable, "-m", "chain", "verify", "--data-dir", str(data)],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
