"""The worker's saved state across restarts, against a real chain node process: jobs in
flight in worker-state.json (rewritten on every stage change), finished jobs appended once
each to worker-jobs.jsonl, and a restarted worker holding the same jobs."""
import json
from dataclasses import asdict

import pytest
from web3 import Web3

from chain.devnet import dev_accounts
from node.worker import JobRecord, Worker, WorkerConfig

pytestmark = pytest.mark.timeout(120)


def worker_on(node, data_dir) -> Worker:
    return Worker(WorkerConfig(rpc_url=node.url, data_dir=data_dir, stake_wei=10**18),
                  dev_accounts(3)[2])


def close(worker: Worker) -> None:
    worker.close()  # the data dir free for the next worker_on


def records(count: int) -> list[JobRecord]:
    return [JobRecord(i, 1, 2 + i, 3, 4, 10**15, started=1000.0 + i) for i in range(count)]


def saved_jobs(path) -> list[dict]:
    return json.loads((path / "worker-state.json").read_text())["jobs"]


def journal(path) -> list[dict]:
    return [json.loads(line) for line in (path / "worker-jobs.jsonl").read_text().splitlines()]


def test_finished_jobs_are_journaled_once_and_a_restart_restores_every_job(node, tmp_path):
    worker = worker_on(node, tmp_path)
    jobs = records(300)
    worker.jobs.extend(jobs)
    for i, record in enumerate(jobs[:-2]):  # every stage change saves
        worker._set_stage(record, "verified" if i % 3 else "failed", f"job {i}")
    worker._set_stage(jobs[-2], "committed")
    expected = [asdict(r) for r in jobs]
    close(worker)

    # in flight: only the last two; finished: each once, in the order they finished
    assert saved_jobs(tmp_path) == expected[-2:]
    assert journal(tmp_path) == expected[:-2]
    again = worker_on(node, tmp_path)
    assert [asdict(r) for r in again.jobs] == expected
    status = again.status()
    assert (status["completed"], status["failed"], status["in_flight"]) == (198, 100, 2)
    again._set_stage(again.jobs[-1], "lost", "gone")
    assert journal(tmp_path)[-1] == asdict(again.jobs[-1])
    assert saved_jobs(tmp_path) == [asdict(again.jobs[-2])]
    close(again)


def test_old_state_files_and_a_cut_journal_line_are_read(node, tmp_path):
    """A state file from before the journal (every job in it) loads the same jobs and moves
    the finished ones to the journal at the next save; a journal line cut short by a crash
    is skipped, its job read from the state file where it was still in flight."""
    jobs = records(5)
    for record in jobs[:3]:
        record.stage = "verified"
    resume_at = Web3(Web3.HTTPProvider(node.url)).eth.block_number  # a place on this chain
    (tmp_path / "worker-state.json").write_text(json.dumps(
        {"next_block": resume_at, "jobs": [asdict(r) for r in jobs]}))
    worker = worker_on(node, tmp_path)
    assert worker._next_block == resume_at and [asdict(r) for r in worker.jobs] == \
        [asdict(r) for r in jobs]
    worker._save_state()
    assert journal(tmp_path) == [asdict(r) for r in jobs[:3]]
    assert saved_jobs(tmp_path) == [asdict(r) for r in jobs[3:]]
    close(worker)

    finished = asdict(jobs[3]) | {"stage": "verified"}
    with (tmp_path / "worker-jobs.jsonl").open("a") as f:
        f.write(json.dumps(finished)[:40])  # the crash came mid-line
    restarted = worker_on(node, tmp_path)
    assert [asdict(r) for r in restarted.jobs] == [asdict(r) for r in jobs]
    restarted._set_stage(restarted.jobs[3], "verified")  # its line follows intact ones
    assert journal(tmp_path) == [asdict(r) for r in restarted.jobs[:4]]
    close(restarted)
