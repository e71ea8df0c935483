"""End-to-end soak with restarts, from a review: a small devnet of real processes on
127.0.0.1 (a chain node, two workers) driven the way an operator's bad day goes: several
submitters at once with exact and float jobs, batches and single ones, cancels and short
deadlines; a worker SIGKILLed and restarted on its data dir, the chain node SIGTERMed and
restarted on its own, a worker withdrawing its stake while jobs are open. At the end,
checked against references of their own: every verified C against numpy (int64 for exact
jobs, float64 and the fp32 rounding bound for float ones), no job left without a way out,
every wei accounted for from the chain's receipts, and each worker's books against the
chain's events."""
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from helpers import (
    balances_at_head,
    base_fees_burned,
    cancel_as_submitter,
    run_worker,
    stop_worker,
    submit_as_declared,
    wait_for,
)

from chain.blobs import blob_id, encode_array
from chain.devnet import dev_account
from chain.launch import NodeProcess
from node.client import PRESIGN_BYTES, SUBMIT_SENDS, JobClient
from node.devnet import Devnet
from node.market import (
    JOB_CANCELLED,
    JOB_CLAIMED,
    JOB_COMMITTED,
    JOB_DONE,
    JOB_OPEN,
    Market,
)
from node.worker import Worker, WorkerConfig
from verifier import verify

pytestmark = pytest.mark.timeout(300)
MARKET = "0x000000000000000000000000000000000000c0DE"
POOL = "0x0000000000000000000000000000000000000FEE"
FEE = 10**15
SUBMITTERS = (1, 2, 3)
POLL = ("--poll-interval", "0.2")
U32 = 2.0**-24  # float32's unit roundoff


def _exact(rng, dtype, shape, limit=None):
    info = np.iinfo(dtype)
    hi = info.max if limit is None else limit
    return rng.integers(-hi, hi, shape, dtype=dtype, endpoint=True)


