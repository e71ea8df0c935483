"""A Ctrl-C at any point after a submission reached the chain cancels its jobs, for their
fees back. CI caught `needle-net submit` interrupted in the instant between the receipt and
`wait()` (the jobs on chain, the client not yet following them): it said only "interrupted"
and left the job open with its fee in escrow. The interrupts are raised at those points by
subclasses, so each point is hit every time; the node, the market and the money are real."""

import numpy as np
import pytest

from chain.devnet import dev_account
from node.client import JobClient
from node.market import JOB_CANCELLED, JOB_OPEN, Market

pytestmark = pytest.mark.timeout(300)
FEE = 10**15
SUBMITTER = 15


class _InterruptedBeforeWait(JobClient):
    """Ctrl-C after the receipt came back, before `wait` follows the jobs."""

    def wait(self, pending):
        raise KeyboardInterrupt


class _InterruptedAsMined(JobClient):
    """Ctrl-C while the node's answer to a submission it mined was on its way."""

    def _send_submission(self, signed, sign_again):
        super()._send_submission(signed, sign_again)
        raise KeyboardInterrupt


class _InterruptedBeforeSent(JobClient):
    """Ctrl-C after signing, before the first submission reached the node."""

    interrupted = False

    def _send_submission(self, signed, sign_again):
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return super()._send_submission(signed, sign_again)


@pytest.fixture(scope="module")
def observer(node):
    market = Market(node.url, dev_account(7))
    yield market
    market.close()


def _gas_paid(observer: Market, count_before: int) -> int:
    """Wei the submitter paid in gas since the market had `count_before` jobs: each new job's
    submission and cancellation."""
    transactions = {log["transactionHash"]
                    for event in ("JobSubmitted", "JobCancelled")
                    for log in getattr(observer.contract.events, event).get_logs(from_block=0)
                    if log["args"]["jobId"] >= count_before}
    receipts = [observer.w3.eth.get_transaction_receipt(tx) for tx in transactions]
    return sum(r["gasUsed"] * r["effectiveGasPrice"] for r in receipts)


@pytest.mark.parametrize("client_class", [_InterruptedBeforeWait, _InterruptedAsMined])
def test_an_interrupt_after_the_jobs_opened_cancels_them(node, observer, client_class):
    submitter = dev_account(SUBMITTER).address
    jobs, balance = observer.job_count(), observer.balance_of(submitter)
    client = client_class(node.url, dev_account(SUBMITTER), fee_wei=FEE, timeout=30)
    pairs = [(np.ones((3, 2), np.float32), np.ones((2, 4), np.float32))] * 2
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            client.matmul_batch(pairs)
    finally:
        client.close()
    assert observer.job_count() == jobs + 2
    for job_id in (jobs, jobs + 1):
        assert f"job {job_id} cancelled, its 0.001 ETH fee refunded" in str(caught.value)
        assert observer.job(job_id).status == JOB_CANCELLED
    assert observer.balance_of(submitter) == balance - _gas_paid(observer, jobs)


def test_an_interrupt_before_the_node_had_the_submission_loses_no_nonce(node, observer):
    """Nothing was opened, and the nonce the unsent submission took is not skipped: the
    client's next submission is mined (behind a gap it would wait for good)."""
    jobs = observer.job_count()
    client = _InterruptedBeforeSent(node.url, dev_account(SUBMITTER), fee_wei=FEE, timeout=30)
    pair = (np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
    try:
        with pytest.raises(KeyboardInterrupt, match="may still open the job"):
            client.matmul(*pair)
        assert observer.job_count() == jobs
        [job] = client.submit([pair])
        assert observer.job(job.job_id).status == JOB_OPEN
        assert "cancelled" in client.abandon([job])
    finally:
        client.close()
