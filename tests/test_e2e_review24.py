"""Whole flows with real processes on 127.0.0.1, from a review: a devnet does not start a
second process in the role of one still running (two workers with one key, and a process
its close() no longer stopped), and a `needle-net submit` killed mid-wait while the chain
node restarts leaves jobs that `needle-net fetch` and `needle-net cancel` settle, with every
wei accounted for from the chain's own numbers."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import balances_at_head, base_fees_burned, wait_for

from chain.devnet import dev_account
from node.devnet import Devnet, DevnetError
from node.market import JOB_CANCELLED, JOB_CLAIMED, JOB_DONE, JOB_OPEN, Market

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parent.parent
MARKET = "0x000000000000000000000000000000000000c0DE"
POOL = "0x0000000000000000000000000000000000000FEE"
FEE = 10**15


def _stop_all(processes: list[subprocess.Popen]) -> None:
    """SIGTERM, then SIGKILL, each process of the list still running (by its own handle)."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_a_running_worker_or_chain_is_not_started_twice_and_close_stops_all(tmp_path):
    """Before, start_worker(0) with worker 0 running started a second worker with the same
    key and data dir, and start_chain() a second node that failed on the first one's lock:
    either way the devnet forgot the first process, which close() then left running."""
    net = Devnet(tmp_path / "devnet", block_time=0.5)
    started: list[subprocess.Popen] = []
    try:
        net.start_chain()
        started.append(net.chain)
        started.append(net.start_worker(0).process)
        with pytest.raises(DevnetError, match="worker 0 is running"):
            started.append(net.start_worker(0).process)
        with pytest.raises(DevnetError, match="chain node is running"):
            net.start_chain()
        started.append(net.chain)
        assert net.start_worker().index == 1  # a new worker takes the next free index
        started.append(net.workers[-1].process)
        assert net.stop_worker(net.workers[0]) == 0
        restarted = net.start_worker(0)  # a stopped one starts again
        started.append(restarted.process)
        net.close()
        assert [p.pid for p in started if p.poll() is None] == []
    finally:
        net.close()
        _stop_all(started)


def _cli(net: Devnet, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "node", *args, "--rpc-url", net.rpc_url],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def _submit(net: Devnet, tmp_path: Path, tag: str, seed: int) -> tuple:
    """A `needle-net submit` process (dev account 0) and its operands."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((40, 30)).astype(np.float32)
    b = rng.standard_normal((30, 20)).astype(np.float32)
    np.save(tmp_path / f"{tag}-a.npy", a)
    np.save(tmp_path / f"{tag}-b.npy", b)
    process = subprocess.Popen(
        [sys.executable, "-m", "node", "submit", str(tmp_path / f"{tag}-a.npy"),
         str(tmp_path / f"{tag}-b.npy"), "-o", str(tmp_path / f"{tag}-c.npy"), "--rpc-url",
         net.rpc_url, "--fee", str(FEE / 10**18)], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    return process, a, b


def test_client_killed_while_the_chain_restarts_its_jobs_are_fetched_or_cancelled(tmp_path):
    net = Devnet(tmp_path / "devnet", block_time=0.5)
    clients: list[subprocess.Popen] = []
    market = None
    try:
        net.start_chain()
        parties = [dev_account(i).address for i in range(20)] + \
            [net.worker_account(0).address, MARKET, POOL]
        market = Market(net.rpc_url, dev_account(7))
        first, total_before = balances_at_head(market, parties)
        worker = net.start_worker(0, extra_args=("--stall-after-claim", "3"),
                                  env={"NEEDLE_NET_ALLOW_CHEAT": "1"})

        # killed once its job is claimed; the chain node stops and restarts meanwhile
        client, a, b = _submit(net, tmp_path, "claimed", 0)
        clients.append(client)
        wait_for(lambda: market.job_count() == 1 and market.job(0).status == JOB_CLAIMED, 60,
                 "the worker to claim job 0")
        client.kill()
        client.wait()
        market.close()
        net.chain.send_signal(signal.SIGTERM)
        net.chain.wait(30)
        net.start_chain()
        market = Market(net.rpc_url, dev_account(7))
        wait_for(lambda: market.job(0).status == JOB_DONE, 60, "job 0 to be verified")
        fetched = _cli(net, "fetch", "0", "-o", str(tmp_path / "c0.npy"))
        assert fetched.returncode == 0, fetched.stdout + fetched.stderr
        np.testing.assert_allclose(np.load(tmp_path / "c0.npy"), a.astype(np.float64) @ b,
                                   rtol=1e-4, atol=1e-4)

        # killed while its job is open (no worker takes it): `cancel` refunds the fee
        assert net.stop_worker(worker) == 0
        client, _, _ = _submit(net, tmp_path, "open", 1)
        clients.append(client)
        wait_for(lambda: market.job_count() == 2, 60, "job 1 to be submitted")
        client.kill()
        client.wait()
        assert market.job(1).status == JOB_OPEN
        cancelled = _cli(net, "cancel", "1")
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
        assert market.job(1).status == JOB_CANCELLED

        # the chain's own numbers: the fee of job 0 went to its worker, nothing is left in
        # escrow, the market holds exactly the stakes, and no wei appeared or vanished
        verified = market.contract.events.JobVerified.get_logs(from_block=0)
        assert [(e["args"]["jobId"], e["args"]["worker"], e["args"]["fee"]) for e in verified] \
            == [(0, worker.address, FEE)]
        functions = market.contract.functions
        assert functions.totalEscrow().call() == 0
        assert market.balance_of(MARKET) == functions.totalStaked().call() + \
            functions.totalOwed().call()
        last, total_after = balances_at_head(market, parties)
        assert total_after - total_before == -base_fees_burned(market, first + 1, last)
    finally:
        if market is not None:
            market.close()
        _stop_all(clients)
        net.close()


def _worker_row(output: str) -> tuple[int, str]:
    """(jobs verified, fees earned) of worker 0 in the demo's table."""
    row = next(line for line in output.splitlines() if line.startswith("│ worker 0 "))
    cells = [cell.strip() for cell in row.strip("│").split("│")]
    return int(cells[1]), cells[2]


def test_a_demo_on_a_reused_data_dir_shows_what_this_run_earned(tmp_path):
    """Before, the table showed each worker's totals over its data dir's whole history: a
    second demo on the same `--data-dir` reported twice the jobs and fees it paid for
    (82 jobs, 0.082 ETH beside a balance change of +0.041 ETH)."""
    from io import StringIO

    from rich.console import Console

    from node.demo import run_demo

    rows = []
    for _ in range(2):
        output = StringIO()
        run_demo(1, tmp_path / "demo", Console(file=output, width=300))
        rows.append(_worker_row(output.getvalue()))
    jobs, fees = rows[0]
    assert jobs > 1 and fees == f"{jobs * 10**15 / 10**18:.6f}"  # the default fee, 0.001 ETH
    assert rows[1] == rows[0]  # the same demo: the same jobs, all done by the one worker