def _mix(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A batch of products: exact (int8, int16, int32) and float32, 1x1 to a few hundred,
    2-D and batched 3-D."""
    rng = np.random.default_rng(seed)
    f32 = np.float32
    return [
        (_exact(rng, np.int8, (1, 1)), _exact(rng, np.int8, (1, 1))),
        (_exact(rng, np.int16, (17, 33)), _exact(rng, np.int16, (33, 5))),
        (_exact(rng, np.int32, (3, 40, 60), 2**20), _exact(rng, np.int32, (60, 7), 2**20)),
        (rng.standard_normal((1, 1)).astype(f32), rng.standard_normal((1, 1)).astype(f32)),
        (rng.standard_normal((120, 200)).astype(f32), rng.standard_normal((200, 90)).astype(f32)),
        (rng.standard_normal((2, 9, 4)).astype(f32), rng.standard_normal((2, 4, 6)).astype(f32)),
    ]


def _large(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Products above the workers' direct-commit size: claimed first, then computed."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((520, 520)).astype(np.float32),
             rng.standard_normal((520, 520)).astype(np.float32)),
            (_exact(rng, np.int8, (520, 520)), _exact(rng, np.int8, (520, 520)))]


def _check_product(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
    """C against numpy: equal to the int64 product for exact jobs; for float32 ones within
    the rounding bound gamma_k |A| |B| of any summation order, from float64 (and the
    verifier's own fp32 check as a second opinion)."""
    if a.dtype != np.float32:
        np.testing.assert_array_equal(c, a.astype(np.int64) @ b.astype(np.int64))
        return
    k = a.shape[-1]
    exact = a.astype(np.float64) @ b.astype(np.float64)
    bound = (k * U32 / (1 - k * U32)) * (np.abs(a).astype(np.float64) @ np.abs(b)) + 1e-37
    assert c.dtype == np.float32 and (np.abs(c - exact) <= bound).all()
    pairs = zip(a, np.broadcast_to(b, (len(a), *b.shape[-2:])), c, strict=True) \
        if a.ndim == 3 else [(a, b, c)]
    assert all(verify(x, y, z, precision="fp32").passed for x, y, z in pairs)


class Submitter:
    """A dev account submitting in a thread of its own through the JobClient; keeps the
    operands of every job it opened, by id, and the Cs it got back."""

    def __init__(self, net: Devnet, index: int, **options) -> None:
        self.client = JobClient(net.rpc_url, dev_account(index), fee_wei=FEE, timeout=150,
                                poll_interval=0.2, **options)
        self.operands: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.results: dict[int, np.ndarray] = {}
        self.errors: list[Exception] = []

    def run(self, batches: list[list[tuple[np.ndarray, np.ndarray]]]) -> None:
        for pairs in batches:
            pending = self.client.submit(pairs)
            self.operands.update({p.job_id: (p.a, p.b) for p in pending})
            try:
                results = self.client.wait(pending)
            except Exception as err:  # noqa: BLE001 - reported by the test
                self.errors.append(err)
                continue
            self.results.update({p.job_id: c for p, c in zip(pending, results, strict=True)})

    def close(self) -> None:
        self.client.close()


def _parties(net: Devnet, workers: int) -> list[str]:
    return [dev_account(i).address for i in range(20)] + \
        [net.worker_account(i).address for i in range(workers)] + [MARKET, POOL]


def _events(market: Market, name: str, **filters) -> list:
    return getattr(market.contract.events, name).get_logs(argument_filters=filters,
                                                         from_block=0)


def _holding(market: Market, worker: str) -> bool:
    """Whether `worker` holds a claim it has not committed."""
    return any(market.job(e["args"]["jobId"]).status == JOB_CLAIMED
               for e in _events(market, "JobClaimed", worker=worker))


def _get(worker, route: str):
    return httpx.get(f"{worker.api_url}{route}", timeout=10).json()


def _settle_leftovers(market: Market, count: int) -> None:
    """Every job that is not done or cancelled has a way out: an open one its submitter
    cancels, a claim past its deadline anyone reopens (then cancels)."""
    for job_id in range(count):
        job = market.job(job_id)
        if job.status == JOB_CLAIMED and market.block_number() > job.deadline:
            market.send("reopenExpired", job_id)
            job = market.job(job_id)
        if job.status == JOB_OPEN:
            cancel_as_submitter(market, job_id)


def test_soak_with_worker_and_chain_restarts_keeps_results_money_and_books(tmp_path):
    net = Devnet(tmp_path / "devnet", block_time=0.25)
    submitters: list[Submitter] = []
    market = None
    try:
        net.start_chain()
        parties = _parties(net, 2)
        market = Market(net.rpc_url, dev_account(7))
        first, total_before = balances_at_head(market, parties)
        # worker 0 stalls after each claim until it is SIGKILLed (then restarted without)
        workers = [net.start_worker(0, extra_args=(*POLL, "--stall-after-claim", "600"),
                                    env={"NEEDLE_NET_ALLOW_CHEAT": "1"}),
                   net.start_worker(1, extra_args=POLL)]

        # phase 1: three submitters at once; worker 0 is SIGKILLed and restarted, then the
        # chain node is SIGTERMed and restarted, while their jobs are on the way
        submitters = [Submitter(net, i) for i in SUBMITTERS]
        with ThreadPoolExecutor(len(submitters)) as pool:
            runs = [pool.submit(s.run, [_mix(10 * i), _large(10 * i + 1), _mix(10 * i + 2),
                                        _large(10 * i + 3)[:1]])
                    for i, s in zip(SUBMITTERS, submitters, strict=True)]
            wait_for(lambda: _holding(market, workers[0].address), 60, "worker 0 to claim")
            net.stop_worker(workers[0], kill=True)
            workers[0] = net.start_worker(0, extra_args=POLL)
            wait_for(lambda: market.job_count() >= 20, 60, "more jobs")
            market.close()
            net.chain.send_signal(signal.SIGTERM)
            net.chain.wait(30)
            net.start_chain()
            market = Market(net.rpc_url, dev_account(7))
            for run in runs:
                run.result(200)
        # worker 0's claims held while it stalled expired (10 % cut each): its operator tops
        # the stake up again, as `needle-net stake` does, and it takes jobs again
        owner = Market(net.rpc_url, net.worker_account(0))
        if owner.stake_of(owner.address) < 10**18:
            owner.send("register", value=10**18 - owner.stake_of(owner.address))
        owner.close()
        wait_for(lambda: _get(workers[0], "/status")["accepting_jobs"], 30, "worker 0's stake")

        # phase 2: a job no worker claims (too large for its 2-block deadline) is cancelled
        # by its submitter; one with a 1-block deadline is still done (claimed and
        # committed in one transaction); worker 1 withdraws its stake while jobs are open
        lone = Submitter(net, 4, timeout_blocks=2)
        submitters.append(lone)
        rng = np.random.default_rng(5)
        big = (rng.standard_normal((700, 700)).astype(np.float32),
               rng.standard_normal((700, 700)).astype(np.float32))
        (stuck,) = lone.client.submit([big])
        lone.operands[stuck.job_id] = big
        quick = Submitter(net, 5, timeout_blocks=1)
        submitters.append(quick)
        opened = threading.Thread(target=quick.run, args=([_mix(77)],))
        opened.start()
        withdrawn = httpx.post(f"{workers[1].api_url}/admin/withdraw", timeout=30,
                               headers={"Authorization": f"Bearer {workers[1].admin_token}"})
        assert withdrawn.status_code == 200, withdrawn.text
        opened.join(200)
        assert market.job(stuck.job_id).status == JOB_OPEN
        lone.client.market.send("cancel", stuck.job_id)
        assert market.job(stuck.job_id).status == JOB_CANCELLED
        wait_for(lambda: market.worker_info(workers[1].address)[2] == 0 and
                 market.block_number() >= market.worker_info(workers[1].address)[1], 60,
                 "worker 1's cooldown and claims to end")
        done = httpx.post(f"{workers[1].api_url}/admin/withdraw", timeout=30,
                          headers={"Authorization": f"Bearer {workers[1].admin_token}"})
        assert done.status_code == 200 and done.json()["withdrawn_wei"] > 0, done.text

        # the end: every job done or cancelled, nothing in escrow or claims
        count = market.job_count()
        wait_for(lambda: all(market.job(j).status not in (JOB_CLAIMED, JOB_COMMITTED)
                             for j in range(count)), 60, "every job to settle")
        _settle_leftovers(market, count)
        jobs = [market.job(j) for j in range(count)]
        assert {j.status for j in jobs} <= {JOB_DONE, JOB_CANCELLED}
        for s in submitters:
            assert s.errors == [], s.errors
        operands = {k: v for s in submitters for k, v in s.operands.items()}
        results = {k: v for s in submitters for k, v in s.results.items()}
        assert sorted(operands) == list(range(count))
        for job in jobs:
            if job.status == JOB_DONE:
                c = market.get_array(job.c_id)
                _check_product(*operands[job.job_id], c)
                if job.job_id in results:
                    np.testing.assert_array_equal(results[job.job_id], c)
        assert sorted(results) == [j.job_id for j in jobs if j.status == JOB_DONE]

        # money: nothing in escrow, the market holds the stakes, and only base fees burned
        functions = market.contract.functions
        assert functions.totalEscrow().call() == 0
        assert market.balance_of(MARKET) == functions.totalStaked().call() + \
            functions.totalOwed().call()
        last, total_after = balances_at_head(market, parties)
        assert total_after - total_before == -base_fees_burned(market, first + 1, last)

        # each worker's books against the chain
        for worker in workers:
            verified = _events(market, "JobVerified", worker=worker.address)
            status, listed = _get(worker, "/status"), _get(worker, "/jobs")
            assert status["in_flight"] == 0, status
            assert status["completed"] == len(verified), (status, len(verified))
            assert status["earned_wei"] == sum(e["args"]["fee"] for e in verified)
            # one record per attempt (a job reopened and taken again has two), the latest
            # one verified exactly where the chain names this worker the job's paid worker
            latest = {r["job_id"]: r for r in reversed(listed)}  # /jobs lists newest first
            for job_id, record in latest.items():
                mine = jobs[job_id].worker == worker.address and jobs[job_id].status == JOB_DONE
                assert (record["stage"] == "verified") == mine, (record, jobs[job_id])
            verified_ids = [r["job_id"] for r in listed if r["stage"] == "verified"]
            assert len(verified_ids) == len(set(verified_ids)), verified_ids
            assert {r["job_id"] for r in listed if r["stage"] == "verified"} == \
                {e["args"]["jobId"] for e in verified}
    finally:
        if market is not None:
            market.close()
        for s in submitters:
            s.close()
        net.close()


def test_a_worker_rides_out_a_chain_restart_while_it_resumes_its_jobs(tmp_path):
    """A worker (re)started just as its chain node restarted died: `_resume`, which looks up
    on the chain the jobs it holds, retried nothing, so a refused connection ended `run` and
    the process ("error: cannot reach the chain node"), its claims left to expire (a 10 %
    stake cut each). Here the node stops right after the worker registered and comes back
    while it resumes a claim it holds; the worker now waits for it and finishes the job."""
    account, ether = dev_account(14), 10**18
    with NodeProcess(tmp_path / "chain", block_time=0) as chain:
        holder, submitter = Market(chain.url, account), Market(chain.url, dev_account(15))
        holder.send("register", value=ether)
        rng = np.random.default_rng(3)
        a, b = rng.standard_normal((30, 20), np.float32), rng.standard_normal((20, 10), np.float32)
        (job_id,) = submit_as_declared(submitter, FEE, [(a, b, (1, 30, 20, 10), 1)])
        holder.send("claimJob", job_id)  # claimed by a run that crashed before saving it
        holder.close()
        worker = Worker(WorkerConfig(rpc_url=chain.url, data_dir=tmp_path / "worker",
                                     stake_wei=ether, poll_interval=0.2), account)
        registered, restart = worker._ensure_registered, None

        def register_then_stop_the_chain() -> None:
            nonlocal restart
            registered()
            chain.stop()  # down when the worker resumes; up again a moment later
            restart = threading.Thread(target=chain.start)
            restart.start()

        worker._ensure_registered = register_then_stop_the_chain
        thread = run_worker(worker)
        try:
            wait_for(lambda: restart is not None, 30, "the chain node to stop")
            restart.join(60)
            wait_for(lambda: submitter.job(job_id).status == JOB_DONE or not thread.is_alive(),
                     60, "the job to be verified")
            assert thread.is_alive(), "the worker's loop ended"
            job = submitter.job(job_id)
            assert (job.status, job.worker) == (JOB_DONE, account.address)
            _check_product(a, b, submitter.get_array(job.c_id))
        finally:
            if thread.is_alive():
                stop_worker(worker, thread)
            submitter.close()


def test_a_submission_sent_while_the_chain_node_restarts_opens_its_job(tmp_path):
    """The chain node stopped between the upload and the submission's send (a restart):
    the client sent it SUBMIT_SENDS times, poll_interval apart, and gave up after about a
    second with "[stage submit] ConnectionRefusedError" while the user's timeout was 60 s.
    A refused connection never delivered the transaction: it is now waited out, and the
    submission opens its job once."""
    with NodeProcess(tmp_path / "chain", block_time=0) as chain:
        client = JobClient(chain.url, dev_account(16), fee_wei=FEE, timeout=60,
                           poll_interval=0.2)
        rng = np.random.default_rng(8)
        a = rng.standard_normal((400, 400), np.float32)  # signed after the upload, not during
        assert 2 * a.nbytes > PRESIGN_BYTES
        signs, restart = client._sign_submission, None

        def sign_then_stop_the_chain(*args):
            nonlocal restart
            signed = signs(*args)
            chain.stop()  # down for longer than SUBMIT_SENDS quick sends
            restart = threading.Timer((SUBMIT_SENDS + 1) * client.poll_interval, chain.start)
            restart.start()
            return signed

        client._sign_submission = sign_then_stop_the_chain
        try:
            (pending,) = client.submit([(a, a)])
            restart.join(60)
            job = client.market.job(pending.job_id)
            assert (job.submitter, job.status) == (client.address, JOB_OPEN)
            assert job.a_id == blob_id(encode_array(a))
            assert client.market.job_count() == pending.job_id + 1
            client.market.send("cancel", pending.job_id)
        finally:
            if restart is not None:
                restart.join(60)
            client.close()


def test_a_worker_slashed_below_the_minimum_stake_says_it_takes_no_jobs(tmp_path):
    """In the soak, a worker whose claims expired while it restarted was cut below the
    market's minimum stake: the chain refuses its claims, and it skipped every job from
    then on, silently, while /status said `accepting_jobs: true` (docs/node.md: false where
    the chain refuses every claim). It now says false, logs why once, and takes jobs again
    once the stake is topped up."""
    account, ether = dev_account(17), 10**18
    with NodeProcess(tmp_path / "chain", block_time=0) as chain:
        # jobs paying nothing stay open for it: it takes only those paying FEE
        worker = Worker(WorkerConfig(rpc_url=chain.url, data_dir=tmp_path / "worker",
                                     stake_wei=ether, min_fee_wei=FEE, poll_interval=0.2),
                        account)
        thread = run_worker(worker)
        holder, submitter = Market(chain.url, account), Market(chain.url, dev_account(18))
        try:
            wait_for(lambda: worker.status()["stake_wei"] == ether, 30, "the stake")
            assert worker.status()["accepting_jobs"] is True
            a = np.ones((2, 2), np.float32)
            ids = submitter.put_array(a)
            submitter.send("submitJob", ids, ids, 1, 2, 2, 2, 1, 1)  # no fee, 1-block deadline
            holder.send("claimJob", 0)  # a claim of its key that it then misses
            submitter.send("register", value=ether)  # a block later: the deadline passed
            submitter.send("reopenExpired", 0)  # 10 % of the stake cut
            submitter.send("cancel", 0)
            assert holder.stake_of(account.address) < holder.min_stake()
            wait_for(lambda: worker.status()["stake_wei"] < ether, 30, "the slash to be seen")
            assert worker.status()["accepting_jobs"] is False

            holder.send("register", value=ether // 10)  # topped up: jobs taken again
            wait_for(lambda: worker.status()["accepting_jobs"], 30, "the top-up to be seen")
            submitter.send("submitJob", ids, ids, 1, 2, 2, 2, 1, 20, value=FEE)
            wait_for(lambda: submitter.job(1).status == JOB_DONE, 30, "job 1 to be verified")
            assert submitter.job(1).worker == account.address
        finally:
            stop_worker(worker, thread)
            holder.close()
            submitter.close()
