"""Worker review 25, against a real chain node process on 127.0.0.1 (a real HTTP proxy in
front of it for an outage, a real worker process killed with SIGKILL): two workers on one
data dir (both ran and wrote the same state file and journal), a batch commit signed with a
nonce another client with the worker's key took (the batch failed), a worker stopped during
an outage (its held job booked as an error, then listed twice after the restart), a job
taken while the stake's withdrawal was requested (a claim or commit sent that must revert),
and a worker killed between a batch's verdicts and their save (the batch missing from the
books after the restart)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from helpers import FlakyProxy, one_block, run_worker, stop_worker, submit_as_declared, wait_for

from chain.devnet import dev_account
from node.market import JOB_CLAIMED, JOB_DONE, JOB_OPEN, Job, Market
from node.worker import CHEAT_ENV, JobRecord, Worker, WorkerConfig, WorkerStartError

pytestmark = pytest.mark.timeout(180)
ETHER = 10**18
FEE = 10**15
FP32 = 1
REPO = Path(__file__).resolve().parents[1]


def _job(seed: int, m: int = 6, n: int = 4) -> tuple:
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((m, 5), np.float32), rng.standard_normal((5, n), np.float32)
    return a, b, (1, m, 5, n), FP32


def _config(url: str, data_dir: Path, **options) -> WorkerConfig:
    return WorkerConfig(rpc_url=url, data_dir=data_dir, stake_wei=ETHER, poll_interval=0.2,
                        **options)


def _taken(worker: Worker, jobs: list[Job], stage: str) -> list[JobRecord]:
    """Records of `jobs` as the job loop makes them when it takes them (at `stage`)."""
    records = [JobRecord(j.job_id, j.batch, j.m, j.k, j.n, j.fee_wei, stage) for j in jobs]
    worker.jobs.extend(records)
    worker._tasks += 1
    worker._head = worker.chain.block_number()
    return records


def _cancel_open(market: Market, ids: list[int]) -> None:
    """Leave no open job behind for the next test's worker (a fresh one scans from block 0)."""
    for job_id in ids:
        if market.job(job_id).status == JOB_OPEN:
            market.send("cancel", job_id)


def test_a_second_worker_on_the_same_data_dir_is_refused(node, tmp_path):
    """Both ran: each rewrote worker-state.json and appended to worker-jobs.jsonl as if it
    were alone, and each resumed the other's jobs. The second is a start error naming the
    directory and the holder; once the first is closed, the dir is free again."""
    account = dev_account(2)
    first = Worker(_config(node.url, tmp_path), account)
    try:
        refusal = f"{re.escape(str(tmp_path))} is in use by another worker \\(pid {os.getpid()}\\)"
        with pytest.raises(WorkerStartError, match=refusal):
            Worker(_config(node.url, tmp_path), account)
    finally:
        first.close()
    first.close()  # a second close does nothing
    again = Worker(_config(node.url, tmp_path), account)
    again.close()


@pytest.mark.parametrize("rows", [6, 600], ids=["presigned", "large"])  # C below / above
def test_a_batch_commit_whose_nonce_another_client_took_is_signed_again(node, tmp_path, rows):
    """`needle-net send` with the worker's key took the nonce the worker's client counted
    on: the node refused the batch's commitJobs as "nonce too low" and the batch failed
    (its jobs booked as errors, never done), where every other transaction is signed
    again with the node's next nonce."""
    account = dev_account(3 if rows == 6 else 4)
    submitter, owner = Market(node.url, dev_account(1)), Market(node.url, account)
    worker = Worker(_config(node.url, tmp_path), account)
    ids = []
    try:
        worker.chain.send("register", value=ETHER)  # its client counts its nonces from here
        ids = submit_as_declared(submitter, FEE, [_job(rows + i, rows, rows) for i in range(2)])
        records = _taken(worker, [submitter.job(i) for i in ids], "computing")
        one_block(owner)  # a transaction sent elsewhere with the worker's key
        worker._process_batch(records, [submitter.job(i) for i in ids])
        assert [(r.stage, r.detail) for r in records] == [("verified", "")] * 2
        assert all(submitter.job(i).status == JOB_DONE for i in ids)
    finally:
        worker.close()
        _cancel_open(submitter, ids)
        for market in (submitter, owner):
            market.close()


