"""Worker review 24: a worker on a chain longer than one eth_getLogs query may span (its
first poll asked for every event from block 0 in one query, which the node refuses past
MAX_LOG_BLOCKS blocks: the worker failed every poll, for good, and took no job), and a
state file that cannot be read (the worker did not start, with a bare JSON error or a
TypeError's traceback that named neither the file nor what to do, while the claim it held
ran towards its deadline's stake cut), and a withdrawal asked for
once more after the stake was withdrawn (the chain refused it, and the worker, with no
stake, said it was accepting jobs again). A real chain node, a real worker, real
transactions."""
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import uvicorn
from helpers import one_block, run_worker, stop_worker, submit_as_declared, wait_for

import chain.client as chain_client_module
import chain.rpc as rpc_module
from chain.devnet import dev_account
from chain.node import Node, NodeConfig
from chain.rpc import create_app
from node.market import JOB_CLAIMED, JOB_DONE, JOB_OPEN, ZERO_ADDRESS, Market, TxReverted
from node.worker import Worker, WorkerConfig, WorkerStartError

pytestmark = pytest.mark.timeout(120)
ETHER = 10**18
FEE = 10**15
FP32 = 1


def _job(seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((6, 5), np.float32), rng.standard_normal((5, 4), np.float32)
    return a, b, (1, 6, 5, 4), FP32


def _verified(worker: Worker, job_id: int) -> bool:
    return any(j["job_id"] == job_id and j["stage"] == "verified" for j in worker.job_list())


@pytest.mark.parametrize("case, damaged", [
    (0, '{"next_block": 7, "jobs": [{"job_id": 0, "ba'),  # cut short mid-write
    (1, ""),  # emptied by a power cut between the write and its rename
    (2, '{"next_block": 3, "jobs": [{"job_id": 0}]}'),  # a record without its fields
], ids=["cut", "empty", "bad-record"])
def test_a_damaged_state_file_is_a_start_error_whose_advice_finishes_the_claim(
        node, tmp_path, case, damaged):
    """The error names the file and the way out; taking it (the file moved aside), the
    worker finds the claim it held on the chain and finishes it, paid and not cut."""
    account = dev_account(3 + case)  # a fresh worker per case
    me, submitter = Market(node.url, account), Market(node.url, dev_account(1))
    me.send("register", value=ETHER)
    (job_id,) = submit_as_declared(submitter, FEE, [_job(case)])
    me.send("claimJob", job_id)  # the previous run's claim, then a crash
    assert me.job(job_id).status == JOB_CLAIMED
    state = tmp_path / "worker-state.json"
    state.write_text(damaged)
    config = WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER,
                          poll_interval=0.2)
    advice = f"{re.escape(str(state))} cannot be read .*move it aside"
    with pytest.raises(WorkerStartError, match=advice):
        Worker(config, account)
    state.rename(tmp_path / "worker-state.json.old")
    worker = Worker(config, account)
    thread = run_worker(worker)
    try:
        wait_for(lambda: _verified(worker, job_id), 30, "the claimed job verified")
        assert submitter.job(job_id).status == JOB_DONE
        assert me.stake_of(account.address) == ETHER  # no deadline's stake cut
    finally:
        stop_worker(worker, thread)
        for market in (me, submitter):
            market.close()


@contextmanager
def _node_serving(data_dir) -> Iterator[str]:
    """A chain node (chain.node.Node, its JSON-RPC app under uvicorn) on 127.0.0.1 in this
    process: its URL. In this process, so that its log span limit can be lowered."""
    chain_node = Node(NodeConfig(data_dir, block_time=0, decode_process=False))
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(chain_node), log_level="warning"))
    chain_node.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        chain_node.stop()


def test_a_worker_on_a_chain_longer_than_one_log_query_takes_its_jobs(tmp_path, monkeypatch):
    span = 4  # the node's MAX_LOG_BLOCKS (10,000: 33 minutes of a devnet's 0.2 s blocks)
    monkeypatch.setattr(rpc_module, "MAX_LOG_BLOCKS", span)
    monkeypatch.setattr(chain_client_module, "MAX_LOG_BLOCKS", span)  # the client's spans
    with _node_serving(tmp_path / "chain") as url:
        account = dev_account(2)
        me, submitter = Market(url, account), Market(url, dev_account(1))
        me.send("register", value=ETHER)
        job_ids = [submit_as_declared(submitter, FEE, [_job(i)])[0] for i in range(3 * span)]
        assert submitter.block_number() > 2 * span  # one query from block 0 is refused
        worker = Worker(WorkerConfig(rpc_url=url, data_dir=tmp_path / "worker",
                                     stake_wei=ETHER, poll_interval=0.2), account)
        thread = run_worker(worker)
        try:
            wait_for(lambda: all(_verified(worker, i) for i in job_ids), 60,
                     "every job verified")
            assert all(submitter.job(i).status == JOB_DONE for i in job_ids)
        finally:
            stop_worker(worker, thread)
            for market in (me, submitter):
                market.close()


