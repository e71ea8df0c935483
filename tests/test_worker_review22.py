"""Review of the worker against outages and overlapping admin calls, with a real chain node
process on 127.0.0.1 and a real HTTP proxy in front of it: a claimed job whose commit met a
chain node outage longer than the bounded retries (the job was dropped and its claim left to
expire, a stake cut), a worker stopped during such an outage, and two overlapping
POST /admin/withdraw calls (both sent requestWithdraw)."""
import logging
import threading
import time

import httpx
import numpy as np
import pytest
from helpers import FlakyProxy, run_worker, stop_worker, submit_as_declared, wait_for

from chain.devnet import dev_account, dev_accounts
from node.devnet import free_port
from node.market import JOB_CLAIMED, JOB_DONE, Market
from node.worker import CHEAT_ENV, FINISHED, Worker, WorkerConfig

pytestmark = pytest.mark.timeout(120)
FEE = 10**15
ETHER = 10**18
FP32 = 1
STALL = 2.0  # the worker waits this long after its claim: time to start the outage first
OUTAGE = 16.0  # longer than the bounded retries (8 tries, ~11.3 s of backoff)


def _claimed_worker_in_an_outage(node, tmp_path, monkeypatch, account, seed: int):
    """A worker behind a proxy that holds a claim on a fresh job; the proxy cuts every request
    (answers 503) from the moment the claim is mined. (worker, its thread, proxy, submitter
    market, job id)."""
    monkeypatch.setenv(CHEAT_ENV, "1")  # stall_after_claim: a window after the claim
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((8, 5), np.float32), rng.standard_normal((5, 3), np.float32)
    Market(node.url, account).send("register", value=ETHER)
    proxy = FlakyProxy(node.url)
    config = WorkerConfig(rpc_url=proxy.url, data_dir=tmp_path, stake_wei=ETHER,
                          poll_interval=0.2, stall_after_claim=STALL)
    worker = Worker(config, account)
    thread = run_worker(worker)
    submitter = Market(node.url, dev_account(1))
    (job_id,) = submit_as_declared(submitter, FEE, [(a, b, (1, 8, 5, 3), FP32)])
    wait_for(lambda: submitter.job(job_id).status == JOB_CLAIMED, 10, "the worker's claim")
    proxy.failed, proxy.failures = 0, 10**9  # the chain node unreachable from now on
    assert submitter.job(job_id).worker == account.address
    return worker, thread, proxy, submitter, job_id


def _events(market: Market, name: str, **filters) -> list:
    return getattr(market.contract.events, name).get_logs(argument_filters=filters,
                                                          from_block=0)


def test_a_claimed_job_outlives_an_outage_longer_than_the_bounded_retries(
        node, tmp_path, monkeypatch, caplog):
    """commitResult met a chain node outage of ~14 s: the worker gave up after 8 tries
    (~11 s), booked the job "error" and never committed it, so the claim would expire with a
    10 % stake cut. It now retries until the claim's deadline, commits once the node answers
    again, is paid, and logs the outage once."""
    account = dev_accounts(3)[2]
    caplog.set_level(logging.INFO, logger="needle.worker")
    worker, thread, proxy, submitter, job_id = _claimed_worker_in_an_outage(
        node, tmp_path, monkeypatch, account, seed=22)
    balance = submitter.balance_of(account.address)
    try:
        time.sleep(OUTAGE)
        assert submitter.job(job_id).status == JOB_CLAIMED  # nothing got through
        (record,) = worker.job_list()
        assert record["stage"] not in FINISHED, f"given up: {record['stage']} {record['detail']}"
        proxy.failures = 0  # the outage is over
        wait_for(lambda: submitter.job(job_id).status == JOB_DONE, 15,
                 "the job to be committed and finalised")
        wait_for(lambda: worker.job_list()[0]["stage"] in FINISHED, 10,
                 "the worker to record the verdict")
    finally:
        stop_worker(worker, thread)
        proxy.close()
    assert worker.job_list()[0]["stage"] == "verified", worker.job_list()
    assert submitter.job(job_id).worker == account.address
    (verified,) = _events(submitter, "JobVerified", jobId=job_id)
    assert verified["args"]["worker"] == account.address and verified["args"]["fee"] == FEE
    assert _events(submitter, "JobFailed", worker=account.address) == []  # never slashed
    assert submitter.stake_of(account.address) == ETHER
    assert submitter.balance_of(account.address) > balance  # the fee (and reward) beat gas
    held = [r for r in caplog.records if "job this worker holds" in r.getMessage()]
    assert [r.levelno for r in held] == [logging.WARNING, logging.INFO], \
        [r.getMessage() for r in held]
    submitter.close()


