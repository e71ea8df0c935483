"""Review of the worker's books when a transaction's outcome is not what its answer said,
against a real chain node process on 127.0.0.1 (and a real HTTP proxy in front of it): a
batch commit whose answer was lost although it landed, a commitResult resent after its
first send landed, a worker restarted while its withdrawal is pending, and the earnings
gauge after a restart."""
import json
import logging
import time
from dataclasses import asdict

import httpx
import numpy as np
import pytest
from helpers import FlakyProxy, run_worker, stop_worker, submit_as_declared, wait_for

from chain.devnet import dev_account, dev_accounts
from node import compute
from node.devnet import free_port
from node.market import JOB_DONE, JOB_OPEN, Market
from node.worker import FINISHED, JobRecord, Worker, WorkerConfig

pytestmark = pytest.mark.timeout(120)
FEE = 10**15
ETHER = 10**18
FP32 = 1


def _cancel_open(market: Market, ids: list[int]) -> None:
    """Leave no open job behind for the next test's worker (a fresh one scans from block 0)."""
    for job_id in ids:
        if market.job(job_id).status == JOB_OPEN:
            market.send("cancel", job_id)


def _metric(text: str, name: str) -> float:
    (line,) = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


@pytest.mark.parametrize("lose", [1, 2])
def test_a_batch_commit_that_landed_although_its_answer_was_lost_is_paid_and_booked(
        node, tmp_path, lose):
    """commitJobs is posted with eth_sendRawTransaction; its answer lost once, the resend of
    the same transaction was refused as known and the batch recorded as "error"; lost twice,
    a second commitJobs (new nonce) found the jobs taken and the worker dropped them as
    another worker's. Either way the first commit had landed: the jobs were this worker's,
    verified and paid, and its books said otherwise."""
    rng = np.random.default_rng(21 + lose)
    a, b = rng.standard_normal((6, 5), np.float32), rng.standard_normal((5, 4), np.float32)
    account = dev_accounts(3 + lose)[2 + lose]
    proxy = FlakyProxy(node.url)
    proxy.lose_marker = b"eth_sendRawTransaction"
    submitter = Market(node.url, dev_account(1))
    Market(node.url, account).send("register", value=ETHER)
    config = WorkerConfig(rpc_url=proxy.url, data_dir=tmp_path, stake_wei=ETHER,
                          api_port=free_port())
    worker = Worker(config, account)
    thread = run_worker(worker)
    ids: list[int] = []
    try:
        proxy.lose = lose
        ids = submit_as_declared(submitter, FEE, [(a, b, (1, 6, 5, 4), FP32)])
        wait_for(lambda: submitter.job(ids[0]).status == JOB_DONE, 15, "the job to be done")
        wait_for(lambda: {j["job_id"] for j in worker.job_list() if j["stage"] in FINISHED}
                 >= set(ids), 30, "the worker to record the job")
        status = httpx.get(f"http://127.0.0.1:{config.api_port}/status").json()
        metrics = httpx.get(f"http://127.0.0.1:{config.api_port}/metrics").text
    finally:
        stop_worker(worker, thread)
        _cancel_open(submitter, ids)
        proxy.close()
    assert proxy.lost == lose
    assert submitter.job(ids[0]).worker == account.address
    stages = [(j["job_id"], j["stage"]) for j in worker.job_list()]
    assert stages == [(ids[0], "verified")], worker.job_list()
    assert status["earned_wei"] == FEE and status["completed"] == 1
    assert _metric(metrics, "needle_earned_wei") == FEE
    assert _metric(metrics, 'needle_jobs_total{outcome="verified"}') == 1
    # a small job is claimed and committed by one commitJobs: counted as both (claimed was not)
    assert _metric(metrics, 'needle_jobs_total{outcome="claimed"}') == 1
    journal = (tmp_path / "worker-jobs.jsonl").read_text().splitlines()
    assert [(json.loads(x)["job_id"], json.loads(x)["stage"]) for x in journal] == stages
    submitter.close()


