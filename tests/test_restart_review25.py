"""Riding out restarts and slashes, from a review: a worker whose stake a slash cut below
the minimum, a commit that reverts past its deadline while the chain node is down, and a
client whose blob store restarts during its upload. Real chain node processes on
127.0.0.1; the faults are injected by stopping and starting the node."""
import logging
import threading

import numpy as np
import pytest
from helpers import run_worker, stop_worker, submit_as_declared, wait_for

from chain.blobs import blob_id, encode_array
from chain.devnet import dev_account
from chain.launch import NodeProcess
from node.client import PRESIGN_BYTES, JobClient
from node.market import JOB_DONE, JOB_OPEN, Market
from node.worker import JobRecord, Worker, WorkerConfig

pytestmark = pytest.mark.timeout(180)
FEE = 10**15
ETHER = 10**18


def _slash_below_minimum(holder: Market, submitter: Market, ids: bytes) -> None:
    """A claim of the holder's key that it misses (1-block deadline), reopened: 10 % of its
    stake cut, below the market's minimum (the job is cancelled: a fee of 0 it never takes)."""
    first = submitter.job_count()
    submitter.send("submitJob", ids, ids, 1, 2, 2, 2, 1, 1)  # no fee, 1-block deadline
    holder.send("claimJob", first)
    submitter.send("register", value=ETHER)  # a block later: the deadline passed
    submitter.send("reopenExpired", first)
    submitter.send("cancel", first)
    assert holder.stake_of(holder.address) < holder.min_stake()