def test_a_worker_stopped_during_an_outage_stops_at_once(node, tmp_path, monkeypatch):
    """A stop request during an outage waited for the bounded retries of the job in flight
    to run out (~11 s); retries until the claim's deadline must not make it wait longer.
    The job stays claimed on the chain, for a restart to resume."""
    account = dev_accounts(4)[3]
    worker, thread, proxy, submitter, job_id = _claimed_worker_in_an_outage(
        node, tmp_path, monkeypatch, account, seed=23)
    try:
        time.sleep(STALL + 2.0)  # the commit is being retried
        started = time.monotonic()
        stop_worker(worker, thread)
        took = time.monotonic() - started
    finally:
        proxy.close()
    assert took < 3.0, f"the worker took {took:.1f} s to stop"
    assert submitter.job(job_id).status == JOB_CLAIMED
    submitter.close()


def test_overlapping_withdraw_requests_send_one_transaction(node, tmp_path):
    """Two POST /admin/withdraw at once both read "no withdrawal requested" and both sent
    requestWithdraw: twice the gas, and the second restarted the cooldown."""
    account = dev_accounts(5)[4]
    me = Market(node.url, account)
    me.send("register", value=ETHER)
    nonce = me.w3.eth.get_transaction_count(account.address)
    config = WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER,
                          api_port=free_port(), admin_token="s3cret")
    worker = Worker(config, account)
    thread = run_worker(worker)
    url = f"http://127.0.0.1:{config.api_port}"
    start = threading.Barrier(2)
    answers: list[httpx.Response] = []

    def withdraw() -> None:
        start.wait(5)
        answers.append(httpx.post(f"{url}/admin/withdraw", timeout=30,
                                  headers={"Authorization": "Bearer s3cret"}))

    try:
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 10, "the API")
        callers = [threading.Thread(target=withdraw) for _ in range(2)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(30)
    finally:
        stop_worker(worker, thread)
    requested = _events(me, "WithdrawRequested", worker=account.address)
    assert len(requested) == 1, requested
    assert me.w3.eth.get_transaction_count(account.address) == nonce + 1
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    available = requested[0]["args"]["availableBlock"]
    for answer in answers:
        assert answer.json()["requested"] is True
        assert answer.json()["available_block"] == available
        assert answer.json()["stake_wei"] == ETHER
    me.close()


def test_a_job_given_up_for_an_error_is_counted_as_one(node, tmp_path):
    """A small job whose A the blob store does not have is given up before any transaction
    ("error"), which /status and the journal showed while needle_jobs_total counted no error."""
    account = dev_accounts(6)[5]
    Market(node.url, account).send("register", value=ETHER)
    submitter = Market(node.url, dev_account(1))
    b_id = submitter.put_array(np.ones((5, 3), np.float32))
    first = submitter.job_count()
    submitter.send("submitJobs", [bytes(range(32))], [b_id], [1], [4], [5], [3], [FP32], [FEE],
                   50, value=FEE)
    config = WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER,
                          poll_interval=0.2, api_port=free_port())
    worker = Worker(config, account)
    thread = run_worker(worker)
    try:
        wait_for(lambda: [j["stage"] for j in worker.job_list() if j["job_id"] == first]
                 == ["error"], 30, "the job to be given up")
        metrics = httpx.get(f"http://127.0.0.1:{config.api_port}/metrics").text
    finally:
        stop_worker(worker, thread)
        submitter.send("cancel", first)
        submitter.close()
    assert 'needle_jobs_total{outcome="error"} 1.0' in metrics, metrics


def test_small_jobs_whose_finalisation_would_not_fit_a_block_go_in_several_batches(
        node, tmp_path, monkeypatch):
    """One finalizeJobs for a whole batch of small jobs: thin ones (64 x 32768 x 64) asked for
    more gas than a block holds, and the node refused the transaction. With room for two
    jobs' finalisation, three jobs go in two batches, and all are verified."""
    from node import worker as worker_module
    from node.market import FINALIZE_JOBS_GAS, finalize_gas

    account = dev_accounts(7)[6]
    Market(node.url, account).send("register", value=ETHER)
    submitter = Market(node.url, dev_account(1))
    rng = np.random.default_rng(24)
    jobs = [(rng.standard_normal((6, 5), np.float32), rng.standard_normal((5, 4), np.float32),
             (1, 6, 5, 4), FP32) for _ in range(3)]
    ids = submit_as_declared(submitter, FEE, jobs)
    one = finalize_gas(submitter.job(ids[0]))
    monkeypatch.setattr(worker_module, "BATCH_FINALIZE_GAS", FINALIZE_JOBS_GAS + 2 * one)
    config = WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER,
                          poll_interval=0.2)
    worker = Worker(config, account)
    thread = run_worker(worker)
    try:
        wait_for(lambda: all(submitter.job(i).status == JOB_DONE for i in ids), 30,
                 "the three jobs to be verified")
    finally:
        stop_worker(worker, thread)
        submitter.close()
    commits = _events(submitter, "ResultCommitted", worker=account.address)
    assert sorted(e["args"]["jobId"] for e in commits) == ids
    assert len({e["transactionHash"] for e in commits}) == 2  # 2 jobs, then 1