def test_a_withdrawal_asked_for_again_after_the_stake_is_withdrawn_leaves_it_closed(
        node, tmp_path):
    account, other = dev_account(7), Market(node.url, dev_account(1))
    worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER,
                                 poll_interval=0.2), account)
    thread = run_worker(worker)
    try:
        wait_for(lambda: worker.status()["stake_wei"] == ETHER, 30, "the stake")
        available = worker.request_withdraw()["available_block"]
        while other.block_number() < available:
            one_block(other)
        assert worker.request_withdraw() == {"withdrawn_wei": ETHER}
        assert other.stake_of(account.address) == 0
        with pytest.raises(TxReverted, match="no stake"):
            worker.request_withdraw()  # POST /admin/withdraw once more
        assert worker.status()["accepting_jobs"] is False
    finally:
        stop_worker(worker, thread)
        other.close()


def test_a_restart_below_the_configured_stake_keeps_a_pending_withdrawal(node, tmp_path):
    """Registering cancels a pending withdrawal. A worker restarted with its stake below the
    configured one (cut by a slash, or configured higher) topped it up, so its owner's
    withdrawal was undone and it took jobs again; with the stake whole it stayed closed."""
    account = dev_account(9)
    chain = Market(node.url, account)
    chain.send("register", value=ETHER)
    chain.send("requestWithdraw")
    stake, withdraw_block, _ = chain.worker_info(account.address)
    config = WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=2 * ETHER)
    worker = Worker(config, account)
    thread = run_worker(worker)
    try:
        wait_for(lambda: worker.status()["stake_wei"] > 0, 30, "the worker never started")
        assert chain.worker_info(account.address)[:2] == (stake, withdraw_block)
        assert worker.status()["accepting_jobs"] is False
    finally:
        stop_worker(worker, thread)
        chain.close()


def test_a_job_whose_deadline_no_worker_meets_is_not_claimed(node, tmp_path):
    """Anyone can submit a job whose claim expires a block later (its fee comes back on
    cancel): the worker claimed it, missed the deadline and lost 10 % of its stake, for the
    submitter's gas alone. Jobs state their deadline now, and the worker claims none below
    --min-deadline; a job that gives enough blocks is claimed and paid as ever."""
    account, submitter = dev_account(10), Market(node.url, dev_account(1))
    config = WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER,
                          direct_commit_flops=0)  # every job claimed, none committed at once
    worker = Worker(config, account)
    thread = run_worker(worker)
    try:
        a, b = np.ones((8, 5), np.float32), np.ones((5, 3), np.float32)
        a_id, b_id = submitter.put_array(a), submitter.put_array(b)
        short = submitter.job_count()
        submitter.send("submitJob", a_id, b_id, 1, 8, 5, 3, FP32, 1, value=FEE)
        submitter.send("submitJob", a_id, b_id, 1, 8, 5, 3, FP32, 50, value=FEE)
        assert submitter.job(short).timeout_blocks == 1
        wait_for(lambda: submitter.job(short + 1).status == JOB_DONE, 60,
                 "the job with a 50-block deadline was not done")
        job = submitter.job(short)
        assert (job.status, job.worker) == (JOB_OPEN, ZERO_ADDRESS)  # seen, never claimed
        assert submitter.stake_of(account.address) == ETHER
        submitter.send("cancel", short)
    finally:
        stop_worker(worker, thread)
        submitter.close()


def test_a_withdrawal_requested_outside_the_worker_closes_it(node, tmp_path):
    """`needle-net withdraw` with the worker's key while it runs: the chain refuses its
    claims and commits from then on, but the worker read only its stake, still said it was
    accepting jobs and sent commits that reverted (their gas spent, the jobs left open)."""
    account = dev_account(16)
    config = WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER)
    worker = Worker(config, account)
    thread = run_worker(worker)
    owner = Market(node.url, account)
    try:
        wait_for(lambda: worker.status()["stake_wei"] > 0, 30, "the worker never started")
        assert worker.status()["accepting_jobs"] is True
        owner.send("requestWithdraw")
        wait_for(lambda: worker.status()["accepting_jobs"] is False, 30,
                 "the worker still accepts jobs after its stake's withdrawal was requested")
    finally:
        stop_worker(worker, thread)
        owner.close()
