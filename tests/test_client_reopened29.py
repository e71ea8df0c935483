"""A client whose job a worker claimed and then let expire: at the timeout it said "no worker
moved the job on", as if none had ever taken it (from a review, where the worker's disk was
full). It now says the job was taken and reopened. Real chain node process (conftest's
`node`), a real claim, and the client's own reopenExpired."""
import threading

import numpy as np
import pytest
from helpers import wait_for

from chain.devnet import dev_account
from node.client import JobClient, RemoteJobError
from node.market import JOB_CANCELLED, Market

pytestmark = pytest.mark.timeout(120)
FEE = 10**15


def test_a_timeout_after_an_expired_claim_says_the_job_was_taken_and_reopened(node):
    claimer = Market(node.url, dev_account(8))
    client = JobClient(node.url, dev_account(9), fee_wei=FEE, timeout=8, timeout_blocks=1,
                       poll_interval=0.2)
    first = claimer.job_count()
    failure = []

    def submit() -> None:
        try:
            client.matmul(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32))
        except RemoteJobError as err:
            failure.append(err)

    thread = threading.Thread(target=submit, daemon=True)
    try:
        claimer.send("register", value=10**18)
        thread.start()
        wait_for(lambda: claimer.job_count() > first, 30, "the job")
        claimer.send("claimJob", first)
        for _ in range(2):  # blocks past the 1-block deadline: the client reopens the job
            claimer.send("register", value=1)
        thread.join(60)
        assert not thread.is_alive()
        (err,) = failure
        assert err.job_id == first and err.stage == "submitted"
        assert ("no worker moved the job on since it was reopened: taken 1 time(s), by "
                "workers that missed their deadline or whose result failed the check") \
            in err.message, err.message
        assert claimer.job(first).status == JOB_CANCELLED  # the client's abandon: refunded
    finally:
        thread.join(60)
        client.close()
        claimer.close()
