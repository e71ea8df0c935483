"""A worker whose chain node (and so its blob store) goes down while it fetches an open
job's operands, before its claim, or whose claim's every send fails on the network, against
real chain node processes on 127.0.0.1: the job was booked as an error and never taken
again, though it stayed open (the client waited for its timeout and cancelled). It is now
left open, taken again once the node is back, and done; a claim that landed although its
answer never came is found and kept."""
import threading

import numpy as np
import pytest
from helpers import run_worker, stop_worker, submit_as_declared, wait_for

from chain.devnet import dev_account
from chain.launch import NodeProcess
from node.market import JOB_CLAIMED, JOB_DONE, JOB_OPEN, Market
from node.worker import JobRecord, Worker, WorkerConfig

pytestmark = pytest.mark.timeout(180)
FEE, ETHER, FP32 = 10**15, 10**18, 1
SHAPE = (1, 640, 640, 640)  # above the small-job size: fetched, then claimed on its own


def _large_job(submitter: Market) -> int:
    rng = np.random.default_rng(31)
    a = rng.standard_normal(SHAPE[1:3], np.float32)
    b = rng.standard_normal(SHAPE[2:], np.float32)
    (job_id,) = submit_as_declared(submitter, FEE, [(a, b, SHAPE, FP32)])
    return job_id


def test_an_outage_during_the_fetch_leaves_the_job_open_and_it_is_done_later(tmp_path):
    with NodeProcess(tmp_path / "chain", block_time=0) as node:
        account = dev_account(5)
        Market(node.url, account).send("register", value=ETHER)
        submitter = Market(node.url, dev_account(6))
        job_id = _large_job(submitter)
        worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path / "w",
                                     stake_wei=ETHER, poll_interval=0.2), account)
        job = submitter.job(job_id)
        record = JobRecord(job_id, *SHAPE, FEE, "fetching")
        worker.jobs.append(record)
        worker._tasks += 1
        node.stop()  # the node and its blob listener gone while the worker fetches
        worker._process(record, job, "claim")  # its retries run out
        assert record not in worker.jobs and worker._tasks == 0
        assert job_id in worker._candidates  # not booked as an error: taken again
        node.start()
        thread = run_worker(worker)
        try:
            wait_for(lambda: submitter.job(job_id).status == JOB_DONE, 90, "the job done")
            assert [j["stage"] for j in worker.job_list() if j["job_id"] == job_id] \
                in (["verified"], ["committed"])
        finally:
            stop_worker(worker, thread)


@pytest.mark.parametrize("landed", [True, False])
def test_a_claim_whose_sends_all_failed_is_settled_by_asking_the_chain(tmp_path, landed):
    with NodeProcess(tmp_path / "chain", block_time=0) as node:
        account = dev_account(7)
        me = Market(node.url, account)
        me.send("register", value=ETHER)
        submitter = Market(node.url, dev_account(8))
        job_id = _large_job(submitter)
        job = submitter.job(job_id)
        if landed:
            me.send("claimJob", job_id)  # the send whose answer never came
        worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path / "w",
                                     stake_wei=ETHER), account)
        worker._head = submitter.block_number()
        record = JobRecord(job_id, *SHAPE, FEE, "fetching")
        worker.jobs.append(record)
        port = node.port
        node.stop()
        restart = threading.Timer(14.0, node.start)  # after the claim's bounded retries
        restart.start()
        try:
            deadline = worker._try_claim(record, job)
        finally:
            restart.join()
        assert node.port == port
        if landed:
            assert deadline == submitter.job(job_id).deadline and record.stage == "claimed"
            assert submitter.job(job_id).status == JOB_CLAIMED
        else:
            assert deadline is None and record not in worker.jobs
            assert job_id in worker._candidates and submitter.job(job_id).status == JOB_OPEN
        worker.chain.close()
