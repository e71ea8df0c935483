"""Clients and workers across chain node crashes, from a review: a chain node SIGKILLed at
random moments and restarted on its data dir and port a moment later, while two workers
(in this process, as `needle-net worker up` runs them) take a stream of small exact jobs
from two submitters, one through `node.client.JobClient`, one through `needle-net submit`
processes. Nobody is told about the kills. At the end, against references of the test's
own:
- every submission ended with its verified C, equal to numpy's int64 product (or, for the
  CLI, a one-line `error:` naming what to do, never a traceback or a hang past --timeout);
- every job on chain is done, or open and cancellable by its submitter (then cancelled):
  none is claimed or committed for good, none is unknown to its submitter;
- no wei is lost: the balances of everyone involved, the market and the reward pool sum
  to what they held before, less the base fees burned; nothing stays in escrow;
- each worker staked once (its stake is what it was configured to deposit, one
  WorkerRegistered event each) and was paid once per job (one JobVerified per job, its
  books equal to the chain's events)."""
import os
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import (
    FlakyProxy,
    balances_at_head,
    base_fees_burned,
    cancel_as_submitter,
    keystore_options,
    one_block,
    run_worker,
    stop_worker,
    wait_for,
)

from chain.blobhttp import BlobClient
from chain.blobs import encode_array
from chain.devnet import dev_account
from chain.launch import NodeProcess
from node.client import JobClient, RemoteJobError
from node.market import JOB_CANCELLED, JOB_DONE, JOB_OPEN, Market
from node.worker import Worker, WorkerConfig

pytestmark = pytest.mark.timeout(240)
MARKET = "0x000000000000000000000000000000000000c0DE"
POOL = "0x0000000000000000000000000000000000000FEE"
FEE = 10**15
STAKE = 10**18
WORKERS = (12, 13)
API_SUBMITTER, CLI_SUBMITTER, OBSERVER = 10, 11, 7
KILLS = 4
SEED = int(os.environ.get("CHAINKILL27_SEED", "27"))
TIMEOUT = 60  # each submission's own timeout (seconds)