def test_a_job_opened_while_the_stake_was_below_the_minimum_is_taken_after_the_top_up(
        tmp_path):
    """A slash cut the worker's stake below the minimum: it skipped the jobs opened then,
    and forgot them (taken off its candidates for good, their JobSubmitted behind its scan),
    so after `needle-net stake` topped it up they stayed open until their submitters gave up.
    They are now kept and taken once the stake is back."""
    account = dev_account(19)
    with NodeProcess(tmp_path / "chain", block_time=0) as chain:
        worker = Worker(WorkerConfig(rpc_url=chain.url, data_dir=tmp_path / "worker",
                                     stake_wei=ETHER, min_fee_wei=FEE, poll_interval=0.2),
                        account)
        thread = run_worker(worker)
        holder, submitter = Market(chain.url, account), Market(chain.url, dev_account(18))
        try:
            wait_for(lambda: worker.status()["stake_wei"] == ETHER, 30, "the stake")
            ids = submitter.put_array(np.ones((2, 2), np.float32))
            _slash_below_minimum(holder, submitter, ids)
            wait_for(lambda: not worker.status()["accepting_jobs"], 30, "the slash to be seen")

            job_id = submitter.job_count()
            submitter.send("submitJob", ids, ids, 1, 2, 2, 2, 1, 20, value=FEE)
            seen = submitter.block_number()
            wait_for(lambda: worker._next_block > seen, 30, "the job to be seen")
            submitter.send("register", value=ETHER)  # one more block: that poll is over
            after = submitter.block_number()
            wait_for(lambda: worker._next_block > after, 30, "the next block to be seen")
            assert submitter.job(job_id).status == JOB_OPEN

            holder.send("register", value=ETHER // 10)  # `needle-net stake`: topped up
            wait_for(lambda: submitter.job(job_id).status == JOB_DONE, 30,
                     "the job opened while the stake was short to be done")
            assert submitter.job(job_id).worker == account.address
        finally:
            stop_worker(worker, thread)
            holder.close()
            submitter.close()


@pytest.mark.parametrize("size", [4, 400], ids=["signed-while-uploading", "large"])
def test_a_submission_uploaded_while_the_chain_node_restarts_opens_its_job(tmp_path, size):
    """The chain node (its blob store) restarting as a client submits: the upload of A and B
    failed at once with "[stage upload] ConnectionRefusedError" while the user's timeout was
    60 s (the submission's send waited the refusals out). The upload now waits too, and the
    job opens once, naming the operands' blobs, which the store holds."""
    with NodeProcess(tmp_path / "chain", block_time=0) as chain:
        client = JobClient(chain.url, dev_account(16), fee_wei=FEE, timeout=60,
                           poll_interval=0.2)
        rng = np.random.default_rng(size)
        a = rng.standard_normal((size, size), np.float32)
        b = rng.standard_normal((size, size), np.float32)
        assert (2 * a.nbytes <= PRESIGN_BYTES) == (size == 4)
        chain.stop()
        restart = threading.Timer(2.0, chain.start)
        restart.start()
        try:
            (pending,) = client.submit([(a, b)])
            restart.join(60)
            job = client.market.job(pending.job_id)
            assert (job.submitter, job.status) == (client.address, JOB_OPEN)
            assert (job.a_id, job.b_id) == (blob_id(encode_array(a)), blob_id(encode_array(b)))
            np.testing.assert_array_equal(client.market.get_array(job.a_id), a)
            np.testing.assert_array_equal(client.market.get_array(job.b_id), b)
            assert client.market.job_count() == pending.job_id + 1
            client.market.send("cancel", pending.job_id)
        finally:
            restart.join(60)
            client.close()


@pytest.mark.parametrize("down, booked", [("after", "lost"), ("before", "expired")])
def test_a_commit_past_its_deadline_while_the_node_restarts_is_not_an_error(
        tmp_path, caplog, down, booked):
    """The commit of a claim went out just before the job loop saw the deadline pass, and
    reverted ("deadline passed"); the look-up that asks whether an earlier send of it had
    landed then found the chain node down. It gave up at once (the deadline had passed), and
    the job was booked "error" with a traceback in the log; so was a commit whose send found
    the node down once the deadline had passed. The look-up now waits for the node, and the
    job is booked lost (the commit reverted) or expired (never sent), without a traceback."""
    account = dev_account(13)
    with NodeProcess(tmp_path / "chain", block_time=0) as chain:
        worker = Worker(WorkerConfig(rpc_url=chain.url, data_dir=tmp_path / "worker",
                                     stake_wei=ETHER, poll_interval=0.2), account)
        submitter = Market(chain.url, dev_account(12))
        restart = None
        try:
            worker._ensure_registered()
            rng = np.random.default_rng(4)
            a, b = rng.standard_normal((6, 5), np.float32), rng.standard_normal((5, 3),
                                                                               np.float32)
            (job_id,) = submit_as_declared(submitter, FEE, [(a, b, (1, 6, 5, 3), 1)])
            worker.chain.send("claimJob", job_id)
            job = worker.chain.job(job_id)
            while submitter.block_number() <= job.deadline:  # the deadline passes
                submitter.send("register", value=ETHER)
            worker._head = job.deadline - 1  # the job loop has not seen it pass yet
            sends = worker.chain.send_with_gas

            def lose_the_node() -> None:
                nonlocal restart
                worker._head = submitter.block_number()  # the loop saw the deadline pass
                chain.stop()
                restart = threading.Timer(1.0, chain.start)
                restart.start()

            def commit_and_lose_the_node(gas, fn_name, *args):
                if fn_name == "commitResult" and down == "before":
                    lose_the_node()
                try:
                    return sends(gas, fn_name, *args)
                finally:
                    if fn_name == "commitResult" and down == "after":  # it reverted
                        lose_the_node()

            worker.chain.send_with_gas = commit_and_lose_the_node
            record = JobRecord(job_id, 1, 6, 5, 3, FEE, "claimed")
            worker.jobs.append(record)
            worker._tasks += 1
            with caplog.at_level(logging.INFO, logger="needle.worker"):
                worker._process(record, job, "compute")
            assert restart is not None
            assert record.stage == booked, (record.stage, record.detail)
            assert "deadline" in record.detail
            assert not [r for r in caplog.records if r.exc_info], caplog.text
            restart.join(60)
            assert submitter.job(job_id).status != JOB_DONE
        finally:
            if restart is not None:
                restart.join(60)
            submitter.close()
            worker.close()


def test_a_claim_refused_after_a_slash_keeps_its_job_and_reads_the_stake(tmp_path):
    """A claim sent just after a slash cut the stake below the minimum (the worker's view of
    it is refreshed once a second) reverts "worker stake below minStake": the job was
    dropped for good, still open, and the stale view let the next jobs' claims revert too.
    The stake is now read at once (no job accepted) and the job kept, taken once topped up."""
    account = dev_account(11)
    with NodeProcess(tmp_path / "chain", block_time=0) as chain:
        worker = Worker(WorkerConfig(rpc_url=chain.url, data_dir=tmp_path / "worker",
                                     stake_wei=ETHER, poll_interval=0.2), account)
        submitter = Market(chain.url, dev_account(10))
        try:
            worker._ensure_registered()
            ids = submitter.put_array(np.ones((2, 2), np.float32))
            _slash_below_minimum(worker.chain, submitter, ids)
            assert worker.status()["accepting_jobs"] is True  # the view before the refresh
            job_id = submitter.job_count()
            submitter.send("submitJob", ids, ids, 1, 2, 2, 2, 1, 20, value=FEE)
            record = JobRecord(job_id, 1, 2, 2, 2, FEE, "fetching")
            worker.jobs.append(record)
            assert worker._try_claim(record, submitter.job(job_id)) is None
            assert record not in worker.jobs  # never this worker's: not booked
            assert worker.status()["accepting_jobs"] is False
            assert job_id in worker._candidates
            assert submitter.job(job_id).status == JOB_OPEN
        finally:
            submitter.close()
            worker.close()


def test_a_client_keeps_the_blob_port_after_the_whole_node_was_down(tmp_path):
    """A refused blob port moved every later transfer to the main port's /blobs for good,
    even when the main port refused too (the node restarting): now the move is made only
    once the fallback answers, and the blob port is used again when the node is back."""
    from chain.blobhttp import BlobClient
    from chain.blobs import BlobStore
    from chain.blobserver import BlobServer

    store = BlobStore(tmp_path / "blobs", 1 << 20, reserve_bytes=0)
    fast, main = BlobServer(store).start(), BlobServer(store).start()  # one store, two ports
    ports = fast.port, main.port
    client = BlobClient(f"http://127.0.0.1:{ports[0]}/blobs", 1 << 20,
                        fallback_url=f"http://127.0.0.1:{ports[1]}/blobs")
    try:
        id_ = client.put(encode_array(np.arange(6, dtype=np.int32)))
        assert client.connections is not client.fallback
        fast.close()
        main.close()
        with pytest.raises(ConnectionRefusedError):
            client.has(id_)
        assert client.connections is not client.fallback  # the blob port kept
        fast = BlobServer(store, port=ports[0]).start()
        main = BlobServer(store, port=ports[1]).start()
        assert client.has(id_) and client.connections is not client.fallback
        main.close()  # the blob port alone up: the main port's state does not matter now
        assert client.has(id_)
    finally:
        client.close()
        fast.close()
        main.close()