def test_a_commit_whose_earlier_send_landed_is_kept_and_finalised(node, tmp_path):
    """commitResult sent, its answer lost and sent again (signed afresh): the retry reverts
    ("job not claimed") although the first send committed the result. The worker recorded
    the job "lost" and never finalised it; it keeps it now and is paid."""
    rng = np.random.default_rng(23)
    a, b = rng.standard_normal((8, 5), np.float32), rng.standard_normal((5, 3), np.float32)
    account = dev_accounts(6)[5]
    submitter, me = Market(node.url, dev_account(1)), Market(node.url, account)
    worker = None
    try:
        me.send("register", value=ETHER)
        (job_id,) = submit_as_declared(submitter, FEE, [(a, b, (1, 8, 5, 3), FP32)])
        me.send("claimJob", job_id)
        c = compute.matmul(a, b)
        me.send("commitResult", job_id, me.put_array(c))  # the send whose answer was lost
        worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER),
                        account)
        record = JobRecord(job_id, 1, 8, 5, 3, FEE, "claimed")
        worker.jobs.append(record)
        worker._compute_and_commit(record, submitter.job(job_id), a, b, c)
        assert record.stage == "committed"
        worker._finalize(record, submitter.job(job_id))
        assert record.stage == "verified" and worker.status()["earned_wei"] == FEE
        assert submitter.job(job_id).status == JOB_DONE
    finally:
        for market in (submitter, me):
            market.close()
        if worker is not None:
            worker.chain.close()


def test_a_worker_restarted_during_its_withdrawal_takes_no_jobs(node, tmp_path):
    """A withdrawal requested (POST /admin/withdraw) and the worker restarted before the
    cooldown: it knew nothing of the pending withdrawal, so it computed every job and sent
    commits the chain reverts ("worker is withdrawing"), recording each job "lost"."""
    rng = np.random.default_rng(24)
    a, b = rng.standard_normal((6, 5), np.float32), rng.standard_normal((5, 4), np.float32)
    account = dev_accounts(7)[6]
    submitter, me = Market(node.url, dev_account(1)), Market(node.url, account)
    me.send("register", value=ETHER)
    me.send("requestWithdraw")
    worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER),
                    account)
    thread = run_worker(worker)
    ids: list[int] = []
    try:
        ids = submit_as_declared(submitter, FEE, [(a, b, (1, 6, 5, 4), FP32)])
        wait_for(lambda: worker._next_block > submitter.block_number(), 10,
                 "the worker to see the job")
        time.sleep(1.5)  # a batch would have been computed and committed by now
        assert worker.job_list() == []
        assert worker.status()["accepting_jobs"] is False
    finally:
        stop_worker(worker, thread)
        _cancel_open(submitter, ids)
        for market in (submitter, me):
            market.close()


def test_the_earnings_gauge_after_a_restart_agrees_with_the_status(node, tmp_path):
    """needle_earned_wei started at 0 on every start while /status summed the journal's
    verified jobs: the dashboard and Prometheus disagreed on what the node earned."""
    done = [JobRecord(i, 1, 2, 3, 4, (i + 1) * FEE, "verified", started=1000.0 + i)
            for i in range(3)]
    (tmp_path / "worker-jobs.jsonl").write_text(
        "".join(json.dumps(asdict(r)) + "\n" for r in done))
    worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER),
                    dev_accounts(8)[7])
    try:
        earned = worker.status()["earned_wei"]
        assert earned == 6 * FEE
        assert _metric(worker.metrics.render().decode(), "needle_earned_wei") == earned
    finally:
        worker.chain.close()


def test_a_chain_node_outage_is_logged_once_and_so_is_its_end(node, tmp_path, caplog):
    """While the chain node was unreachable the worker's loop retried every second in
    silence: only needle_chain_errors_total rose. It now says so once, and when it is over."""
    account = dev_accounts(9)[8]
    Market(node.url, account).send("register", value=ETHER)
    proxy = FlakyProxy(node.url, drop=True)
    config = WorkerConfig(rpc_url=proxy.url, data_dir=tmp_path, stake_wei=ETHER,
                          api_port=free_port(), poll_interval=0.2)
    worker = Worker(config, account)
    caplog.set_level(logging.INFO, logger="needle.worker")

    def said(text: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if text in r.getMessage()]

    thread = run_worker(worker)
    try:
        wait_for(lambda: proxy.requests >= 5, 15, "the worker to follow the chain")
        proxy.failed, proxy.failures = 0, 10**9  # every connection cut from now on
        wait_for(lambda: said("chain node unreachable"), 15, "the outage to be logged")
        time.sleep(2.5)  # more failed polls, which must not log again
        proxy.failures = 0
        wait_for(lambda: said("chain node reachable again"), 15, "the recovery to be logged")
    finally:
        stop_worker(worker, thread)
        proxy.close()
    assert len(said("chain node unreachable")) == 1
    assert said("chain node unreachable")[0].levelno == logging.WARNING
    assert len(said("chain node reachable again")) == 1