def _exact_pairs(rng: np.random.Generator, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Small exact products (int8, int16, int32; 1x1 to 24x24), computed before a claim."""
    pairs = []
    for _ in range(count):
        dtype = rng.choice([np.int8, np.int16, np.int32])
        m, k, n = (int(x) for x in rng.integers(1, 25, 3))
        hi = min(np.iinfo(dtype).max, 2**20)
        pairs.append((rng.integers(-hi, hi, (m, k), dtype=dtype, endpoint=True),
                      rng.integers(-hi, hi, (k, n), dtype=dtype, endpoint=True)))
    return pairs


def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.astype(np.int64) @ b.astype(np.int64)


class ApiSubmitter(threading.Thread):
    """Batches through JobClient.submit and wait until stopped; the operands of every job
    it opened, by id, the Cs it got back, and every error."""

    def __init__(self, url: str, rng: np.random.Generator) -> None:
        super().__init__(daemon=True)
        self.client = JobClient(url, dev_account(API_SUBMITTER), fee_wei=FEE, timeout=TIMEOUT,
                                poll_interval=0.2)
        self.rng, self.stop = rng, threading.Event()
        self.operands: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.results: dict[int, np.ndarray] = {}
        self.errors: list[BaseException] = []

    def run(self) -> None:
        while not self.stop.is_set():
            pairs = _exact_pairs(self.rng, int(self.rng.integers(1, 4)))
            try:
                pending = self.client.submit(pairs)
                self.operands.update({p.job_id: (p.a, p.b) for p in pending})
                results = self.client.wait(pending)
                self.results.update({p.job_id: c for p, c in zip(pending, results,
                                                                   strict=True)})
            except BaseException as err:  # noqa: BLE001 - reported by the test
                self.errors.append(err)
                if isinstance(err, RemoteJobError):
                    self.results.update(err.results)


class CliSubmitter(threading.Thread):
    """`needle-net submit` processes one after another until stopped: (operands, exit code,
    output, C or None) of each."""

    def __init__(self, url: str, tmp_path, rng: np.random.Generator) -> None:
        super().__init__(daemon=True)
        self.url, self.tmp_path, self.rng = url, tmp_path, rng
        self.stop = threading.Event()
        self.runs: list[tuple[tuple[np.ndarray, np.ndarray], int, str, np.ndarray | None]] = []
        self.key = keystore_options(tmp_path, CLI_SUBMITTER)

    def run(self) -> None:
        while not self.stop.is_set():
            i = len(self.runs)
            ((a, b),) = _exact_pairs(self.rng, 1)
            paths = [self.tmp_path / f"{name}{i}.npy" for name in "abc"]
            np.save(paths[0], a)
            np.save(paths[1], b)
            started = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-m", "node", "submit", *map(str, paths[:2]), "-o",
                 str(paths[2]), "--rpc-url", self.url, *self.key, "--fee", "0.001",
                 "--timeout", str(TIMEOUT)], capture_output=True, text=True,
                timeout=TIMEOUT + 60)
            assert time.monotonic() - started < TIMEOUT + 30, "submit ran past its timeout"
            c = np.load(paths[2]) if done.returncode == 0 else None
            self.runs.append(((a, b), done.returncode, done.stdout + done.stderr, c))


def _parties() -> list[str]:
    return [dev_account(i).address for i in range(20)] + [MARKET, POOL]


def _settle_open_jobs(market: Market, count: int) -> None:
    """Every job left open is cancelled by its submitter (its way out)."""
    for job_id in range(count):
        if market.job(job_id).status == JOB_OPEN:
            cancel_as_submitter(market, job_id)


def test_clients_and_workers_ride_out_sigkilled_chain_node_restarts(tmp_path):
    rng = random.Random(SEED)
    node = NodeProcess(tmp_path / "chain", block_time=0.25)
    node.start()
    workers, threads, streams, market = [], [], [], None
    try:
        market = Market(node.url, dev_account(OBSERVER))
        first, total_before = balances_at_head(market, _parties())
        for index in WORKERS:
            worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path / f"w{index}",
                                         stake_wei=STAKE, poll_interval=0.2),
                            dev_account(index))
            workers.append(worker)
            threads.append(run_worker(worker))
        for worker in workers:
            wait_for(lambda w=worker: w.status()["stake_wei"] == STAKE, 60, "the stakes")
        api = ApiSubmitter(node.url, np.random.default_rng(SEED))
        cli = CliSubmitter(node.url, tmp_path, np.random.default_rng(SEED + 1))
        streams = [api, cli]
        for stream in streams:
            stream.start()
        wait_for(lambda: market.job_count() >= 2, 60, "the first jobs")
        market.close()
        market = None
        for _ in range(KILLS):
            time.sleep(rng.uniform(1.0, 4.0))
            node.kill()  # mid-job: uploads, long polls, sends and commits cut
            time.sleep(rng.uniform(0.0, 1.5))
            node.start()
        time.sleep(rng.uniform(1.0, 3.0))
        for stream in streams:
            stream.stop.set()
        for stream in streams:
            stream.join(TIMEOUT + 90)
            assert not stream.is_alive(), "a submitter hangs"
        market = Market(node.url, dev_account(OBSERVER))

        # every submission got its verified C (the API's), or said what to do (the CLI's)
        assert api.errors == [], [str(e) for e in api.errors]
        for (a, b), code, output, c in cli.runs:
            assert "Traceback" not in output, output
            if code == 0:
                np.testing.assert_array_equal(c, _product(a, b))
                continue
            # started while the node was down: refused at once, before any upload
            lines = [line for line in output.splitlines() if line.startswith("error:")]
            assert code == 1 and len(lines) == 1, output
            assert lines[0].startswith("error: cannot reach the chain node at "), output
        assert api.results and cli.runs
        for job_id, c in api.results.items():
            np.testing.assert_array_equal(c, _product(*api.operands[job_id]))

        # every job on chain is done, or open for its submitter to cancel
        count = market.job_count()
        _settle_open_jobs(market, count)
        jobs = [market.job(j) for j in range(count)]
        assert {j.status for j in jobs} <= {JOB_DONE, JOB_CANCELLED}, \
            [(j.job_id, j.status) for j in jobs]
        known = {**api.operands}
        cli_address = dev_account(CLI_SUBMITTER).address
        cli_done = sorted((j for j in jobs if j.submitter == cli_address),
                          key=lambda j: j.job_id)
        for job in jobs:
            if job.status == JOB_DONE and job.job_id in known:
                np.testing.assert_array_equal(market.get_array(job.c_id),
                                              _product(*known[job.job_id]))
        assert sorted(api.results) == sorted(api.operands), "a result lost"
        assert len(cli_done) == sum(code == 0 for _, code, _, _ in cli.runs), \
            "a CLI submission opened jobs twice, or one that failed opened one"

        # each worker staked once and was paid once per job; its books are the chain's
        events = market.logs(0, market.block_number())
        verified = [e["args"] for e in events if e["event"] == "JobVerified"]
        assert len({v["jobId"] for v in verified}) == len(verified)
        assert len(verified) == sum(j.status == JOB_DONE for j in jobs)
        for worker in workers:
            registered = [e for e in events if e["event"] == "WorkerRegistered"
                          and e["args"]["worker"] == worker.address]
            assert len(registered) == 1 and market.stake_of(worker.address) == STAKE
            mine = [v for v in verified if v["worker"] == worker.address]
            status = worker.status()
            assert status["completed"] == len(mine), (status, len(mine))
            assert status["earned_wei"] == sum(v["fee"] for v in mine)

        for _, code, output, _ in cli.runs:
            if code:
                print("CLI:", output.strip()[:300])
        print(f"{KILLS} kills: {count} jobs, {len(api.results)} API results, "
              f"{len(cli.runs)} CLI runs ({len(cli_done)} opened a job), "
              f"{len(verified)} verified")

        # money: nothing in escrow, the market holds the stakes, only base fees burned
        functions = market.contract.functions
        assert functions.totalEscrow().call() == 0
        assert market.balance_of(MARKET) == functions.totalStaked().call() + \
            functions.totalOwed().call()
        last, total_after = balances_at_head(market, _parties())
        assert total_after - total_before == -base_fees_burned(market, first + 1, last)
    finally:
        for stream in streams:
            stream.stop.set()
        for worker, thread in zip(workers, threads, strict=False):
            stop_worker(worker, thread)
        if streams:
            streams[0].client.close()
        if market is not None:
            market.close()
        node.stop()


def test_a_worker_whose_register_was_pending_at_a_node_crash_stakes_once(tmp_path):
    """Found by the soak's review: the chain node SIGKILLed while a starting worker's
    register was pending (admitted and journaled, not yet sealed: a node that seals on its
    block time) cut the worker's wait for it; the worker's retry read its stake, still 0, and
    signed a second register. Both landed after the restart: 2 ETH staked where it was
    configured to stake 1. The same register is now sent again, and lands once."""
    account = dev_account(14)
    chain = NodeProcess(tmp_path / "chain", block_time=5.0,
                        extra_args=("--no-seal-on-pending",))
    chain.start()
    watcher = Market(chain.url, dev_account(OBSERVER))
    worker = Worker(WorkerConfig(rpc_url=chain.url, data_dir=tmp_path / "worker",
                                 stake_wei=STAKE, poll_interval=0.2), account)
    thread = run_worker(worker)
    try:
        count = watcher.w3.eth.get_transaction_count
        wait_for(lambda: count(account.address, "pending") == 1, 30, "the register pending")
        watcher.close()
        assert count(account.address, "latest") == 0  # still pending when the node dies
        chain.kill()
        chain.start()
        watcher = Market(chain.url, dev_account(OBSERVER))
        wait_for(lambda: worker.status()["stake_wei"] > 0, 60, "the worker's stake")
        one_block(watcher)  # any second register, pending at the first one's seal, mined
        assert watcher.stake_of(account.address) == STAKE
        registered = [e for e in watcher.logs(0, watcher.block_number())
                      if e["event"] == "WorkerRegistered"]
        assert [e["args"]["worker"] for e in registered] == [account.address]
    finally:
        stop_worker(worker, thread)
        watcher.close()
        chain.stop()


def test_a_submission_whose_upload_connection_is_cut_uploads_again(tmp_path):
    """In the soak, a JobClient whose upload met the chain node's SIGKILL failed the
    submission at once ("[stage upload] ConnectionResetError"), its 60 s timeout unused,
    while the node was back a second later (a refused connection was waited out, a reset
    one not). Blobs are stored under their hash, so the upload is now sent again until the
    timeout. A real HTTP server in front of the node's blob store cuts the connection of
    the first uploads without answering, as the node's death does."""
    with NodeProcess(tmp_path / "chain", block_time=0) as chain:
        client = JobClient(chain.url, dev_account(16), fee_wei=FEE, timeout=60,
                           poll_interval=0.2)
        store = client.market.blobs.connections
        proxy = FlakyProxy(f"http://{store.host}:{store.port}{store.prefix}", failures=2,
                           drop=True)  # both tries of the keep-alive connection cut
        client.market.blobs = BlobClient(proxy.url, client.market.max_blob_bytes, 60,
                                         refused_upload_wait=60)
        try:
            rng = np.random.default_rng(9)
            a, b = _exact_pairs(rng, 1)[0]
            (pending,) = client.submit([(a, b)])
            assert proxy.failed == 2
            job = client.market.job(pending.job_id)
            assert (job.submitter, job.status) == (client.address, JOB_OPEN)
            assert bytes(client.market.blobs.get(job.a_id)) == encode_array(a)
            client.market.send("cancel", pending.job_id)
        finally:
            client.market.blobs.close()
            client.close()
            proxy.close()


def test_a_batch_whose_finalisation_nonce_was_taken_meanwhile_is_signed_again(
        tmp_path, caplog):
    """In the soak, a worker's finalizeJobs, signed behind its batch's commit, was sent while
    the chain node died: its nonce was given back, another of the worker's transactions
    took it after the restart, and the resend was refused "nonce too low, transaction has
    115": the batch failed with a traceback in the log (settled afterwards the slow way).
    Here a second client of the worker's key takes that nonce just before the send; the
    finalisation is signed again and the batch goes through."""
    account = dev_account(17)
    with NodeProcess(tmp_path / "chain", block_time=0) as chain:
        same_key, submitter = Market(chain.url, account), Market(chain.url, dev_account(18))
        worker = Worker(WorkerConfig(rpc_url=chain.url, data_dir=tmp_path / "worker",
                                     stake_wei=STAKE, poll_interval=0.2), account)
        sends = worker.chain.send_signed_after

        def nonce_taken_first(posted, signed):
            worker.chain.send_signed_after = sends
            one_block(same_key)  # takes the nonce the finalisation was signed with
            return sends(posted, signed)

        worker.chain.send_signed_after = nonce_taken_first
        thread = run_worker(worker)
        try:
            client = JobClient(chain.url, dev_account(18), fee_wei=FEE, timeout=60,
                               poll_interval=0.2)
            a, b = _exact_pairs(np.random.default_rng(4), 1)[0]
            (c,) = client.matmul_batch([(a, b)])
            client.close()
            np.testing.assert_array_equal(c, _product(a, b))
            wait_for(lambda: worker.status()["in_flight"] == 0, 30, "the job settled")
            assert worker.chain.send_signed_after is sends  # the nonce was taken
            assert [j["stage"] for j in worker.job_list()] == ["verified"]
            failures = [r for r in caplog.records if r.levelname == "ERROR"]
            assert failures == [], [r.getMessage() for r in failures]
        finally:
            stop_worker(worker, thread)
            same_key.close()
            submitter.close()
