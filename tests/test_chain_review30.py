"""From a review of the chain node's data dir and RPC: a journal append the disk cut short
left a torn record that hid every transaction acknowledged after it at the next start; an
emptied chain.sqlite beside an earlier run's journal started a new chain silently; a blob
re-uploaded over a damaged stored copy was acknowledged and left it damaged; "pending" as
EIP-1898's object was read as the head; a file where the blob folder belongs ended `chain up`
in a traceback. Real node processes, signed transactions, RLIMIT_FSIZE for a full disk."""
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest

from chain.blobs import BlobStore, blob_id, encode_array
from chain.devnet import dev_account
from chain.journal import PendingJournal
from chain.launch import NodeProcess
from chain.params import CHAIN_ID

pytestmark = pytest.mark.timeout(180)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNSEALED = ("--no-seal-on-pending",)  # with an hour between blocks: the pool keeps them


def _send(node, sender: int, nonce: int) -> dict:
    tx = {"to": dev_account(9).address, "value": 1, "gas": 21_000, "maxFeePerGas": 10**11,
          "maxPriorityFeePerGas": 1, "nonce": nonce, "chainId": CHAIN_ID, "type": 2}
    raw = bytes(dev_account(sender).sign_transaction(tx).raw_transaction)
    return _rpc(node, "eth_sendRawTransaction", "0x" + raw.hex())


def _rpc(node, method: str, *params):
    answer = httpx.post(node.url, json={"jsonrpc": "2.0", "id": 1, "method": method,
                                        "params": list(params)}, timeout=30).json()
    assert "result" in answer, answer
    return answer["result"]


def test_a_journal_append_the_disk_cuts_short_hides_nothing_appended_after_it(tmp_path):
    PendingJournal(tmp_path).append(b"first")
    script = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from chain.journal import PendingJournal\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "journal = PendingJournal(Path(sys.argv[1]))\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (journal.size + 10, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    journal.append(b'x' * 100)\n"
        "except OSError as err:\n"
        "    print('refused', err.errno)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)\n"
        "journal.append(b'second')\n"
        "journal.append(b'third')\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert done.stdout.startswith("refused"), done.stdout + done.stderr
    assert PendingJournal(tmp_path).read() == [b"first", b"second", b"third"]


def test_an_emptied_database_beside_an_earlier_runs_journal_is_refused(tmp_path):
    data_dir = tmp_path / "chain"
    with NodeProcess(data_dir, block_time=3600, extra_args=UNSEALED) as node:
        _send(node, 3, 0)  # journaled, not sealed
        node.kill()
    for name in os.listdir(data_dir):
        if name.startswith("chain.sqlite"):
            os.truncate(data_dir / name, 0)
    done = subprocess.run([sys.executable, "-m", "chain", "up", "--data-dir", str(data_dir),
                           "--port", "0", "--blob-port", "0"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "is empty, but" in done.stderr and "pending.journal holds transactions" in done.stderr


def test_a_blob_uploaded_again_repairs_a_damaged_stored_copy(tmp_path):
    store = BlobStore(tmp_path / "blobs")
    blob = encode_array(np.arange(1000, dtype=np.float32))
    stored = store.path(store.put(blob))
    os.truncate(stored, len(blob) // 2)
    assert store.put(blob) == blob_id(blob)
    assert stored.read_bytes() == blob


def test_pending_as_an_eip1898_object_counts_the_pool(tmp_path):
    sender = dev_account(5).address
    with NodeProcess(tmp_path / "chain", block_time=3600, extra_args=UNSEALED) as node:
        for nonce in range(2):
            _send(node, 5, nonce)
        counts = [int(_rpc(node, "eth_getTransactionCount", sender, block), 16)
                  for block in ("pending", {"blockNumber": "pending"}, "latest",
                                {"blockNumber": "latest"})]
    assert counts == [2, 2, 0, 0]


def test_a_file_where_the_blob_folder_belongs_is_one_error_line(tmp_path):
    data_dir = tmp_path / "chain"
    data_dir.mkdir()
    (data_dir / "blobs").write_text("not a folder")
    done = subprocess.run([sys.executable, "-m", "chain", "up", "--data-dir", str(data_dir),
                           "--port", "0", "--blob-port", "0"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"error: data dir {data_dir}:"), done.stderr