@pytest.mark.parametrize("path", ["batch", "claim"])
def test_a_job_taken_while_the_stake_is_withdrawn_sends_no_transaction(node, tmp_path, path):
    """POST /admin/withdraw while a job the worker took is computed: the chain refuses
    commitJobs (and claimJob) from a withdrawing worker, but the worker sent it anyway, for
    a revert whose gas it paid. It sends nothing now; the job stays open for other workers
    and leaves this worker's books, as a claim another worker won does."""
    account = dev_account(5 if path == "batch" else 6)
    submitter = Market(node.url, dev_account(1))
    worker = Worker(_config(node.url, tmp_path), account)
    ids = []
    try:
        worker.chain.send("register", value=ETHER)
        ids = submit_as_declared(submitter, FEE, [_job(40), _job(41)])
        jobs = [submitter.job(i) for i in ids]
        records = _taken(worker, jobs if path == "batch" else jobs[:1],
                         "computing" if path == "batch" else "fetching")
        worker.request_withdraw()  # after the job loop took them
        nonce = submitter.w3.eth.get_transaction_count(account.address)
        if path == "batch":
            worker._process_batch(records, jobs)
        else:
            worker._process(records[0], jobs[0], "claim")
        assert submitter.w3.eth.get_transaction_count(account.address) == nonce
        assert all(submitter.job(i).status == JOB_OPEN for i in ids)
        assert not any(r in worker.jobs for r in records)
    finally:
        worker.close()
        _cancel_open(submitter, ids)
        submitter.close()


def test_a_worker_stopped_during_an_outage_lists_its_held_job_once_after_a_restart(
        node, tmp_path, monkeypatch):
    """Stopped while a commit was retried through an outage, the worker booked its claimed
    job as an error (journaled), and the restart resumed the claim as a second record: /jobs
    listed the job twice, an error and a verified one. It stays in flight now, and the
    restart finishes that one record."""
    monkeypatch.setenv(CHEAT_ENV, "1")  # stall_after_claim: the outage starts after the claim
    account = dev_account(7)
    submitter = Market(node.url, dev_account(1))
    Market(node.url, account).send("register", value=ETHER)
    proxy = FlakyProxy(node.url)
    worker = Worker(_config(proxy.url, tmp_path, stall_after_claim=2.0), account)
    thread = run_worker(worker)
    try:
        (job_id,) = submit_as_declared(submitter, FEE, [_job(70)])
        wait_for(lambda: submitter.job(job_id).status == JOB_CLAIMED, 30, "the worker's claim")
        proxy.failed, proxy.failures = 0, 10**9  # the chain node unreachable from now on
        time.sleep(3.0)  # past the stall: the commit is being retried
        stop_worker(worker, thread)
    finally:
        proxy.close()
    assert submitter.job(job_id).status == JOB_CLAIMED  # still this worker's, on the chain
    saved = json.loads((tmp_path / "worker-state.json").read_text())["jobs"]
    assert [j["job_id"] for j in saved] == [job_id]  # in flight, for the restart
    assert [j["stage"] for j in worker.job_list()] == [saved[0]["stage"]]  # not an error
    restarted = Worker(_config(node.url, tmp_path), account)
    thread = run_worker(restarted)
    try:
        wait_for(lambda: submitter.job(job_id).status == JOB_DONE, 30, "the job done")
        wait_for(lambda: restarted.status()["in_flight"] == 0, 30, "the job settled")
        assert [j["stage"] for j in restarted.job_list() if j["job_id"] == job_id] == \
            ["verified"]
    finally:
        stop_worker(restarted, thread)
        submitter.close()


def test_a_held_job_an_older_run_booked_as_an_error_is_listed_once_after_a_restart(
        node, tmp_path):
    """The data dir of a worker stopped in an outage before this fix (or that gave up a job
    while its claim stood): the journal books the job as an error, the chain names it as
    this worker's claim. The restart resumed it under a second record; it resumes it under
    the one it has."""
    account = dev_account(9)
    submitter, me = Market(node.url, dev_account(1)), Market(node.url, account)
    me.send("register", value=ETHER)
    (job_id,) = submit_as_declared(submitter, FEE, [_job(90)])
    me.send("claimJob", job_id)
    given_up = JobRecord(job_id, 1, 6, 5, 4, FEE, "error", started=time.time() - 10,
                         seconds=1.0, detail="ConnectionError: the chain node is gone")
    (tmp_path / "worker-jobs.jsonl").write_text(json.dumps(asdict(given_up)) + "\n")
    worker = Worker(_config(node.url, tmp_path), account)
    thread = run_worker(worker)
    try:
        wait_for(lambda: submitter.job(job_id).status == JOB_DONE, 30, "the job done")
        wait_for(lambda: worker.status()["in_flight"] == 0, 30, "the job settled")
        assert [j["stage"] for j in worker.job_list() if j["job_id"] == job_id] == ["verified"]
    finally:
        stop_worker(worker, thread)
        for market in (submitter, me):
            market.close()


