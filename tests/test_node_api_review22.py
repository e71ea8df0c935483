"""Review of the worker's HTTP API, its dashboard, the devnet and the demo, with real
processes and real HTTP on 127.0.0.1: a hung chain node must not take the threads /health,
/status and /metrics answer on, nor the dashboard's view of the worker; a transaction the
chain node refuses is a 409, not a 500; the devnet keeps its admin tokens private, opens its
keystores with the password its workers read, and a process that fails to start is named
with its log, nothing left running; the demo says why it failed, from logs it then deletes."""
import concurrent.futures
import stat
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from io import StringIO
from pathlib import Path

import httpx
import pytest
from helpers import wait_for
from rich.console import Console
from test_blob_review import FakeNode, asgi_server
from test_dashboard import CHROMIUM, Page
from web3 import Web3

import node.api
import node.demo
from chain.devnet import dev_account
from node.api import create_app
from node.devnet import Devnet, DevnetError, WorkerProcess, wait_until

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent
API_THREADS = 40  # anyio's default limit for the threads sync routes run on
HUNG_SECONDS = 30.0  # upper bound on how long a fake chain read hangs


class HungChainNode(FakeNode):
    """A worker whose chain node hangs on every read until `release` is set, then is gone;
    counts the reads waiting at once."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.waiting = self.most_waiting = self.status_calls = 0

    def status(self) -> dict:
        with self.lock:
            self.status_calls += 1
            return {**super().status(), "completed": self.status_calls}

    def recent_blocks(self, count: int) -> list[dict]:
        with self.lock:
            self.waiting += 1
            self.most_waiting = max(self.most_waiting, self.waiting)
        try:
            self.release.wait(HUNG_SECONDS)
        finally:
            with self.lock:
                self.waiting -= 1
        raise ConnectionError("connection refused")


def test_a_hung_chain_node_leaves_health_status_and_metrics_answering():
    """More /blocks than the API has threads, on a chain node that does not answer: before,
    each held a thread for as long as web3 waited (60 s) and /health, /status and /metrics
    timed out with them. Past CHAIN_READERS they are now 503 at once."""
    hung = HungChainNode()
    requests = API_THREADS + 5
    with asgi_server(create_app(hung, None)) as port, \
            concurrent.futures.ThreadPoolExecutor(requests) as pool:
        url = f"http://127.0.0.1:{port}"
        try:
            blocks = [pool.submit(httpx.get, f"{url}/blocks", timeout=HUNG_SECONDS + 10)
                      for _ in range(requests)]
            wait_for(lambda: hung.waiting + sum(f.done() for f in blocks) >= API_THREADS, 10,
                     "every /blocks request waiting or answered")
            for path in ("/health", "/status", "/metrics"):
                assert httpx.get(url + path, timeout=5).status_code == 200, path
        finally:
            hung.release.set()
        answers = Counter((a.status_code, a.json()["detail"]) for a in
                          (f.result() for f in blocks))
    readers = node.api.CHAIN_READERS
    assert hung.most_waiting == readers
    assert answers == {(503, "the chain node is slow to answer; try again"):
                       requests - readers,
                       (503, "the chain node cannot be reached; try again"): readers}


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install -y chromium)")
def test_the_dashboard_stays_live_while_the_chain_node_hangs_and_says_why_once_it_is_gone(
        tmp_path):
    """Before, the page asked for status, jobs and blocks together every second: while the
    chain node hung, the worker's own numbers froze with the blocks and a request for blocks
    piled up each second; a node gone read "Update failed: TypeError: items.map is not a
    function"."""
    hung = HungChainNode()
    with asgi_server(create_app(hung, None)) as port:
        page = Page(tmp_path)
        try:
            page.call("Page.navigate", url=f"http://127.0.0.1:{port}/")
            wait_for(lambda: int(page.evaluate(
                "document.getElementById('completed').textContent") or 0) >= 3, 15,
                "three status updates while the blocks hang")
            assert hung.most_waiting == 1
            hung.release.set()
            wait_for(lambda: page.evaluate("document.getElementById('updated').textContent")
                     == "Update failed: blocks: the chain node cannot be reached; try again",
                     10, "the page to say why the blocks do not update")
            assert page.evaluate("document.getElementById('stake').textContent") == str(
                10**18 + 1)
        finally:
            hung.release.set()
            page.close()


