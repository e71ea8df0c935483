"""A worker whose data dir cannot be written any more (a full disk, from a review): the
failed save of a claimed job's stage ended the job, whose missed deadline then cut the stake
by 10 %, and the same failure in the account thread stopped the stake and balance refresh
for good. Now the worker goes on in memory, says so once, and saves again once it can.
Real chain node process on 127.0.0.1; the data dir is made unusable by a file where its
folder should be, and a journal append is cut short by a real file-size limit."""
import logging
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from helpers import run_worker, stop_worker, submit_as_declared, wait_for

from chain.devnet import dev_account
from chain.launch import NodeProcess
from node.market import JOB_DONE, Market
from node.worker import Worker, WorkerConfig

pytestmark = pytest.mark.timeout(180)
FEE = 10**15
ETHER = 10**18


def test_a_worker_that_cannot_save_its_state_still_finishes_a_claimed_job(tmp_path, caplog):
    account = dev_account(16)
    with NodeProcess(tmp_path / "chain", block_time=0) as chain:
        worker = Worker(WorkerConfig(rpc_url=chain.url, data_dir=tmp_path / "worker",
                                     stake_wei=ETHER, min_fee_wei=FEE, poll_interval=0.2,
                                     direct_commit_flops=0), account)  # every job claimed
        submitter = Market(chain.url, dev_account(15))
        thread = run_worker(worker)
        paths = worker._state_path, worker._journal_path
        try:
            wait_for(lambda: worker.status()["stake_wei"] == ETHER, 30, "the stake")
            blocker = tmp_path / "full"
            blocker.write_text("")  # a file where the state's folder should be: saves fail
            worker._state_path = blocker / "worker-state.json"
            worker._journal_path = blocker / "worker-jobs.jsonl"
            rng = np.random.default_rng(29)
            a, b = rng.standard_normal((8, 6), np.float32), rng.standard_normal((6, 4),
                                                                                np.float32)
            with caplog.at_level(logging.INFO, logger="needle.worker"):
                (job_id,) = submit_as_declared(submitter, FEE, [(a, b, (1, 8, 6, 4), 1)])
                wait_for(lambda: submitter.job(job_id).status == JOB_DONE, 60,
                         "the claimed job to be verified")
                wait_for(lambda: any(r.job_id == job_id and r.stage == "verified"
                                     for r in worker.jobs), 30, "the worker to book it")
                assert submitter.stake_of(account.address) == ETHER  # no deadline missed
                failures = [r for r in caplog.records if "cannot save" in r.getMessage()]
                assert len(failures) == 1, caplog.text  # said once, not at every change
                assert "going on in memory" in failures[0].getMessage()
                assert any(t.name == "account" and t.is_alive() for t in threading.enumerate())

                submitter.send("register", value=ETHER)  # a block: the refresh is alive
                head = submitter.block_number()
                wait_for(lambda: worker._head >= head, 30, "the worker to follow the chain")

                worker._state_path, worker._journal_path = paths  # the disk has room again
                (second,) = submit_as_declared(submitter, FEE, [(a, b, (1, 8, 6, 4), 1)])
                wait_for(lambda: any(r.job_id == second and r.stage == "verified"
                                     for r in worker.jobs), 60, "a second job")
            assert "the worker's state is saved again" in caplog.text
            journal = paths[1].read_text()
            assert f'"job_id":{job_id},' in journal and f'"job_id":{second},' in journal
        finally:
            stop_worker(worker, thread)
            submitter.close()


def test_a_journal_append_the_disk_cuts_short_leaves_the_journal_as_it_was(tmp_path):
    """The file-size limit (RLIMIT_FSIZE) fails the write partway, as a full disk does."""
    journal = tmp_path / "worker-jobs.jsonl"
    journal.write_text('{"job_id":1}\n')
    script = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from node.worker import _append_whole\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "try:\n"
        "    _append_whole(Path(sys.argv[1]), b'x' * 10000)\n"
        "except OSError as err:\n"
        "    print(type(err).__name__, err.errno)\n")
    done = subprocess.run([sys.executable, "-c", script, str(journal)], capture_output=True,
                          text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__))))
    assert done.stdout.split()[0] == "OSError", done.stdout + done.stderr
    assert journal.read_text() == '{"job_id":1}\n'
