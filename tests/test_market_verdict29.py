"""Market.verdict for a commit whose operands the chain rejected, from a review: the job is
cancelled and its fee refunded (JobCancelled, which names no worker), and verdict() found no
verdict at all, so a worker whose commit someone else finalised booked the job "lost: not
finalised in time". A job its submitter cancelled while open is still no one's verdict.
Real chain node process (conftest's `node`) and real signed transactions."""
import numpy as np
import pytest
from helpers import finalize_when_due

from chain.devnet import dev_account
from node.market import JOB_CANCELLED, Market, Verdict

pytestmark = pytest.mark.timeout(120)
ETHER, FEE = 10**18, 10**15


@pytest.fixture(scope="module")
def parties(node):
    worker, submitter, other = (Market(node.url, dev_account(i)) for i in (12, 11, 10))
    worker.send("register", value=ETHER)
    yield worker, submitter, other
    for market in (worker, submitter, other):
        market.close()


def _submit(submitter: Market, a_id: bytes, b_id: bytes) -> int:
    job_id = submitter.job_count()
    submitter.send("submitJob", a_id, b_id, 1, 2, 2, 2, 1, 20, value=FEE)
    return job_id


def test_a_commit_whose_operands_were_rejected_is_a_cancelled_verdict(parties):
    worker, submitter, other = parties
    present = submitter.put_array(np.ones((2, 2), np.float32))
    missing = bytes(range(32))  # no blob of this id in the store: the operands are bad
    job_id = _submit(submitter, missing, present)
    worker.send("commitJobs", [job_id], [present])
    finalize_when_due(other, job_id)  # someone else finalises: the worker has no receipt
    assert submitter.job(job_id).status == JOB_CANCELLED
    assert worker.verdict(job_id, worker.address) == Verdict(False, cancelled=True)


def test_a_job_its_submitter_cancelled_is_no_workers_verdict(parties):
    worker, submitter, other = parties
    ids = submitter.put_array(np.ones((2, 2), np.float32))
    open_job = _submit(submitter, ids, ids)
    submitter.send("cancel", open_job)
    assert worker.verdict(open_job, worker.address) is None

    # a failed commit, the job reopened, then cancelled by its submitter: the failure stands
    failed_job = _submit(submitter, ids, ids)
    worker.send("commitJobs", [failed_job], [ids])  # C = A, not A @ A = 2 A: fails
    finalize_when_due(other, failed_job)
    submitter.send("cancel", failed_job)
    verdict = worker.verdict(failed_job, worker.address)
    assert verdict is not None and not verdict.passed and not verdict.cancelled
    assert verdict.slashed_wei == ETHER // 2
