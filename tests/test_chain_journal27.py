"""The pending transactions' journal (chain/journal.py) with real signed transactions and an
in-process node: what a node answered a hash for is in the journal before the answer, a record
torn by a kill is skipped without losing the ones before it, and the file is compacted once
its transactions are sealed (the SIGKILL test, tests/test_chain_crash26.py, checks that no
acknowledged transaction is lost across real kills)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chain.admission import decode_transaction
from chain.devnet import dev_accounts
from chain.journal import COMPACT_SLACK, JOURNAL_FILE, LENGTH_BYTES, PendingJournal
from chain.node import Node, NodeConfig
from chain.params import CHAIN_ID

pytestmark = pytest.mark.timeout(120)
POOL = "0x0000000000000000000000000000000000000FEE"


def signed(account, nonce: int, data: bytes = b"", value: int = 1) -> bytes:
    tx = {"to": POOL, "value": value, "gas": 21_000 + 40 * len(data) + 1000,
          "maxFeePerGas": 10**11, "maxPriorityFeePerGas": 1, "nonce": nonce,
          "chainId": CHAIN_ID, "type": 2, "data": data}
    return bytes(account.sign_transaction(tx).raw_transaction)


def test_records_read_back_in_order_and_a_torn_last_one_is_skipped(tmp_path, caplog):
    raws = [signed(a, 0) for a in dev_accounts(3)]
    journal = PendingJournal(tmp_path)
    for raw in raws:
        journal.append(raw)
    journal.close()
    whole = (tmp_path / JOURNAL_FILE).read_bytes()
    assert len(whole) == sum(LENGTH_BYTES + len(r) for r in raws)
    for cut in (1, LENGTH_BYTES - 1, LENGTH_BYTES + 5, LENGTH_BYTES + len(raws[-1]) - 1):
        (tmp_path / JOURNAL_FILE).write_bytes(whole[:len(whole) - cut])
        assert PendingJournal(tmp_path).read() == raws[:2], cut
        assert "torn last record" in caplog.text
    (tmp_path / JOURNAL_FILE).write_bytes(whole)
    assert PendingJournal(tmp_path).read() == raws


def test_an_admitted_transaction_is_journaled_before_its_hash_is_answered(tmp_path):
    """The node is never started: nothing seals, so the journal is all that keeps them."""
    accounts = dev_accounts(3)
    node = Node(NodeConfig(tmp_path / "data", block_time=0, decode_process=False))
    try:
        hashes = [node.admit(signed(a, n)) for n in range(2) for a in accounts]
        journaled = [decode_transaction(r).hash
                     for r in PendingJournal(tmp_path / "data").read()]
        assert journaled == hashes
        with pytest.raises(ValueError, match="nonce 0 already used"):
            node.admit(signed(accounts[0], 0, value=2))  # refused: not journaled
        assert len(PendingJournal(tmp_path / "data").read()) == len(hashes)
    finally:
        node.db.close()  # as a killed process leaves it: no stop, no seal
        node.journal.close()
        node._data_dir_lock.close()
    node = Node(NodeConfig(tmp_path / "data", block_time=0, decode_process=False))
    try:
        assert list(node.mempool.by_hash) == hashes  # admitted again, in the same order
        block = node.seal()
        assert [tx.hash for tx in block.transactions] == hashes
    finally:
        node.stop()
    node = Node(NodeConfig(tmp_path / "data", block_time=0, decode_process=False))
    try:  # sealed: not admitted again, and the journal is empty after the stop
        assert len(node.mempool) == 0
        assert (tmp_path / "data" / JOURNAL_FILE).stat().st_size == 0
    finally:
        node.stop()


def test_the_journal_is_compacted_once_its_transactions_are_sealed(tmp_path):
    """Transactions of 100 KB of calldata each, beyond the compaction slack in all: sealed,
    they leave the file; one still pending behind a nonce gap stays in it."""
    sender, gapped = dev_accounts(2)
    node = Node(NodeConfig(tmp_path / "data", block_time=0, decode_process=False))
    try:
        waiting = node.admit(signed(gapped, 1))  # behind a gap: never sealed here
        data = bytes(range(256)) * 400
        count = COMPACT_SLACK // len(data) + 2
        for nonce in range(count):
            node.admit(signed(sender, nonce, data=data))
        assert node.journal.size > COMPACT_SLACK
        while node.state_at().get_nonce(bytes.fromhex(sender.address[2:])) < count:
            assert node.seal().transactions
        assert [decode_transaction(r).hash for r in node.journal.read()] == [waiting]
        assert node.journal.size == (tmp_path / "data" / JOURNAL_FILE).stat().st_size
        node.admit(signed(sender, count))  # appends go on to the new file
        assert len(node.journal.read()) == 2
    finally:
        node.stop()


FULL_DISK = r"""
import resource, signal, sys
from pathlib import Path
from chain.admission import decode_transaction
from chain.devnet import dev_accounts
from chain.journal import PendingJournal
from chain.node import Node, NodeConfig
from test_chain_journal27 import signed

data = Path(sys.argv[1])
node = Node(NodeConfig(data, block_time=0, decode_process=False))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # the journal's disk is "full"
sender = dev_accounts(1)[0]
admitted = []
for nonce in range(20):
    try:
        admitted.append(node.admit(signed(sender, nonce)))
    except ValueError as exc:
        print("refused", nonce, exc)
        break
assert list(node.mempool.by_hash) == admitted
assert [decode_transaction(r).hash for r in PendingJournal(data).read()] == admitted
print("admitted", len(admitted))
"""


def test_a_node_that_cannot_journal_refuses_the_transaction(tmp_path):
    """A journal on a full disk (the file size limit of a real process): the transaction is
    refused with an error naming the journal, nothing is answered that a crash would lose,
    and the pool and the journal hold the same transactions."""
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
    run = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path / "data")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    refused = next(line for line in run.stdout.splitlines() if line.startswith("refused"))
    assert "cannot journal the transaction" in refused and "try again later" in refused
    count = int(run.stdout.split("admitted ")[-1])
    assert 0 < count < 20 and refused.split()[1] == str(count)
