"""Soak review of the long-running worker: what it keeps in memory must not grow with the
jobs it ever did. Real chain node process, a real worker (its job loop and its HTTP API on
127.0.0.1) taking real jobs; the chain's own events are the reference for what it earned."""
import json

import httpx
import numpy as np
import pytest
from helpers import run_worker, stop_worker, submit_as_declared, wait_for
from prometheus_client.parser import text_string_to_metric_families

import chain.client as chain_client_module
import node.worker as worker_module
from chain.devnet import dev_account, dev_accounts
from chain.launch import NodeProcess
from node.devnet import free_port
from node.market import Market
from node.worker import Worker, WorkerConfig

pytestmark = pytest.mark.timeout(120)
FEE = 10**15
ETHER = 10**18
FP32 = 1
HISTORY = 4  # finished jobs the worker keeps in memory, small for the test
ROUNDS, JOBS_PER_ROUND = 4, 6


def _jobs(rng, count: int) -> list[tuple]:
    return [(rng.standard_normal((6, 5), np.float32), rng.standard_normal((5, 3), np.float32),
             (1, 6, 5, 3), FP32) for _ in range(count)]


def _gauge(text: str, name: str) -> float:
    """A gauge's value in a Prometheus text exposition."""
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    return family.samples[0].value


def _close(worker: Worker) -> None:
    worker._pool.shutdown()
    worker._blob_pool.shutdown()
    worker.chain.close()


def test_finished_jobs_in_memory_stay_bounded_and_the_totals_still_count_every_job(
        node, tmp_path, monkeypatch):
    """Every finished job stayed in `Worker.jobs` for good: memory, each /status, each state
    save and each /jobs answer (the dashboard asks every second) grew with the node's whole
    history (/jobs took seconds of CPU at 100k jobs). Now only the latest HISTORY_JOBS
    finished jobs are kept (all are in the journal), while /status and needle_earned_wei
    still count every job, after a restart too, as the chain's JobVerified events do."""
    monkeypatch.setattr(worker_module, "HISTORY_JOBS", HISTORY, raising=False)
    account = dev_accounts(3)[2]
    api_port = free_port()
    config = WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER,
                          poll_interval=0.2, api_port=api_port)
    worker = Worker(config, account)
    thread = run_worker(worker)
    submitter = Market(node.url, dev_accounts(2)[1])
    rng = np.random.default_rng(23)
    sizes, listed = [], []
    try:
        for round_ in range(ROUNDS):  # a different fee per round: the sum is checked
            submit_as_declared(submitter, FEE * (round_ + 1), _jobs(rng, JOBS_PER_ROUND))
            done = JOBS_PER_ROUND * (round_ + 1)
            wait_for(lambda done=done: worker.status()["completed"] == done, 60,
                     f"{done} jobs verified")
            sizes.append(len(worker.jobs))
            listed.append(len(httpx.get(f"http://127.0.0.1:{api_port}/jobs").json()))
        status = httpx.get(f"http://127.0.0.1:{api_port}/status").json()
        metrics = httpx.get(f"http://127.0.0.1:{api_port}/metrics").text
    finally:
        stop_worker(worker, thread)

    verified = submitter.contract.events.JobVerified.get_logs(
        argument_filters={"worker": account.address}, from_block=0)
    total = ROUNDS * JOBS_PER_ROUND
    earned = sum(e["args"]["fee"] for e in verified)
    assert len(verified) == total and earned == FEE * JOBS_PER_ROUND * 10  # fees 1+2+3+4
    # bounded: at most 2 * HISTORY finished jobs between two trims, whatever the history
    assert max(sizes) <= 2 * HISTORY and max(listed) <= 2 * HISTORY, (sizes, listed)
    assert (status["completed"], status["failed"], status["in_flight"]) == (total, 0, 0)
    assert status["earned_wei"] == earned
    assert _gauge(metrics, "needle_earned_wei") == earned
    journal = [json.loads(line) for line in (tmp_path / "worker-jobs.jsonl").open()]
    assert sorted(r["job_id"] for r in journal) == sorted(e["args"]["jobId"] for e in verified)

    restarted = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER),
                       account)
    try:
        assert len(restarted.jobs) == HISTORY  # the latest ones, from the journal
        assert [r.job_id for r in restarted.jobs] == [r["job_id"] for r in journal[-HISTORY:]]
        again = restarted.status()
        assert (again["completed"], again["earned_wei"]) == (total, earned)
        assert restarted.metrics.earned._value.get() == earned
    finally:
        _close(restarted)


def test_claimed_by_asks_in_spans_the_node_answers(monkeypatch, tmp_path):
    """claimed_by (a worker's restart) asked for JobClaimed from block 0 in one query, which
    the node refuses (-32005) once the chain is longer than MAX_LOG_BLOCKS: on a chain of
    10,987 blocks a worker could not start. It now asks span by span (here spans of 2
    blocks, so the claims lie in different spans), and finds every claim."""
    with NodeProcess(tmp_path / "chain", block_time=0) as chain:
        worker, submitter = Market(chain.url, dev_account(14)), Market(chain.url, dev_account(15))
        worker.send("register", value=10**18)
        a, b = np.ones((2, 2), np.float32), np.ones((2, 2), np.float32)
        job_ids = []
        for _ in range(3):
            (job_id,) = submit_as_declared(submitter, 10**15, [(a, b, (1, 2, 2, 2), 1)])
            worker.send("claimJob", job_id)
            job_ids.append(job_id)
        assert worker.block_number() >= 6  # the claims lie in three different spans of 2
        monkeypatch.setattr(chain_client_module, "MAX_LOG_BLOCKS", 2)  # log_spans
        assert worker.claimed_by(worker.address) == set(job_ids)
        assert worker.claimed_by(submitter.address) == set()
