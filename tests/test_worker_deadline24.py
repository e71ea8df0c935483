"""A worker claims a large job only if it can commit it by the deadline. It claimed any job of
at least --min-deadline blocks, even one a fast chain's blocks ran out on long before the
product was done: the claim expired, and anyone reopening it cut 10 % of the stake. Now it
compares the seconds it needs after a claim (its timed compute and transfer rates) with the
seconds the deadline gives at the shortest block interval it saw lately, and claims with a
margin. A real chain node sealing a block every 0.05 s, a real worker, real transactions."""
import logging

import numpy as np
import pytest
from helpers import run_worker, stop_worker, wait_for

from chain.devnet import dev_account
from node.market import JOB_DONE, JOB_OPEN, ZERO_ADDRESS, Market
from node.worker import (
    DEFAULT_BLOCK_SECONDS,
    RECENT_SECONDS,
    TRANSACTION_SECONDS,
    BlockPace,
    Worker,
    WorkerConfig,
    seconds_given,
    seconds_needed,
)

pytestmark = pytest.mark.timeout(180)
ETHER = 10**18
FEE = 10**15
FP32 = 1
BLOCK_SECONDS = 0.05


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A chain node that seals a block every 0.05 s (and at once for a pending transaction)."""
    from chain.launch import NodeProcess

    with NodeProcess(tmp_path_factory.mktemp("chain") / "data",
                     block_time=BLOCK_SECONDS) as proc:
        yield proc


def test_a_job_whose_deadline_the_worker_cannot_meet_is_not_claimed(node, tmp_path, caplog):
    """4096 x 2048 x 2048 (34 GFLOP, a 32 MB C): hundreds of milliseconds on any CPU, and at
    least 2 x 0.1 s of transactions anywhere, against a 5-block deadline, which gives 0.2 s
    at 0.05 s per block. The same job with 2000 blocks (100 s) is claimed and paid."""
    caplog.set_level(logging.INFO, logger="needle.worker")
    account, submitter = dev_account(2), Market(node.url, dev_account(1))
    worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER),
                    account)
    thread = run_worker(worker)
    try:
        rng = np.random.default_rng(0)
        a = rng.standard_normal((4096, 2048), np.float32)
        b = rng.standard_normal((2048, 2048), np.float32)
        a_id, b_id = submitter.put_array(a), submitter.put_array(b)
        short = submitter.job_count()
        submitter.send("submitJob", a_id, b_id, 1, 4096, 2048, 2048, FP32, 5, value=FEE)
        submitter.send("submitJob", a_id, b_id, 1, 4096, 2048, 2048, FP32, 2000, value=FEE)
        assert worker.config.min_deadline_blocks <= 5  # not refused for --min-deadline
        wait_for(lambda: any(j["job_id"] == short + 1 and j["stage"] == "verified"
                             for j in worker.job_list()), 120,
                 "the job with a 2000-block deadline verified")
        assert submitter.job(short + 1).status == JOB_DONE
        job = submitter.job(short)
        assert (job.status, job.worker) == (JOB_OPEN, ZERO_ADDRESS)  # never claimed
        assert submitter.stake_of(account.address) == ETHER
        passed_over = [r.getMessage() for r in caplog.records
                       if r.getMessage().startswith(f"job {short} not claimed")]
        assert len(passed_over) == 1, passed_over  # looked at on every block, logged once
        assert "5 blocks" in passed_over[0]
        submitter.send("cancel", short)  # still open: the fee comes back
    finally:
        stop_worker(worker, thread)
        submitter.close()


def test_the_estimate_against_hand_computed_numbers():
    # 2 GFLOP at 1 GFLOP/s, 100 MB of C at 100 MB/s, and the claim and the commit
    assert seconds_needed(2 * 10**9, 10**8, 1e9, 1e8) == pytest.approx(
        2.0 + 1.0 + 2 * TRANSACTION_SECONDS)
    # the commit must be sent before the deadline's block: 4 of the 5 blocks count
    assert seconds_given(5, 0.2) == pytest.approx(0.8)
    assert seconds_given(1, 0.2) == 0.0

    pace = BlockPace()
    assert pace.interval(0.0) == DEFAULT_BLOCK_SECONDS  # nothing measured yet
    pace.observe(10, 100.0)
    pace.observe(12, 100.5)  # a window shorter than a second is not a measurement
    assert pace.interval(100.5) == DEFAULT_BLOCK_SECONDS
    pace.observe(20, 101.0)  # 10 blocks in 1 s
    assert pace.interval(101.0) == pytest.approx(0.1)
    pace.observe(21, 103.0)  # 1 block in 2 s: the shortest interval lately still counts
    assert pace.interval(103.0) == pytest.approx(0.1)
    # once the fast window is no longer recent, the slow one is the pace
    assert pace.interval(101.0 + RECENT_SECONDS + 1) == pytest.approx(2.0)
    pace.observe(5, 104.0)  # another chain (the head went back): a new window starts
    pace.observe(6, 104.5)
    assert pace.interval(104.5) == pytest.approx(0.1)


def test_a_batch_of_many_tiny_products_is_priced_by_its_products(node, tmp_path, caplog):
    """400,000 products of 1 x 1 matrices: 800 kFLOP, nothing at the probe's rate, but the
    worker computes a batch product by product, each a call of microseconds. A 20-block
    deadline (about 1 s) covers the FLOPs, C's 1.6 MB and the transactions twice over, so
    the worker claimed such a job, and its claim expired (a 10 % stake cut for anyone who
    reopened it); it now counts each product's fixed cost and passes the job over."""
    caplog.set_level(logging.INFO, logger="needle.worker")
    account, submitter = dev_account(4), Market(node.url, dev_account(1))
    worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER,
                                 direct_commit_flops=0), account)  # every job a large one
    thread = run_worker(worker)
    try:
        a = np.ones((400_000, 1, 1), np.float32)
        a_id = submitter.put_array(a)
        job_id = submitter.job_count()
        submitter.send("submitJob", a_id, a_id, 400_000, 1, 1, 1, FP32, 20, value=FEE)

        def passed_over():
            return [r.getMessage() for r in caplog.records
                    if r.getMessage().startswith(f"job {job_id} not claimed")]
        wait_for(lambda: passed_over(), 60, "the worker to pass the job over")
        assert "20 blocks" in passed_over()[0]
        job = submitter.job(job_id)
        assert (job.status, job.worker) == (JOB_OPEN, ZERO_ADDRESS)
        assert submitter.stake_of(account.address) == ETHER
        submitter.send("cancel", job_id)
    finally:
        stop_worker(worker, thread)
        submitter.close()