# a worker process SIGKILLed right after it booked the first verdict of a batch, in memory,
# before the batch's one save; its refresh thread never saves in between
KILLED_AFTER_A_BATCH_VERDICT = """
import os, signal, sys
from pathlib import Path
import node.worker as w
from chain.devnet import dev_account

w.ACCOUNT_REFRESH_SECONDS = 3600.0
record_verdict = w.Worker._record_verdict

def record_then_die(self, record, verdict, save=True):
    record_verdict(self, record, verdict, save)
    if not save:
        os.kill(os.getpid(), signal.SIGKILL)

w.Worker._record_verdict = record_then_die
config = w.WorkerConfig(rpc_url=sys.argv[1], data_dir=Path(sys.argv[2]), stake_wei=10**18,
                        poll_interval=0.2)
w.Worker(config, dev_account(int(sys.argv[3]))).run()
"""


def test_a_worker_killed_after_a_batch_verdict_counts_the_batch_after_a_restart(
        node, tmp_path):
    """The batch's records were saved only with their verdicts, after the chain had paid
    them: a SIGKILL in between left them nowhere on disk, and with no claim left in flight
    the restart did not look for them. /status undercounted the completed jobs for good.
    Also: the data dir is the running worker's (a worker in another process is refused,
    naming its pid), and the killed worker's lock does not block the restart."""
    index = 8
    account = dev_account(index)
    submitter = Market(node.url, dev_account(1))
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED_AFTER_A_BATCH_VERDICT, node.url, str(tmp_path),
         str(index)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: submitter.stake_of(account.address) == ETHER, 60, "the worker's stake")
        with pytest.raises(WorkerStartError, match=f"pid {process.pid}"):
            Worker(_config(node.url, tmp_path), account)
        ids = submit_as_declared(submitter, FEE, [_job(80 + i) for i in range(3)])
        assert process.wait(60) == -signal.SIGKILL, process.stderr.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()
    # killed once the chain paid its first batch (a job a peer ranked before it might have
    # taken is left for a later one, then for the restart)
    assert any(submitter.job(i).status == JOB_DONE for i in ids)
    restarted = Worker(_config(node.url, tmp_path), account)
    thread = run_worker(restarted)
    try:
        wait_for(lambda: all(submitter.job(i).status == JOB_DONE for i in ids), 30,
                 "every job done")
        assert all(submitter.job(i).worker == account.address for i in ids)
        wait_for(lambda: restarted.status()["in_flight"] == 0, 30, "the resumed jobs settled")
        assert sorted((j["job_id"], j["stage"]) for j in restarted.job_list()) == \
            [(i, "verified") for i in ids]
        assert restarted.status()["completed"] == len(ids)
        assert restarted.status()["earned_wei"] == FEE * len(ids)
    finally:
        stop_worker(restarted, thread)
        submitter.close()



def test_a_withdrawal_cancelled_outside_the_worker_opens_it_again(node, tmp_path):
    """`needle-net withdraw`, then `needle-net stake`, with the worker's key while it runs:
    the first closed it (the chain refuses claims while a withdrawal is pending), but after
    the second, which cancels the withdrawal, it still took no job until it was restarted."""
    account = dev_account(18)
    worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER), account)
    thread = run_worker(worker)
    owner = Market(node.url, account)
    try:
        wait_for(lambda: worker.status()["stake_wei"] > 0, 30, "the worker never started")
        owner.send("requestWithdraw")
        wait_for(lambda: worker.status()["accepting_jobs"] is False, 30,
                 "the worker still accepts jobs after its stake's withdrawal was requested")
        owner.send("register", value=1)  # a top-up cancels the withdrawal (the contract's rule)
        assert owner.worker_info(account.address)[1] == 0
        wait_for(lambda: worker.status()["accepting_jobs"] is True, 30,
                 "the worker still refuses jobs after its withdrawal was cancelled")
    finally:
        stop_worker(worker, thread)
        owner.close()