def _processes_using(path: Path) -> list[int]:
    """The pids whose command line names `path` (the devnet's chain node and workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(path).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    """A devnet whose keystore password its user wrote, ending in a newline as
    `echo ... > password` writes it."""
    data_dir = tmp_path_factory.mktemp("devnet")
    (data_dir / "password").write_text("kept by its user\n")
    with Devnet(data_dir, block_time=0.2) as devnet:
        devnet.start(1)
        yield devnet


def test_the_worker_opens_its_keystore_and_its_admin_token_stays_private(net):
    """Before, the devnet made the keystore with the password's newline, which the worker
    strips: the worker could not open its key and exited. Its admin token file was then
    readable by every local user (0644), who could stop the worker."""
    [worker] = net.workers
    assert worker.process.poll() is None
    assert stat.S_IMODE((worker.data_dir / "admin-token").stat().st_mode) == 0o600
    assert stat.S_IMODE(net.password_file.stat().st_mode) != 0o600  # the user's: left as is
    exposed = [Path(f"/proc/{p.pid}/cmdline").read_bytes().decode() + log.read_text()
               for _, p, log in net.processes()]
    assert not [text for text in exposed if worker.admin_token in text]


def test_a_withdrawal_the_chain_node_refuses_is_a_409_with_its_reason(net):
    """A worker without the ETH for requestWithdraw's gas: the chain node refuses the
    transaction (no revert). Before: 500 "Internal Server Error" and a traceback in the
    worker's log."""
    [worker] = net.workers
    account = net.worker_account(worker.index)
    w3 = Web3(Web3.HTTPProvider(net.rpc_url))
    max_fee = 2 * w3.eth.gas_price
    drain = {"to": dev_account(0).address, "gas": 21000, "chainId": w3.eth.chain_id,
             "nonce": w3.eth.get_transaction_count(account.address, "pending"),
             "maxFeePerGas": max_fee, "maxPriorityFeePerGas": 0,
             "value": w3.eth.get_balance(account.address) - 21000 * max_fee}
    w3.eth.wait_for_transaction_receipt(w3.eth.send_raw_transaction(
        account.sign_transaction(drain).raw_transaction), timeout=30, poll_latency=0.05)
    answer = httpx.post(f"{worker.api_url}/admin/withdraw", timeout=60,
                        headers={"Authorization": f"Bearer {worker.admin_token}"})
    assert answer.status_code == 409, answer.text
    assert answer.json()["detail"].startswith("the chain node refused: insufficient funds")
    assert "Traceback" not in net.log("worker0.log").read_text()
    # nothing was requested, so the worker still takes jobs (it stopped for good before)
    assert httpx.get(f"{worker.api_url}/status", timeout=10).json()["accepting_jobs"] is True


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
def test_devnet_up_whose_worker_cannot_start_names_its_log_and_leaves_nothing_running(
        tmp_path):
    """A previous run's worker state that no longer reads (the worker exits at start): one
    error line naming the worker's log, where it says why; exit 1; no chain node or worker
    left. Before, the line named no log. A start that times out names the log too (before, a
    TimeoutError, which the CLI showed as "cannot reach the chain node")."""
    data_dir = tmp_path / "devnet"
    (data_dir / "worker0").mkdir(parents=True)
    (data_dir / "worker0" / "worker-state.json").write_text('{"next_bl')
    up = subprocess.run(
        [sys.executable, "-m", "node", "devnet", "up", "--workers", "1", "--data-dir",
         str(data_dir), "--port", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    log = data_dir / "worker0.log"
    assert (up.returncode, up.stdout.strip(), up.stderr) == (
        1, f"error: worker 0: process exited with code 1 (log: {log})", "")
    assert "Unterminated string" in log.read_text()
    assert _processes_using(data_dir) == []
    with pytest.raises(DevnetError, match=r"^worker 9: not ready after 0s \(log: w\.log\)$"):
        wait_until(lambda: False, 0.2, "worker 9", log=Path("w.log"))


@pytest.mark.parametrize(("worker_args", "expected"), [
    (("--no-such-option",), ["error: worker 0: process exited with code 2",
                             "worker 0 exited with code 2; the end of its log:",
                             "No such option: --no-such-option"]),
    (("--min-fee", "1"), ["error: [job 0, stage submitted] timed out after 3s",
                          "job 0 cancelled, its 0.001 ETH fee refunded"]),
], ids=["worker-exits-at-start", "no-worker-takes-the-job"])
def test_a_demo_that_fails_says_why_before_removing_its_logs(tmp_path, monkeypatch,
                                                            worker_args, expected):
    """Before, the demo ended in a traceback (a job nobody took) or in a line that named no
    reason (a worker that exited), and removed the logs that said why."""
    class Workers(Devnet):
        def start_worker(self, *args, **kwargs) -> WorkerProcess:
            return super().start_worker(*args, extra_args=worker_args, **kwargs)

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setattr(node.demo, "Devnet", Workers)
    monkeypatch.setattr(node.demo, "JOB_TIMEOUT", 3.0)
    output = StringIO()
    with pytest.raises(SystemExit) as exited:
        node.demo.run_demo(1, None, Console(file=output, width=300))
    text = output.getvalue()
    assert exited.value.code == 1, text
    assert all(line in text for line in expected), text
    assert "Traceback" not in text
    assert list(temp.iterdir()) == [] and _processes_using(temp) == []
