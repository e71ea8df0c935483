"""The worker node: follows the market contract, claims jobs it can handle, computes them
on its best device, uploads and commits the result, and finalises it to get paid.

One process = one key and one data dir (`<data_dir>/worker.lock`, locked while it runs,
holds its pid: a second worker there is refused). The job loop runs on the main thread;
claimed jobs run on a small thread pool (several in flight); the HTTP API runs on its own
thread. State (the jobs in flight, and the next block to scan) is saved to
`<data_dir>/worker-state.json` when a job changes stage (the next block at most once a
second, off the job's path), so a restart resumes claimed and committed jobs instead of
abandoning them; a finished job is appended once to `<data_dir>/worker-jobs.jsonl` (the
node's history, for its dashboard).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TextIO

import httpx
import numpy as np
from eth_account.signers.local import LocalAccount
from eth_utils import keccak
from web3.exceptions import Web3RPCError

from chain.blobserver import BoundedHttpProtocol, listen
from chain.client import NotAChainNode, nonce_taken
from chain.dirlock import DirUnusable, claim_data_dir
from chain.journal import append_whole
from chain.params import GENESIS_GAS_LIMIT
from chain.timeline import mark
from node import compute
from node.market import (
    BLOCKHASH_WINDOW,
    CLAIM_GAS,
    COMMIT_GAS,
    DIRECT_COMMIT_FLOPS,
    FINALIZE_JOBS_GAS,
    JOB_CLAIMED,
    JOB_COMMITTED,
    JOB_DONE,
    JOB_OPEN,
    MIN_DEADLINE_BLOCKS,
    PRECISIONS,
    PRESIGN_BYTES,
    UPLOAD_THREADS,
    Job,
    Market,
    TxReverted,
    Verdict,
    commit_jobs_gas,
    finalize_gas,
    is_transient,
)
from node.metrics import NodeMetrics
from node.redact import redacted

log = logging.getLogger("needle.worker")

CHEAT_ENV = "NEEDLE_NET_ALLOW_CHEAT"
LOCK_FILE = "worker.lock"  # held (flock) by the worker using the data dir; holds its pid


@dataclass
class WorkerConfig:
    rpc_url: str
    data_dir: Path
    stake_wei: int
    min_fee_wei: int = 0
    max_flops: int = 2 * 4096**3
    # jobs to claim must give at least this many blocks after the claim (jobs computed before
    # they are committed, in one step, have no deadline to miss)
    min_deadline_blocks: int = MIN_DEADLINE_BLOCKS
    max_operand_bytes: int = 1 << 30
    max_in_flight: int = 8
    poll_interval: float = 1.0  # longest wait for a new block (a long poll) before polling anyway
    direct_commit_flops: int = DIRECT_COMMIT_FLOPS  # smaller: computed first, claimed + committed
    max_batch_jobs: int = 128  # small jobs taken per block, committed in one transaction
    finalize_timeout: float = 30.0
    connect_timeout: float = 30.0  # start-up: how long an unreachable chain node is retried
    api_host: str = "127.0.0.1"
    api_port: int | None = None
    api_allowed_hosts: tuple[str, ...] = ()  # DNS names the API answers to (node.api); "*": any
    admin_token: str | None = field(default=None, repr=False)  # never in a printed config
    corrupt_results: bool = False  # test fixture: a cheating worker
    stall_after_claim: float = 0.0  # test fixture: a worker that hangs mid-job
    wait_for_funds: bool = False  # an unfunded address waits to be funded instead of failing


@dataclass
class JobRecord:
    """One job as this node saw it (shown on the dashboard, saved for restarts)."""

    job_id: int
    batch: int
    m: int
    k: int
    n: int
    fee_wei: int
    stage: str = "claiming"
    started: float = field(default_factory=time.time)
    seconds: float | None = None
    detail: str = ""


ACCOUNT_REFRESH_SECONDS = 1.0
PEER_ACTIVE_BLOCKS = 100  # a worker that claimed nothing for this long is no longer ranked
PEER_GRACE_SECONDS = 0.5  # how long a job waits for each peer ranked before this worker
API_SHUTDOWN_SECONDS = 10.0
FINISHED = ("verified", "failed", "lost", "error", "expired", "skipped")
# finished jobs kept in memory (for /jobs and the dashboard); older ones are only in the
# journal and in the totals /status reports. Keeping them all grew memory, every /status,
# /jobs and state save with the node's whole history (/jobs: ~5 s of CPU at 100k jobs,
# and the dashboard asks every second)
HISTORY_JOBS = 1000
FUNDS_POLL_SECONDS = 5.0  # how often an unfunded worker (wait_for_funds) looks again
REGISTER_GAS_ALLOWANCE = 150_000  # gas budgeted for `register` (measured: 72k)
# a batch of small jobs is finalised in one transaction: its gas limit stays within half a
# block (128 thin jobs such as 64 x 32768 x 64 asked for 4.9e9, which the node refused)
BATCH_FINALIZE_GAS = GENESIS_GAS_LIMIT // 2
HELD_RETRY_MAX_DELAY = 2.0  # longest wait between tries for a job this worker holds
ADMIN_TOKEN_ENV = "NEEDLE_NET_ADMIN_TOKEN"
# a large job is claimed only if its deadline gives DEADLINE_MARGIN times the seconds this
# worker needs after the claim: computing at the slowest throughput it timed lately (the
# start-up probe before it timed a job), uploading C at the slowest transfer rate it saw
# lately, and two transactions (measured: 5 ms each on a local node)
DEADLINE_MARGIN = 2.0
TRANSACTION_SECONDS = 0.05
DEFAULT_TRANSFER_BYTES_PER_SECOND = 100e6  # a gigabit link (measured locally: 0.5-3 GB/s)
DEFAULT_BLOCK_SECONDS = 0.05  # the block interval assumed until one was measured
PACE_WINDOW_SECONDS = 1.0  # the block interval is averaged over windows at least this long
RECENT_SECONDS = 600.0  # measurements older than this no longer count
RECENT_SAMPLES = 64
# jobs and transfers too small to time a device or a link by (overheads dominate them)
MIN_SAMPLE_FLOPS = 2 * compute.PROBE_SIZE**3
MIN_SAMPLE_BYTES = 1 << 20


class WorkerStartError(ValueError):
    """The worker cannot start: no chain node, a stake below the market's minimum, too
    little ETH to deposit it, an unreadable admin token file. A ValueError, which
    `needle-net worker up` prints as a one-line error."""


class ClaimExpired(Exception):
    """The claim's deadline passed before the result could be committed."""


class StoppedHolding(Exception):
    """A stop request ended the retries of a transaction for a job this worker holds: the
    job stays in flight, saved as it is, for a restart to resume (booked as an error, it
    was listed twice once the restart resumed it)."""


class FundsNeeded(WorkerStartError):
    """The worker's address holds too little ETH to deposit its stake (and pay the gas)."""


def admin_token(path: Path | None) -> str | None:
    """The token for the admin routes: from `path`, else from $NEEDLE_NET_ADMIN_TOKEN (None:
    the admin routes stay closed). A token file that cannot be read or is empty is a
    WorkerStartError, not a worker that silently answers 403."""
    if path is None:  # compose passes an unset variable as empty: closed, as unset
        return (os.environ.get(ADMIN_TOKEN_ENV) or "").strip() or None
    try:
        token = path.read_text(encoding="utf-8").strip()  # as the API compares it, whatever
        # the locale (a non-ASCII token read otherwise never matched)
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise WorkerStartError(f"cannot read the admin token file {path}: {reason}") from err
    if not token:
        raise WorkerStartError(f"the admin token file {path} is empty")
    return token


def _lock_data_dir(data_dir: Path) -> TextIO:
    """The data dir's lock, held while the worker runs: two workers there wrote the same
    state file and journal, each resuming the other's jobs. A crashed worker holds none
    (the kernel drops a dead process's flock)."""
    try:
        return claim_data_dir(data_dir, LOCK_FILE, "worker")
    except DirUnusable as err:
        raise WorkerStartError(str(err)) from err.__cause__


def _nonce_taken(err: Exception) -> bool:
    """Whether the node refused a transaction for a nonce another client with this key took
    (the transaction never ran: it may be signed again with the next nonce)."""
    return isinstance(err, Web3RPCError) and nonce_taken(err)


def _eth(wei: int) -> str:
    return f"{wei / 10**18:g} ETH"


def rank(job_id: int, worker: str, peers: list[str]) -> int:
    """`worker`'s place (0 = first) in job `job_id`'s order of `worker` and `peers`, ordered by
    keccak(jobId, address): every job gets an independent, agreed order of the workers."""
    key = job_id.to_bytes(32, "big")
    mine = keccak(key + bytes.fromhex(worker[2:]))
    return sum(keccak(key + bytes.fromhex(p[2:])) < mine for p in set(peers) - {worker})


def seconds_needed(flops: float, c_bytes: int, flops_per_second: float,
                   bytes_per_second: float) -> float:
    """Seconds from a claim to its commit: compute `flops`, upload `c_bytes` of C, and the
    claim's and the commit's transactions (A and B are fetched before the claim)."""
    return flops / flops_per_second + c_bytes / bytes_per_second + 2 * TRANSACTION_SECONDS


def seconds_given(timeout_blocks: int, block_seconds: float) -> float:
    """Seconds a deadline of `timeout_blocks` blocks after the claim's block leaves for the
    commit at `block_seconds` per block: the commit must be sent before the deadline's block
    is the head (sent later, it lands after the deadline)."""
    return (timeout_blocks - 1) * block_seconds


class RecentLowest:
    """The lowest value measured in the last RECENT_SECONDS (the slowest throughput, the
    shortest block interval: the safe side), else `default`. Thread-safe: jobs on the pool
    add what they time, the job loop reads."""

    def __init__(self, default: float) -> None:
        self.default = default
        self._samples: deque[tuple[float, float]] = deque(maxlen=RECENT_SAMPLES)
        self._lock = threading.Lock()

    def add(self, value: float, now: float) -> None:
        with self._lock:
            self._samples.append((now, value))

    def lowest(self, now: float) -> float:
        with self._lock:
            recent = [v for t, v in self._samples if now - t <= RECENT_SECONDS]
        return min(recent, default=self.default)


class BlockPace:
    """The chain's block interval as this worker's clock sees the head move: seconds per
    block over windows of at least PACE_WINDOW_SECONDS (blocks sealed back to back on demand
    are averaged over their window, not taken for the chain's pace), the shortest recent."""

    def __init__(self) -> None:
        self.intervals = RecentLowest(DEFAULT_BLOCK_SECONDS)
        self._start: tuple[int, float] | None = None  # the window's first head and time

    def observe(self, head: int, now: float) -> None:
        if self._start is None or head < self._start[0]:
            self._start = (head, now)
            return
        blocks, seconds = head - self._start[0], now - self._start[1]
        if blocks > 0 and seconds >= PACE_WINDOW_SECONDS:
            self.intervals.add(seconds / blocks, now)
            self._start = (head, now)

    def interval(self, now: float) -> float:
        return self.intervals.lowest(now)


def _flops(batch: int, m: int, k: int, n: int) -> int:
    return 2 * batch * m * k * n


def _line(record: JobRecord) -> str:
    """A job record as one line of the journal."""
    return json.dumps(vars(record), separators=(",", ":")) + "\n"


def _append_whole(path: Path, data: bytes) -> None:
    """Append all of data to the file, or none of it (the records retried at the next save
    are then not there twice)."""
    with path.open("ab", buffering=0) as f:
        append_whole(f.fileno(), data, f.seek(0, os.SEEK_END))


class Worker:
    def __init__(self, config: WorkerConfig, account: LocalAccount) -> None:
        test_fixture = config.corrupt_results or config.stall_after_claim > 0
        if test_fixture and os.environ.get(CHEAT_ENV) != "1":
            raise ValueError(
                f"--corrupt-results and --stall-after-claim are test fixtures; they need "
                f"{CHEAT_ENV}=1"
            )
        self.config = config
        self.account = account
        self.address = account.address
        self._dir_lock = _lock_data_dir(Path(config.data_dir))
        try:
            self.metrics = NodeMetrics()
            self.device = compute.best_device()  # first: a device it lacks ends the start
            self.chain = self._connect()
            self._await_funds()
            probe_rate = compute.measure_throughput(self.device)
            self._compute_rate = RecentLowest(probe_rate)
            # a product's fixed cost, as FLOPs at the probe's rate (_work)
            self._product_flops = compute.measure_product_seconds(self.device) * probe_rate
            self._transfer_rate = RecentLowest(DEFAULT_TRANSFER_BYTES_PER_SECOND)
            self._pace = BlockPace()
            self._passed_over: set[int] = set()  # large jobs too slow for their deadline (logged)
            self._rng = np.random.default_rng()
            self._lock = threading.Lock()
            self._stop = threading.Event()
            self._pool = ThreadPoolExecutor(config.max_in_flight, thread_name_prefix="job")
            self._blob_pool = ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix="blob")
            self._candidates: dict[int, Job | None] = {}
            self._tasks = 0  # claimed jobs and batches of small jobs on the pool
            self._peers: dict[str, int] = {}  # workers seen claiming -> their latest claim's block
            self._seen: dict[int, float] = {}  # candidate job -> when it was first seen open
            self._next_turn: float | None = None  # when a job left to a peer becomes ours
            self._stake_wei = 0
            self._balance_wei = 0
            self._head = 0
            self._state_path = Path(config.data_dir) / "worker-state.json"
            self._journal_path = Path(config.data_dir) / "worker-jobs.jsonl"
            self._unjournaled: list[JobRecord] = []  # finished, not yet in the journal
            # finished jobs no longer in self.jobs (HISTORY_JOBS): their outcomes and fees earned
            self._forgotten_stages: dict[str, int] = dict.fromkeys(FINISHED, 0)
            self._forgotten_earned = 0
            self._next_block, self.jobs, waiting = self._load_state()
            # open jobs seen before a restart but not taken (busy, or a peer's turn): their
            # JobSubmitted lies before the block the scan resumes from; looked up when taken
            self._watch(dict.fromkeys(waiting))
            with self._lock:
                self._forget_old_jobs()
                # the gauge counts what the books hold, not only what this run earned (as
                # /status does)
                self.metrics.earned.set(self._earned_wei())
            self._saved_block = self._next_block
            self._save_failing = False  # the last save failed (logged once until one works)
            self._api_server = None
            self._withdrawing = False
            # the chain has shown this stake's withdrawal requested (here or elsewhere): its
            # end with the stake still there means a `stake` elsewhere cancelled it
            self._withdrawal_on_chain = False
            self._withdraw_lock = threading.Lock()  # one requestWithdraw for calls that overlap
            self._unanswered_register: tuple | None = None  # sent again as it is (`_register`)
            self._min_stake = 0
            self._api_socket = self._bind_api()  # last: nothing after it fails to close it
        except BaseException:  # the dir and the chain client's connections free again
            if hasattr(self, "chain"):
                self.chain.close()
            self._dir_lock.close()
            raise

    # -- persistence ------------------------------------------------------------------

    def _load_state(self) -> tuple[int, list[JobRecord], list[int]]:
        """(next block to scan, this node's job attempts in the order they started (a
        reopened job may appear twice), the open jobs seen but not taken). A job that
        finished just before a crash may be both in the journal and still in flight in the
        state file: the journal's record counts."""
        saved = self._saved_state()
        if self._set_aside_if_of_another_chain(saved[0], saved[3]):
            saved = 0, [], [], None
        next_block, in_flight, waiting, self._block_one = saved
        finished: dict[tuple[int, float], JobRecord] = {}  # a later line replaces an earlier
        lines = self._journal_path.read_text().splitlines() \
            if self._journal_path.exists() else []
        for line in lines:
            try:
                record = JobRecord(**json.loads(line))
            except (ValueError, TypeError):  # a line cut short by a crash
                log.warning("skipped a damaged line of %s", self._journal_path)
                continue
            finished[record.job_id, record.started] = record
        if len(finished) < len(lines):  # rewritten without it: the next line starts afresh
            self._write(self._journal_path, "".join(_line(r) for r in finished.values()))
        others = [r for r in in_flight if (r.job_id, r.started) not in finished]
        # a state file written before the journal existed lists finished jobs too
        self._unjournaled = [r for r in others if r.stage in FINISHED]
        jobs = sorted([*finished.values(), *others], key=lambda r: r.started)
        return next_block, jobs, waiting

    def _set_aside_if_of_another_chain(self, next_block: int, block_one: str | None) -> bool:
        """Whether the saved state was kept while its chain was replaced (the chain's volume
        or directory removed, a devnet reset): it resumes beyond the head, or names another
        block 1. If so, the state and the journal are moved aside and the worker starts as
        on a fresh data dir; before, it took no job until the new chain reached the old
        one's height."""
        if not self._state_path.exists():
            return False
        head = self.chain.block_number()
        here = self._block_one_hash(head)
        if next_block <= head + 1 and block_one in (None, here):
            return False
        suffix = f".other-chain-{time.strftime('%Y%m%d-%H%M%S')}"
        for path in (self._state_path, self._journal_path):
            if path.exists():
                path.rename(path.with_name(path.name + suffix))
        log.warning("%s was kept on another chain (it resumes at block %d; this chain's head "
                    "is %d, its block 1 %s): moved aside (%s), starting afresh",
                    self._state_path, next_block, head, here, suffix)
        return True

    def _block_one_hash(self, head: int) -> str | None:
        """The hash of block 1, which tells chains apart (each block's mix_hash is drawn at
        random); None before there is one."""
        return self.chain.w3.eth.get_block(1)["hash"].hex() if head >= 1 else None

    def _saved_state(self) -> tuple[int, list[JobRecord], list[int], str | None]:
        """(next block to scan, the jobs in flight, the open jobs waiting, the chain's mark)
        from the state file. One that cannot be read (cut short, emptied by a power cut,
        edited) is a WorkerStartError that names it and the way out: a bare JSON error (or a
        TypeError's traceback) said neither, while a claim the worker held ran towards its
        deadline."""
        if not self._state_path.exists():
            return 0, [], [], None
        try:
            saved = json.loads(self._state_path.read_text())
            return (int(saved["next_block"]), [JobRecord(**j) for j in saved["jobs"]],
                    [int(j) for j in saved.get("waiting", [])], saved.get("block_one"))
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise WorkerStartError(
                f"the worker state file {self._state_path} cannot be read "
                f"({type(err).__name__}: {err}); move it aside to start afresh: the jobs this "
                "worker holds on chain are then taken up again from the chain") from err

    def _save_state(self) -> None:
        """Append the jobs finished since the last save to the journal, then rewrite the
        state file with the jobs in flight: a save costs what changed, not every job this
        node ever did (rewriting them all made each job's saves grow with the history).

        A save that fails (a full disk, a dir made read-only) is logged and made again at
        the next change: the jobs go on in memory, and the chain holds their claims, which a
        restart resumes. The failure ended a claimed job instead, whose missed deadline then
        cut the stake, and stopped the stake and balance refresh for good."""
        with self._lock:
            try:
                self._state_path.parent.mkdir(parents=True, exist_ok=True)
                if self._unjournaled:
                    _append_whole(self._journal_path,
                                  "".join(map(_line, self._unjournaled)).encode())
                    self._unjournaled = []
                data = {"next_block": self._next_block,
                        "jobs": [vars(j) for j in self.jobs if j.stage not in FINISHED],
                        "waiting": list(self._candidates), "block_one": self._block_one}
                self._write(self._state_path, json.dumps(data, separators=(",", ":")))
            except OSError as err:
                if not self._save_failing:
                    log.warning("cannot save the worker's state in %s (%s): going on in "
                                "memory, saving again at each change", self._state_path.parent,
                                err)
                self._save_failing = True
                return
            self._saved_block = self._next_block
            if self._save_failing:
                log.info("the worker's state is saved again in %s", self._state_path.parent)
            self._save_failing = False

    @staticmethod
    def _write(path: Path, text: str) -> None:
        """Replace a file's contents at once (a crash leaves the old or the new)."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    def _set_stage(self, record: JobRecord, stage: str, detail: str = "",
                   save: bool = True) -> None:
        with self._lock:
            record.stage = stage
            record.detail = detail
            if stage in FINISHED:
                record.seconds = time.time() - record.started
                self._unjournaled.append(record)
                if len(self.jobs) > 2 * HISTORY_JOBS:  # amortised: one pass per HISTORY_JOBS
                    self._forget_old_jobs()
        if save:
            self._save_state()

    def _forget_old_jobs(self) -> None:
        """Drop all but the latest HISTORY_JOBS finished jobs from memory (under the lock;
        jobs in flight stay), counting their outcomes and fees in the totals. They stay in
        the journal."""
        finished = [r for r in self.jobs if r.stage in FINISHED]
        old = {id(r) for r in finished[:max(0, len(finished) - HISTORY_JOBS)]}
        if not old:
            return
        for record in finished[:len(old)]:
            self._forgotten_stages[record.stage] += 1
            if record.stage == "verified":
                self._forgotten_earned += record.fee_wei
        self.jobs = [r for r in self.jobs if id(r) not in old]

    def _earned_wei(self) -> int:
        """Fees of every verified job in the books, forgotten ones included (under the
        lock)."""
        return self._forgotten_earned + sum(j.fee_wei for j in self.jobs if j.stage == "verified")

    # -- views for the API ---------------------------------------------------------------

    def status(self) -> dict:
        """Totals over every job this node did (`in_flight` is the jobs in flight now)."""
        with self._lock:
            stages = [j.stage for j in self.jobs]
            earned = self._earned_wei()
            forgotten = dict(self._forgotten_stages)
        return {
            "address": self.address,
            "device": compute.device_name(self.device),
            "accepting_jobs": not self._stop.is_set() and self._may_claim(),
            "in_flight": sum(s not in FINISHED for s in stages),
            "completed": forgotten["verified"] + stages.count("verified"),
            "failed": forgotten["failed"] + stages.count("failed"),
            "earned_wei": earned,
            "stake_wei": self._stake_wei,
            "balance_wei": self._balance_wei,
            "chain_head": self._head,
        }

    def job_list(self) -> list[dict]:
        """The jobs in flight and the latest HISTORY_JOBS finished ones, newest first (all
        finished ones are in the journal, worker-jobs.jsonl)."""
        with self._lock:
            return [asdict(j) for j in reversed(self.jobs)]

    def recent_blocks(self, count: int) -> list[dict]:
        return self.chain.recent_blocks(count)

    def request_stop(self) -> None:
        """Stop claiming; jobs in flight are finished (committed and finalised) first."""
        self._stop.set()

    def request_withdraw(self) -> dict:
        """First call: stop claiming and request withdrawal of the stake; after the cooldown
        (and with no active claim): withdraw it. Calls are serialised (the API answers each
        request on a thread of its own): a call that overlaps another reads the chain after
        the other's transaction and answers as a repeat call, instead of sending it again
        (a second requestWithdraw costs gas and restarts the cooldown)."""
        with self._withdraw_lock:
            stake, withdraw_block, active_claims = self.chain.worker_info(self.address)
            if withdraw_block == 0:
                withdrawing, self._withdrawing = self._withdrawing, True  # no claim may start
                try:  # while the request is out
                    receipt = self.chain.send("requestWithdraw")
                except Exception:  # refused: taking jobs as before (none once withdrawn)
                    self._withdrawing = withdrawing
                    raise
                available = self.chain.events_in(receipt,
                                                 "WithdrawRequested")[0]["availableBlock"]
                return {"requested": True, "available_block": available, "stake_wei": stake}
            if self.chain.block_number() < withdraw_block or active_claims:
                return {"requested": True, "available_block": withdraw_block,
                        "stake_wei": stake, "active_claims": active_claims}
            self.chain.send("withdraw")
            self._stake_wei = 0
            return {"withdrawn_wei": stake}

    # -- the job loop ----------------------------------------------------------------------

    def run(self) -> None:
        """Register, resume saved jobs, then follow the chain until asked to stop."""
        self._start_api()
        try:
            self._retry(self._ensure_registered)
            threading.Thread(target=self._refresh_account, name="account", daemon=True).start()
            self._resume()
            head, events = None, None
            unreachable_since = None  # an outage is logged once, and its end
            while not self._stop.is_set():
                try:
                    self._poll(self.chain.block_number() if head is None else head, events)
                    wait = self.config.poll_interval
                    if self._next_turn is not None:
                        wait = min(wait, max(0.0, self._next_turn - time.monotonic()))
                    head, events = self.chain.follow(self._next_block, wait)
                    if unreachable_since is not None:
                        log.info("chain node reachable again after %.0f s",
                                 time.monotonic() - unreachable_since)
                        unreachable_since = None
                except Exception as err:  # noqa: BLE001 - the loop must survive a bad poll
                    if not is_transient(err):
                        log.exception("poll failed")
                    elif unreachable_since is None:
                        unreachable_since = time.monotonic()
                        log.warning("chain node unreachable (%s); trying again every second",
                                    err)
                    self.metrics.chain_errors.inc()
                    head, events = None, None
                    self._stop.wait(1.0)
        finally:
            log.info("stopping: finishing %d job(s) in flight", self.status()["in_flight"])
            self._pool.shutdown(wait=True)
            self._blob_pool.shutdown(wait=True)
            self._save_state()
            self._stop_api()
            self._dir_lock.close()  # the data dir free for the next start

    def close(self) -> None:
        """Free what a worker that is not running holds: its pools, the API's socket if the
        API never started, its chain client and the data dir's lock (`run` frees the lock
        itself when it ends), so that another worker may start on the dir. Idempotent."""
        self._pool.shutdown(wait=True)
        self._blob_pool.shutdown(wait=True)
        if self._api_server is None and self._api_socket is not None:
            self._api_socket.close()
        self.chain.close()
        self._dir_lock.close()

    def _retry(self, fn, *args, attempts: int = 8):
        """Call fn, retrying transient network errors with exponential backoff."""
        delay = 0.1
        for attempt in range(attempts):
            try:
                return fn(*args)
            except Exception as err:
                if not is_transient(err) or attempt == attempts - 1:
                    raise
                self.metrics.chain_errors.inc()
                log.warning("transient error (%s), retrying in %.1fs", err, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _retry_held(self, last_block: int, fn, *args):
        """Call fn for a job this worker holds (`last_block`: see `_last_block`), retrying
        transient network errors for as long as the head the job loop saw last is not past
        that block: giving up sooner let the claim expire (a 10 % stake cut) or left the
        fee unpaid. An unreachable chain node is waited for (no head, no deadline known to
        have passed). The outage is logged once, and its end; a stop request ends the
        retries with StoppedHolding (a restart resumes the job, which the chain names as this
        worker's)."""
        delay, outage_since = 0.1, None
        while True:
            try:
                result = fn(*args)
            except Exception as err:
                if not is_transient(err) or self._head > last_block:
                    raise
                if self._stop.is_set():
                    raise StoppedHolding(f"stopped while {fn.__name__} was retried") from err
                self.metrics.chain_errors.inc()
                if outage_since is None:
                    outage_since = time.monotonic()
                    log.warning("chain node or blob store unreachable (%s) during %s for a "
                                "job this worker holds; retrying until block %d", err,
                                fn.__name__, last_block)
                self._stop.wait(delay)
                delay = min(delay * 2, HELD_RETRY_MAX_DELAY)
                continue
            if outage_since is not None:
                log.info("%s for a job this worker holds went through after %.0f s",
                         fn.__name__, time.monotonic() - outage_since)
            return result

    @staticmethod
    def _last_block(job: Job) -> int | None:
        """The last block in which the next transaction for `job` still counts if this
        worker holds it: its commit by the claim's deadline, its finalisation within
        BLOCKHASH_WINDOW of the commit. None for a job it does not hold (yet)."""
        if job.status == JOB_CLAIMED:
            return job.deadline
        if job.status == JOB_COMMITTED:
            return job.commit_block + BLOCKHASH_WINDOW
        return None

    def _retry_for(self, job: Job, fn, *args):
        """fn(*args) on `job`'s path: retried until its deadline if this worker holds it
        (`_retry_held`), else a bounded number of times (`_retry`)."""
        last_block = self._last_block(job)
        if last_block is None:
            return self._retry(fn, *args)
        return self._retry_held(last_block, fn, *args)

    def _connect(self) -> Market:
        """The market at `rpc_url`. A node that does not answer yet is retried with backoff
        for `connect_timeout` seconds (a worker may start with its node), then given up
        with a WorkerStartError, as is an answer that is not a chain node's."""
        url, delay = self.config.rpc_url, 0.5
        deadline = time.monotonic() + self.config.connect_timeout
        while True:
            try:
                return Market(url, self.account)
            except NotAChainNode as err:
                raise WorkerStartError(redacted(str(err))) from err
            except (httpx.HTTPError, ValueError, KeyError) as err:
                if not is_transient(err):
                    raise WorkerStartError(redacted(
                        f"{url} is not a needle-net chain node: {err}")) from err
                if time.monotonic() + delay > deadline:
                    raise WorkerStartError(redacted(
                        f"no chain node answers at {url} (retried for "
                        f"{self.config.connect_timeout:g}s): {err}")) from err
                log.warning("no chain node answers at %s (%s); retrying in %.1fs",
                            redacted(url), redacted(str(err)), delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _await_funds(self) -> None:
        """`_check_stake_and_funds`; with `wait_for_funds`, an unfunded address is waited for
        (polled every FUNDS_POLL_SECONDS, said once) instead of ending the start: a service
        manager restarted such a worker in a tight loop (20 restarts in 30 s under podman)."""
        said = False
        while True:
            try:
                return self._retry(self._check_stake_and_funds)
            except FundsNeeded as err:
                if not self.config.wait_for_funds:
                    raise
                if not said:
                    log.warning("%s; waiting for them (checked every %g s)", err,
                                FUNDS_POLL_SECONDS)
                    said = True
                time.sleep(FUNDS_POLL_SECONDS)

    def _check_stake_and_funds(self) -> None:
        """Refuse at start what registering would fail on later: a stake below the market's
        minimum, or a balance short of the stake still to deposit plus its gas."""
        min_stake = self.chain.min_stake()
        staked, withdraw_block, _ = self.chain.worker_info(self.address)
        if withdraw_block:  # nothing to deposit: the stake stays as it is (_ensure_registered)
            return
        if max(staked, self.config.stake_wei) < min_stake:
            raise WorkerStartError(f"a stake of {_eth(self.config.stake_wei)} is below the "
                                   f"market's minimum stake of {_eth(min_stake)}")
        deposit = self.config.stake_wei - staked
        if deposit <= 0:
            return
        gas = REGISTER_GAS_ALLOWANCE * 2 * self.chain.w3.eth.gas_price  # the max fee sent
        balance = self.chain.balance_of(self.address)
        if balance < deposit + gas:
            raise FundsNeeded(
                f"worker address {self.address} needs funds: its balance is {_eth(balance)}, "
                f"staking needs {_eth(deposit)} plus up to {_eth(gas)} of gas")

    def _ensure_registered(self) -> None:
        """Top the stake up to the configured one, unless a withdrawal is pending: registering
        cancels it, so a worker restarted after a slash took jobs again, its owner's
        withdrawal undone, where one whose stake was whole stayed closed."""
        stake, withdraw_block, _ = self.chain.worker_info(self.address)
        while stake < self.config.stake_wei and not withdraw_block:
            try:
                self._register(self.config.stake_wei - stake)
            except TxReverted:
                # a slash mined first (a claim of the last run expiring) left the top-up short
                # of the minimum: read and send again. Each slash ends a claim, so this
                # repeats at most once per claim in flight; a revert with no slash has
                # another cause.
                priced_at = stake
                stake, withdraw_block, _ = self.chain.worker_info(self.address)
                if stake >= priced_at:
                    raise
                continue
            log.info("registered %s with stake %d wei", self.address, self.config.stake_wei)
            stake, withdraw_block, _ = self.chain.worker_info(self.address)
        self._unanswered_register = None  # mined, if it was sent
        if withdraw_block:  # requested before a restart: the chain refuses every claim now
            log.info("withdrawal of the stake pending (block %d): taking no jobs",
                     withdraw_block)
        self._withdrawing = self._withdrawal_on_chain = bool(withdraw_block)
        self._stake_wei = stake
        self._min_stake = self.chain.min_stake()
        self.metrics.stake.set(stake)

    def _register(self, deposit: int) -> None:
        """Deposit `deposit` more stake. A register whose answer a network error lost (the
        chain node killed while it was pending) is sent again as it is by the caller's
        retry, not signed anew: the node knows it or mined it, so the stake is deposited
        once. Signed anew, it was deposited twice where the first one landed after the
        restart. A nonce another client of this key took means it never ran: signed anew."""
        if self._unanswered_register is None:
            self._unanswered_register = self.chain.sign_with_gas(
                REGISTER_GAS_ALLOWANCE, "register", value=deposit)
        try:
            self.chain.send_signed(self._unanswered_register)
        except Exception as err:
            if is_transient(err):
                raise  # kept for the retry
            self._unanswered_register = None
            if not _nonce_taken(err):
                raise
            self.chain.send("register", value=deposit)
        self._unanswered_register = None

    def _resume(self) -> None:
        """Pick up jobs a previous run claimed or committed but did not finish, including a
        claim mined just before a crash that the state file never recorded. Each look-up is
        retried: a worker started as its chain node restarted (a host's or compose's restart
        of both) exited here, and its claims expired."""
        known = {r.job_id for r in self.jobs if r.stage not in FINISHED}
        # the scan of every JobClaimed (and a getJob per id) only where the chain counts
        # claims or commits of this worker in flight: a restart cost one call per job ever done
        unknown = self._retry(self.chain.claimed_by, self.address) - known \
            if self._retry(self.chain.worker_info, self.address)[2] else set()
        for job_id in unknown:
            job = self._retry(self.chain.job, job_id)
            if job.worker == self.address and job.status in (JOB_CLAIMED, JOB_COMMITTED):
                self._take_up(job)
        for record in list(self.jobs):
            if record.stage in FINISHED:
                continue
            job = self._retry(self.chain.job, record.job_id)
            if job.worker != self.address or job.status not in (JOB_CLAIMED, JOB_COMMITTED):
                self._settle_after_restart(record, job)
                continue
            log.info("resuming job %d (%s)", record.job_id, record.stage)
            self.metrics.in_flight.inc()
            self._tasks += 1
            start = "finalize" if job.status == JOB_COMMITTED else "compute"
            self._pool.submit(self._process, record, job, start)

    def _take_up(self, job: Job) -> None:
        """Book a job the chain names as this worker's claim or commit and that no saved
        record has in flight: under its latest record again if that one says "error" (the
        job given up while its claim stood, e.g. by an older version stopped in an outage: a
        new record listed it twice, as an error and as resumed), else under a new one."""
        with self._lock:
            latest = next((r for r in reversed(self.jobs) if r.job_id == job.job_id), None)
            if latest is not None and latest.stage == "error":
                latest.stage, latest.detail, latest.seconds = "claimed", "", None
                return
            self.jobs.append(JobRecord(job.job_id, job.batch, job.m, job.k, job.n,
                                       job.fee_wei, "claimed"))

    def _settle_after_restart(self, record: JobRecord, job: Job) -> None:
        """A saved job in flight that is no longer this worker's claim or commit: the
        crash came after its verdict (Done by this worker: verified and paid; a commit
        failed: slashed) or before its claim (still open: taken again, as its event lies
        before the block the scan resumes from), else another worker has it."""
        if job.status == JOB_DONE and job.worker == self.address:
            verdict = self._retry(self.chain.verdict, job.job_id, self.address)
            self._record_verdict(record, verdict or Verdict(True, fee_wei=job.fee_wei))
            return
        if record.stage == "committed":
            verdict = self._retry(self.chain.verdict, job.job_id, self.address)
            if verdict is not None and not verdict.passed:
                self._record_verdict(record, verdict)
        unclaimed = record.stage == "fetching" or (
            record.stage == "computing" and job.status == JOB_OPEN)  # a small job's, uncommitted
        if unclaimed:  # never this worker's job: no record of it
            with self._lock:
                self.jobs.remove(record)
            self._save_state()
        if job.status == JOB_OPEN:
            self._watch({job.job_id: job})
        if record.stage not in FINISHED and record in self.jobs:
            self._set_stage(record, "lost", "no longer ours after restart")

    def _poll(self, head: int, events: list | None = None) -> None:
        """Take in blocks up to `head` (`events`: the market's events in the blocks not
        seen yet, from the long poll; else asked for) and start work on new jobs. The next
        block to scan is saved by `_refresh_account`, off the job's path (a restart rescans
        the blocks since: harmless)."""
        self._head = head
        self._pace.observe(head, time.monotonic())
        if head >= self._next_block:
            if events is None:
                events = self.chain.logs(self._next_block, head)
            news = self.chain.new_jobs(events)
            mark(f"worker logs {len(news.opened)} opened")
            self._peers.update(news.claimers)
            for job_id in news.taken:
                self._candidates.pop(job_id, None)
                self._seen.pop(job_id, None)
                self._passed_over.discard(job_id)
            self._watch(news.opened)
            self._next_block = head + 1
        self._take_candidates()

    def _watch(self, jobs: dict[int, Job | None]) -> None:
        """Open jobs to take once it is this worker's turn, seen from now (a None is looked
        up on the chain when taken)."""
        self._candidates.update(jobs)
        self._seen.update(dict.fromkeys(jobs, time.monotonic()))

    def _refresh_account(self) -> None:
        """Stake and balance, every ACCOUNT_REFRESH_SECONDS on a thread of their own: the
        node answers reads after the block it is sealing, and the job loop must not wait.
        The state is saved here too if only the next block to scan moved."""
        while not self._stop.wait(ACCOUNT_REFRESH_SECONDS):
            if self._next_block != self._saved_block:
                self._save_state()
            try:
                if self._block_one is None:
                    self._block_one = self._block_one_hash(self._head)
                stake, withdraw_block, _ = self.chain.worker_info(self.address)
                self._note_stake(stake)
                if withdraw_block:  # requested elsewhere too (`needle-net withdraw`): the
                    # chain refuses every claim and commit now, which cost gas and jobs
                    self._withdrawing = self._withdrawal_on_chain = True
                elif self._withdrawal_on_chain and stake >= self._min_stake > 0:
                    self._reopen_after_cancelled_withdrawal(stake)
                self._balance_wei = self.chain.balance_of(self.address)
            except Exception as err:  # noqa: BLE001 - the next refresh tries again
                if not is_transient(err):
                    log.exception("account refresh failed")
                self.metrics.chain_errors.inc()

    def _reopen_after_cancelled_withdrawal(self, stake: int) -> None:
        """A withdrawal the chain showed is gone while the stake stayed: `needle-net stake`
        (registering again) cancelled it. The worker took no job again until restarted.
        A request of its own not yet mined was never shown, so it is not undone here."""
        self._withdrawal_on_chain = self._withdrawing = False
        log.info("the stake's withdrawal was cancelled (stake %s): taking jobs again",
                 _eth(stake))

    def _note_stake(self, stake: int) -> None:
        """Take `stake`, just read from the chain, as the worker's; say once when slashes
        (claims that expired, say while it restarted) cut it below the market's minimum:
        the chain refuses every claim then, and the worker skipped every job silently,
        /status saying it accepted them."""
        if self._min_stake > stake and self._stake_wei >= self._min_stake \
                and not self._withdrawing:
            log.warning("the stake, %s, is below the market's minimum of %s after slashes: "
                        "taking no jobs until it is topped up (`needle-net stake`, or a "
                        "restart, which stakes --stake again)", _eth(stake),
                        _eth(self._min_stake))
        self._stake_wei = stake
        self.metrics.stake.set(stake)

    def _take_candidates(self) -> None:
        """Start work on acceptable open jobs: small ones as one batch, large ones claimed."""
        small: list[Job] = []
        batch_gas = FINALIZE_JOBS_GAS  # the batch's finalizeJobs must fit in a block
        ranked = self._ranking()
        in_hand, rates = self._work_in_hand(), self._rates()
        now, self._next_turn = time.monotonic(), None
        for job_id in list(self._candidates):
            busy = self._tasks + bool(small) >= self.config.max_in_flight
            if busy or self._stop.is_set() or not self._may_claim():
                break
            turn = self._seen.get(job_id, 0.0) + PEER_GRACE_SECONDS * ranked(job_id)
            if now < turn:  # a peer ranked before this worker may still take it
                self._next_turn = min(turn, self._next_turn or turn)
                continue
            job = self._candidates.get(job_id) or self.chain.job(job_id)  # kept if this fails
            self._candidates.pop(job_id, None)
            self._seen.pop(job_id, None)
            if job.status != JOB_OPEN or not self._acceptable(job):
                continue
            if self._is_small(job):
                gas = finalize_gas(job)
                if small and batch_gas + gas > BATCH_FINALIZE_GAS:  # for the next batch
                    self._candidates[job_id] = job
                    break
                small.append(job)
                batch_gas += gas
                if len(small) == self.config.max_batch_jobs:
                    break  # one batch per block: the rest stays for other workers and later
            elif job.timeout_blocks < self.config.min_deadline_blocks:
                log.info("job %d not claimed: its deadline, %d blocks after a claim, is below "
                         "--min-deadline %d", job_id, job.timeout_blocks,
                         self.config.min_deadline_blocks)
            elif self._in_time(job, in_hand, *rates):
                self._claim(job)
                in_hand += self._work(job.batch, job.m, job.k, job.n)
            else:  # open for other workers; looked at again as the pace and the work change
                self._candidates[job_id] = job
        if small:
            self._start_batch(small)

    def _may_claim(self) -> bool:
        """Whether the chain takes this worker's claims: no withdrawal requested, the stake
        at the market's minimum. While it does not, open jobs stay candidates, taken once
        it does again (a stake cut short by slashes and topped up): skipped then, they were
        forgotten, their JobSubmitted behind the scan, and stayed open."""
        return not self._withdrawing and self._stake_wei >= self._min_stake

    def _work_in_hand(self) -> float:
        """Work (_work) of the jobs this worker took and has not yet computed: they share its
        device with a job it claims now."""
        with self._lock:
            return sum(self._work(r.batch, r.m, r.k, r.n) for r in self.jobs
                       if r.stage in ("fetching", "claimed", "computing"))

    def _work(self, batch: int, m: int, k: int, n: int) -> float:
        """A job's work for the deadline estimate, in FLOPs: its products' FLOPs and each
        product's fixed cost (a batch of 300,000 products of 8 x 8 matrices ran 100 times
        slower than its FLOPs at the probe's rate, and its claims expired)."""
        return _flops(batch, m, k, n) + batch * self._product_flops

    def _rates(self) -> tuple[float, float, float]:
        """(FLOP/s, bytes/s of transfers, seconds per block) for `_in_time`, the slowest
        device and link and the fastest chain seen lately."""
        now = time.monotonic()
        return (self._compute_rate.lowest(now), self._transfer_rate.lowest(now),
                self._pace.interval(now))

    def _in_time(self, job: Job, in_hand: float, flops_per_second: float,
                 bytes_per_second: float, block_seconds: float) -> bool:
        """Whether `job`'s deadline gives DEADLINE_MARGIN times the seconds this worker needs
        after claiming it (`in_hand`: the work of its jobs not computed yet; the rates:
        `_rates`). A claim it cannot commit in time expires, and anyone reopening it cuts
        10 % of the stake; a job passed over is logged once."""
        c_bytes = (8 if job.precision == 0 else 4) * job.batch * job.m * job.n
        needed = seconds_needed(in_hand + self._work(job.batch, job.m, job.k, job.n), c_bytes,
                                flops_per_second, bytes_per_second)
        given = seconds_given(job.timeout_blocks, block_seconds)
        if given >= DEADLINE_MARGIN * needed:
            self._passed_over.discard(job.job_id)
            return True
        if job.job_id not in self._passed_over:
            self._passed_over.add(job.job_id)
            log.info("job %d not claimed: it would take this worker about %.2f s after a "
                     "claim, and its deadline, %d blocks, gives about %.2f s at %.3f s per "
                     "block (the shortest lately); it claims with %gx that margin",
                     job.job_id, needed, job.timeout_blocks, given, block_seconds,
                     DEADLINE_MARGIN)
        return False

    def _ranking(self):
        """job id -> this worker's rank for the job among the workers that claimed lately.
        Each job gets its own order of those workers (by keccak(jobId, address)); the first
        takes it at once, the r-th only once it stayed open r * PEER_GRACE_SECONDS. So
        workers rarely do a job twice, and a ranked peer that is gone or busy delays a job
        by a moment, not more."""
        peers = [a for a, block in self._peers.items()
                 if self._head - block <= PEER_ACTIVE_BLOCKS]
        return lambda job_id: rank(job_id, self.address, peers)

    def _is_small(self, job: Job) -> bool:
        """Worth computing before claiming: fast enough that a lost race wastes little."""
        flops = _flops(job.batch, job.m, job.k, job.n)
        return flops <= self.config.direct_commit_flops and not self.config.stall_after_claim

    def _acceptable(self, job: Job) -> bool:
        flops = _flops(job.batch, job.m, job.k, job.n)
        operand_bytes = 8 * job.batch * (job.m * job.k + job.k * job.n + job.m * job.n)
        return (
            job.fee_wei >= self.config.min_fee_wei
            and flops <= self.config.max_flops
            and operand_bytes <= self.config.max_operand_bytes
            and job.precision in PRECISIONS
        )

    def _claim(self, job: Job) -> None:
        """Start fetching and claiming on the pool (the record counts as in flight from now
        on)."""
        record = JobRecord(job.job_id, job.batch, job.m, job.k, job.n, job.fee_wei, "fetching")
        with self._lock:
            self.jobs.append(record)
            self._tasks += 1
        self.metrics.in_flight.inc()
        self._pool.submit(self._process, record, job, "claim")

    def _start_batch(self, jobs: list[Job]) -> None:
        records = [JobRecord(j.job_id, j.batch, j.m, j.k, j.n, j.fee_wei, "computing")
                   for j in jobs]
        with self._lock:
            self.jobs.extend(records)
            self._tasks += 1
        self.metrics.in_flight.inc(len(records))
        self._pool.submit(self._process_batch, records, jobs)

    def _try_claim(self, record: JobRecord, job: Job) -> int | None:
        """Claim the job: the claim's deadline (the last block its commit may land in); None
        if another worker has it. A revert may also mean that an earlier send of this claim,
        whose answer a network error lost, was mined before its retry: the job is then this
        worker's, and dropping it would let it expire (a 10 % stake cut). None unsent if the
        stake's withdrawal was requested since the job was taken (`_left_for_withdrawal`)."""
        if self._left_for_withdrawal([record]):
            return None
        try:
            receipt = self._retry(self.chain.send_with_gas, CLAIM_GAS, "claimJob",
                                  record.job_id)
            deadline = self.chain.events_in(receipt, "JobClaimed")[0]["deadline"]
        except TxReverted as err:
            job = self._retry(self.chain.job, record.job_id)
            if job.worker != self.address or job.status != JOB_CLAIMED:
                log.info("claim of job %d lost: %s", record.job_id, err)
                self._drop([record])
                if job.status == JOB_OPEN:
                    self._keep_refused(job)
                return None
            log.info("job %d: claimed by an earlier send of this claim", record.job_id)
            deadline = job.deadline
        except Exception as err:
            if not is_transient(err):
                raise
            deadline = self._claim_outcome(record, job, err)
            if deadline is None:
                return None
        self._set_stage(record, "claimed")
        self.metrics.jobs.labels("claimed").inc()
        return deadline

    def _claim_outcome(self, record: JobRecord, job: Job, err: Exception) -> int | None:
        """The claim's deadline if a claim whose sends all failed on the network landed
        after all; else None, the job dropped (open: a candidate again). The chain is asked
        for as long as such a claim could still stand: given up sooner, a claim that had
        landed expired unseen (a 10 % stake cut)."""
        log.warning("job %d: the claim's answer was lost (%s); asking the chain node whose "
                    "the job is", record.job_id, err)
        now = self._retry_held(self._head + job.timeout_blocks, self.chain.job, record.job_id)
        if now.worker == self.address and now.status == JOB_CLAIMED:
            log.info("job %d: claimed by a send whose answer was lost", record.job_id)
            return now.deadline
        self._drop([record])
        if now.status == JOB_OPEN:
            self._watch({now.job_id: now})
        return None

    def _keep_refused(self, job: Job) -> None:
        """A claim the chain refused while the job stayed open: a slash cut the stake below
        the minimum since the last refresh (once a second). The stake is read now, so no
        other claim is wasted on the stale view, and the job stays a candidate, taken once
        the stake is topped up (dropped, it was forgotten)."""
        self._note_stake(self._retry(self.chain.worker_info, self.address)[0])
        self._watch({job.job_id: job})

    def _drop(self, records: list[JobRecord]) -> None:
        """Take jobs that never became this worker's out of its books."""
        dropped = {id(r) for r in records}
        with self._lock:
            self.jobs = [r for r in self.jobs if id(r) not in dropped]

    def _left_for_withdrawal(self, records: list[JobRecord]) -> bool:
        """Whether the stake's withdrawal was requested since these jobs, not claimed yet,
        were taken: the chain refuses claims and commitJobs from then on, so sending one
        only paid for its revert. They are dropped, open for other workers, as a claim
        another worker won."""
        if not self._withdrawing:
            return False
        log.info("job(s) %s left open: the stake's withdrawal was requested",
                 ", ".join(str(r.job_id) for r in records))
        self._drop(records)
        return True

    def _process(self, record: JobRecord, job: Job, start: str) -> None:
        """Take a job from `start` (claim, compute or finalize) to its verdict. Operands are
        fetched and checked before the claim, so a job whose operands do not match its
        declaration is skipped before any transaction: once claimed, it could only be
        committed and finalised for gas and then cancelled by the chain, or left to expire
        with a 10 % stake cut."""
        try:
            if start in ("claim", "compute"):
                operands = self._fetch_operands(record, job)
                if operands is None:
                    return
                c = None
                if start == "claim" and compute.may_overflow(*operands, job.precision == 0):
                    # a product that may overflow float32 is computed before the claim: a C
                    # holding Inf is slashed, so such a job must be skipped, not claimed
                    c = self._compute(record, job, *operands)
                    if c is None:
                        return
                if start == "claim":
                    deadline = self._try_claim(record, job)
                    if deadline is None:
                        return
                    job = replace(job, worker=self.address, status=JOB_CLAIMED,
                                  deadline=deadline)
                job = self._compute_and_commit(record, job, *operands, c)
            self._finalize(record, job)
        except TxReverted as err:
            log.warning("job %d: transaction reverted: %s", record.job_id, err)
            self._set_stage(record, "lost", str(err))
            self.metrics.jobs.labels("lost").inc()
        except ClaimExpired as err:
            log.warning("job %d: %s", record.job_id, err)
            self._set_stage(record, "expired", str(err))
            self.metrics.jobs.labels("expired").inc()
        except StoppedHolding as err:  # saved in flight when the run ends
            log.info("job %d left for a restart to resume: %s", record.job_id, err)
        except Exception as err:  # noqa: BLE001 - one bad job must not kill the node
            if start == "claim" and record.stage == "fetching" and is_transient(err):
                # no claim went out (_try_claim settles its own): the job is still open, and
                # booked as an error it was never taken again
                log.warning("job %d: chain node or blob store unreachable before the claim "
                            "(%s); left open, to be taken again", record.job_id, err)
                self._drop([record])
                self._watch({job.job_id: None})
                return
            log.exception("job %d failed", record.job_id)
            self._set_stage(record, "error", f"{type(err).__name__}: {err}")
            self.metrics.jobs.labels("error").inc()
        finally:
            self._done(record)
            with self._lock:
                self._tasks -= 1

    def _done(self, record: JobRecord) -> None:
        self.metrics.in_flight.dec()
        if record.stage in FINISHED:
            self.metrics.stage_latency.labels("total").observe(record.seconds)

    def _process_batch(self, records: list[JobRecord], jobs: list[Job]) -> None:
        """Small jobs: compute each, then claim and commit them all in one transaction
        (jobs another worker took first are skipped) and finalise them in one more. Which
        jobs are this worker's is read from the chain where a receipt does not say (a send
        whose answer was lost may have landed), and after a failure once the commit may have
        gone out: such jobs are finalised and booked, not left unpaid as errors."""
        since, posted = self._head, False
        ready: list[tuple[JobRecord, Job]] = []
        try:
            results = []
            # several jobs' transfers overlap on the blob pool; a lone job stays on this thread
            outcomes = map(self._try_compute, jobs) if len(jobs) == 1 else \
                self._blob_pool.map(self._try_compute, jobs)
            for record, job, (c, err) in zip(records, jobs, outcomes, strict=True):
                if err is None:
                    results.append(c)
                    ready.append((record, job))
                else:  # not committed: skipped, nothing lost
                    self._skip(record, err)
            if not ready or self._left_for_withdrawal([r for r, _ in ready]):
                return
            mark("worker computed")
            ids = [j.job_id for _, j in ready]
            # the records on disk before the commit goes out: its verdicts come back with it,
            # and a crash before their save left no trace of the jobs (no claim in flight for
            # a restart to look for), paid but missing from the books
            self._save_state()
            posted = True  # from here on, the commit may be on the chain whatever we hear
            commit = self._upload_and_commit(ids, results)
            t0 = time.perf_counter()
            # finalizeJobs right behind it: the node seals a lone transaction at once, so
            # this one lands in the next block, the first where finalising is allowed (in
            # the same block it would skip the jobs, and _finalize_all sends it again)
            gas = FINALIZE_JOBS_GAS + sum(finalize_gas(j) for _, j in ready)
            # sent with one long poll for both receipts, answered with the finalisation's
            # block: the node then answers two requests fewer per block while the next
            # block seals (a retry sends the same transaction: never a second finalisation);
            # the commit lands after block `since`, so its finalisation counts until at least
            # since + BLOCKHASH_WINDOW
            receipt, finalized = self._send_with_commit(since + BLOCKHASH_WINDOW, commit, ids,
                                                        gas)
            mark("worker receipts")
            self.metrics.stage_latency.labels("commit").observe(time.perf_counter() - t0)
            ours = {e["jobId"] for e in self.chain.events_in(receipt, "ResultCommitted")
                    if e["worker"] == self.address}
            # a commit resent after its answer was lost finds the jobs taken by its first send
            ours |= {j.job_id for _, j in ready
                     if j.job_id not in ours and self._mine_on_chain(j.job_id, since)}
            batch = {id(r) for r in records}
            with self._lock:  # a job another worker committed first was never ours
                self.jobs = [r for r in self.jobs if id(r) not in batch
                             or r.job_id in ours or r.stage in FINISHED]
            committed = [(r, j) for r, j in ready if j.job_id in ours]
            for record, _ in committed:
                record.stage = "committed"
            self.metrics.jobs.labels("claimed").inc(len(committed))  # one transaction did both
            self.metrics.jobs.labels("committed").inc(len(committed))
            if committed:
                self._finalize_all(committed, receipt["blockNumber"], finalized, t0)
        except StoppedHolding as err:  # saved in flight when the run ends
            log.info("batch of %d jobs left for a restart to settle: %s", len(records), err)
        except Exception as err:  # noqa: BLE001 - one bad batch must not kill the node
            if isinstance(err, TxReverted):
                log.warning("batch commit reverted: %s", err)
                outcome, detail = "lost", str(err)
            else:
                log.exception("batch of %d jobs failed", len(records))
                outcome, detail = "error", f"{type(err).__name__}: {err}"
            if posted:
                self._settle_batch(ready, since)
            for record in records:
                if record.stage not in FINISHED and self._holds(record):
                    self._set_stage(record, outcome, detail)
                    self.metrics.jobs.labels(outcome).inc()
        finally:
            for record in records:
                self._done(record)
            with self._lock:
                self._tasks -= 1

    def _send_with_commit(self, last_block: int, commit, job_ids: list[int], gas: int
                          ) -> list:
        """finalizeJobs of `job_ids` sent behind the posted `commit`: both receipts
        (`send_signed_after`, retried while the jobs are held). Signed once more with the
        node's next nonce where the one it got was taken: its send failed (the chain node
        killed), the nonce was given back, and another transaction of this key used it; the
        resend, refused "nonce too low", failed the batch with a traceback."""
        try:
            return self._retry_held(last_block, self.chain.send_signed_after, [commit],
                                    self.chain.sign_with_gas(gas, "finalizeJobs", job_ids))
        except Exception as err:
            if not _nonce_taken(err):
                raise
        return self._retry_held(last_block, self.chain.send_signed_after, [commit],
                                self.chain.sign_with_gas(gas, "finalizeJobs", job_ids))

    def _holds(self, record: JobRecord) -> bool:
        """Whether `record` is still among this node's jobs (a job another worker committed
        first is dropped: it was never ours)."""
        with self._lock:
            return any(r is record for r in self.jobs)

    def _committed_by_me(self, job: Job) -> bool:
        """The chain names this worker as the job's committer (or as its paid worker)."""
        return job.worker == self.address and job.status in (JOB_COMMITTED, JOB_DONE)

    def _mine_on_chain(self, job_id: int, since: int) -> bool:
        """Whether this worker committed `job_id` although no receipt it holds says so: the
        chain names it, or a commit of its own failed after block `since` (the head when the
        batch began: an earlier attempt's failure, which reopened the job, is not this one)."""
        job = self._retry(self.chain.job, job_id)
        if self._committed_by_me(job):
            return True
        return job.status == JOB_OPEN and \
            self._retry(self.chain.verdict, job_id, self.address, since + 1) is not None

    def _settle_batch(self, ready: list[tuple[JobRecord, Job]], since: int) -> None:
        """After a batch failed once its commit may have been sent: finalise and book the
        jobs the chain says are this worker's, so none is left unfinalised (its fee never
        collected) or booked as an error while it was paid."""
        for record, job in ready:
            if record.stage in FINISHED or not self._holds(record):
                continue
            try:
                if not self._mine_on_chain(job.job_id, since):
                    continue
                if record.stage != "committed":
                    record.stage = "committed"
                    self.metrics.jobs.labels("claimed").inc()  # by the batch's commitJobs
                    self.metrics.jobs.labels("committed").inc()
                log.info("job %d: committed although the batch failed; finalising",
                         job.job_id)
                self._finalize(record, job)
            except Exception:  # noqa: BLE001 - still unreachable: booked as the batch failed
                log.exception("job %d: could not settle after the batch failed", job.job_id)

    def _upload_and_commit(self, job_ids: list[int], results: list[np.ndarray]):
        """Upload the Cs (batched: one group commit), then send commitJobs; posted for
        `confirm`. Small results are hashed here and the commit is signed on the blob pool
        while they upload; it is sent only once the store has acknowledged them (a commit
        whose C is missing would be slashed at finalisation)."""
        gas = commit_jobs_gas(len(job_ids))
        t0 = time.perf_counter()
        if sum(c.nbytes for c in results) > PRESIGN_BYTES:
            c_ids = self._retry(self.chain.put_arrays, results)
            mark("worker uploaded")
            self.metrics.stage_latency.labels("upload").observe(time.perf_counter() - t0)
            return self._post_commit(gas, job_ids, c_ids)
        c_ids, signing = self.chain.put_arrays_signing(
            results, lambda ids: self.chain.sign_with_gas(gas, "commitJobs", job_ids, ids),
            self._blob_pool, put=lambda arrays: self._retry(self.chain.put_arrays, arrays))
        mark("worker uploaded")
        self.metrics.stage_latency.labels("upload").observe(time.perf_counter() - t0)
        try:
            return self.chain.post_signed(signing.result())
        except Exception as err:  # the nonce is forgotten: signed afresh if worth retrying
            if not (is_transient(err) or _nonce_taken(err)):
                raise
            return self._post_commit(gas, job_ids, c_ids)

    def _post_commit(self, gas: int, job_ids: list[int], c_ids: list[bytes]):
        """commitJobs signed now and posted (retried on network errors). Signed once more
        with the node's next nonce if another client with this key took the one it got, as
        every transaction sent and waited for is (`ChainClient.send`): the node refused the
        batch's commit, which is only posted, and the batch failed."""
        try:
            return self._retry(self.chain.post_with_gas, gas, "commitJobs", job_ids, c_ids)
        except Exception as err:
            if not _nonce_taken(err):
                raise
        return self._retry(self.chain.post_with_gas, gas, "commitJobs", job_ids, c_ids)

    def _skip(self, record: JobRecord, err: Exception) -> None:
        """Give up a job before any transaction for it: "skipped" if its operands do not
        match its declaration (the submitter's mistake), else "error"."""
        log.warning("job %d skipped: %s", record.job_id, err)
        if isinstance(err, compute.OperandError):
            self._set_stage(record, "skipped", f"operands do not match the job: {err}")
            self.metrics.jobs.labels("skipped").inc()
        else:
            self._set_stage(record, "error", f"{type(err).__name__}: {err}")
            self.metrics.jobs.labels("error").inc()

    def _operands(self, job: Job) -> tuple[np.ndarray, np.ndarray]:
        """A and B from the blob store; OperandError unless they are what the job declares
        (shapes, dtype for its precision class, finite floats): the chain cancels a job
        whose operands are not, so computing and committing it would earn nothing."""
        a = self._retry_for(job, self.chain.get_array, job.a_id)
        b = self._retry_for(job, self.chain.get_array, job.b_id)
        compute.check_operands(a, b, (job.batch, job.m, job.k, job.n), job.precision == 0)
        return a, b

    def _fetch_operands(self, record: JobRecord,
                        job: Job) -> tuple[np.ndarray, np.ndarray] | None:
        """`_operands`, timed; None if the job was skipped for them."""
        t0 = time.perf_counter()
        try:
            operands = self._operands(job)
        except compute.OperandError as err:
            self._skip(record, err)
            return None
        seconds = time.perf_counter() - t0
        self.metrics.stage_latency.labels("fetch").observe(seconds)
        self._note_transfer(operands[0].nbytes + operands[1].nbytes, seconds)
        return operands

    def _note_transfer(self, nbytes: int, seconds: float) -> None:
        """Time a transfer for the deadline estimate (`_in_time`), if large enough to."""
        if nbytes >= MIN_SAMPLE_BYTES and seconds > 0:
            self._transfer_rate.add(nbytes / seconds, time.monotonic())

    def _try_compute(self, job: Job) -> tuple[np.ndarray | None, Exception | None]:
        """Fetch and check A and B and compute C: (C, None), or (None, the error)."""
        try:
            mark(f"worker fetching job {job.job_id}")
            t0 = time.perf_counter()
            a, b = self._operands(job)
            mark("worker fetched")
            t1 = time.perf_counter()
            self.metrics.stage_latency.labels("fetch").observe(t1 - t0)
            c = compute.matmul(a, b, self.device)
            self.metrics.stage_latency.labels("compute").observe(time.perf_counter() - t1)
            compute.check_result(c, job.precision == 0)
            if self.config.corrupt_results:
                c = compute.corrupt(c, self._rng)
            return c, None
        except Exception as err:  # noqa: BLE001 - reported per job by the caller
            return None, err

    def _finalize_all(self, committed: list[tuple[JobRecord, Job]], commit_block: int,
                      finalized, t0: float) -> None:
        """Verdicts from the receipt of the finalizeJobs sent with the commit (`finalized`);
        jobs it skipped (it landed in the commit's block) are finalised once more; jobs
        someone else finalised are looked up on the chain. The finalize latency counts from
        the commit's sending (`t0`): both are confirmed together."""
        verdicts = self.chain.verdicts_in(finalized)
        again = [(r, j) for r, j in committed if j.job_id not in verdicts]
        last_block = commit_block + BLOCKHASH_WINDOW
        if again:
            gas = FINALIZE_JOBS_GAS + sum(finalize_gas(j) for _, j in again)
            receipt = self._retry_held(last_block, self.chain.send_with_gas, gas,
                                       "finalizeJobs", [j.job_id for _, j in again])
            verdicts.update(self.chain.verdicts_in(receipt))
        self.metrics.stage_latency.labels("finalize").observe(time.perf_counter() - t0)
        for record, job in committed:
            verdict = verdicts.get(job.job_id) or self._retry_held(
                last_block, self.chain.verdict, job.job_id, self.address, commit_block)
            self._record_verdict(record, verdict, save=False)
        self._save_state()

    def _product(self, job: Job, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """C, timed; OperandError if it holds NaN or Inf (a float product that overflowed)."""
        t0 = time.perf_counter()
        c = compute.matmul(a, b, self.device)
        seconds = time.perf_counter() - t0
        self.metrics.stage_latency.labels("compute").observe(seconds)
        flops = _flops(job.batch, job.m, job.k, job.n)
        if flops >= MIN_SAMPLE_FLOPS and seconds > 0:  # for the deadline estimate
            self._compute_rate.add(self._work(job.batch, job.m, job.k, job.n) / seconds,
                                   time.monotonic())
        compute.check_result(c, job.precision == 0)
        return c

    def _compute(self, record: JobRecord, job: Job, a: np.ndarray,
                 b: np.ndarray) -> np.ndarray | None:
        """C before any transaction for the job; None if the job was skipped for it (a
        float product that overflows)."""
        try:
            return self._product(job, a, b)
        except compute.OperandError as err:
            self._skip(record, err)
            return None

    def _compute_and_commit(self, record: JobRecord, job: Job, a: np.ndarray,
                            b: np.ndarray, c: np.ndarray | None = None) -> Job:
        """Compute C (unless given, computed before the claim), upload it and commit it:
        the job as committed. A C holding Inf or NaN is never committed: the chain would
        slash it."""
        if self.config.stall_after_claim:
            self._stop.wait(self.config.stall_after_claim)
        self._set_stage(record, "computing")
        if c is None:  # else computed (and timed) before the claim
            c = self._product(job, a, b)
        if self.config.corrupt_results:
            c = compute.corrupt(c, self._rng)
        if job.deadline and self._head >= job.deadline:  # the head the job loop saw last
            # the commit would land after the deadline and revert: gas for nothing, and its
            # calldata would give C's id to anyone (the submitter could fetch C, then cancel)
            raise ClaimExpired(f"the claim's deadline, block {job.deadline}, passed (head "
                               f"{self._head}) before C was ready: not committed")
        t2 = time.perf_counter()
        c_id = self._retry_for(job, self.chain.put_array, c)
        t3 = time.perf_counter()
        self.metrics.stage_latency.labels("upload").observe(t3 - t2)
        self._note_transfer(c.nbytes, t3 - t2)
        try:
            receipt = self._retry_for(job, self.chain.send_with_gas, COMMIT_GAS,
                                      "commitResult", job.job_id, c_id)
            committed = replace(job, status=JOB_COMMITTED, commit_block=receipt["blockNumber"])
        except Exception as err:  # an earlier send, whose answer was lost, may have landed
            if not (isinstance(err, TxReverted) or is_transient(err)):
                raise
            committed = self._own_commit(job)
            if committed is None and isinstance(err, TxReverted):
                raise
            if committed is None:  # retried until the job loop saw the deadline pass
                raise ClaimExpired(f"the claim's deadline, block {job.deadline}, passed while "
                                   f"the chain node was unreachable ({err}): not committed"
                                   ) from err
            log.info("job %d: committed by an earlier send of this commit", job.job_id)
        self.metrics.stage_latency.labels("commit").observe(time.perf_counter() - t3)
        self.metrics.jobs.labels("committed").inc()
        self._set_stage(record, "committed")
        return committed

    def _own_commit(self, job: Job) -> Job | None:
        """The claimed `job` as the chain has it if a commit of this worker's landed, else
        None. Asked once a commit failed, perhaps past the deadline: an unreachable node is
        waited for as long as such a commit could be finalised (given up at once, the job
        was booked "error", with a traceback, rather than lost or expired)."""
        current = self._retry_held(job.deadline + BLOCKHASH_WINDOW, self.chain.job,
                                   job.job_id)
        return current if self._committed_by_me(current) else None

    def _finalize(self, record: JobRecord, job: Job) -> None:
        """Finalise `job` (as committed; someone else may beat us to it) and record the
        verdict."""
        t0 = time.perf_counter()
        deadline = time.time() + self.config.finalize_timeout
        verdict, commit_block = None, 0
        while time.time() < deadline:
            current = self._retry_for(job, self.chain.job, job.job_id)
            commit_block = current.commit_block or commit_block
            if current.status != JOB_COMMITTED or current.worker != self.address:
                break
            try:
                # Fixed gas, no estimate: sent right after the commit, the transaction lands
                # in the next block, the first one where finalising is allowed.
                receipt = self._retry_for(job, self.chain.send_with_gas, finalize_gas(job),
                                          "finalize", job.job_id)
                verdict = self.chain.verdicts_in(receipt).get(job.job_id)
                break
            except TxReverted:
                self.chain.wait_for_block(self.chain.block_number() + 1, 1.0)
        self.metrics.stage_latency.labels("finalize").observe(time.perf_counter() - t0)
        if verdict is None:  # finalised by someone else, or not at all
            verdict = self._retry_for(job, self.chain.verdict, job.job_id, self.address,
                                      commit_block)
        self._record_verdict(record, verdict)

    def _record_verdict(self, record: JobRecord, verdict: Verdict | None,
                        save: bool = True) -> None:
        if verdict is None:
            self._set_stage(record, "lost", "not finalised in time", save)
            self.metrics.jobs.labels("lost").inc()
        elif verdict.passed:
            self._set_stage(record, "verified", save=save)
            self.metrics.jobs.labels("verified").inc()
            self.metrics.verifications.labels("pass").inc()
            self.metrics.flops.inc(verdict.flops)
            self.metrics.earned.inc(verdict.fee_wei)
        elif verdict.cancelled:
            self._set_stage(record, "lost", "operands rejected: fee refunded to the submitter",
                            save)
            self.metrics.jobs.labels("lost").inc()
        else:
            self._set_stage(record, "failed", f"slashed {verdict.slashed_wei} wei", save)
            self.metrics.jobs.labels("failed").inc()
            self.metrics.verifications.labels("fail").inc()

    # -- HTTP API ---------------------------------------------------------------------------

    def _bind_api(self) -> socket.socket | None:
        """The API's listening socket, bound at start: a port in use is a WorkerStartError,
        not a worker that runs on without its API (uvicorn only logs a failed bind)."""
        if self.config.api_port is None:
            return None
        host, port = self.config.api_host, self.config.api_port
        try:
            return listen(host, port)
        except OSError as err:
            raise WorkerStartError(f"cannot serve the API on {host}:{port}: {err.strerror}"
                                   ) from err

    def _start_api(self) -> None:
        if self._api_socket is None:
            return
        import uvicorn

        from node.api import create_app

        app = create_app(self, self.config.admin_token, self.config.api_allowed_hosts)
        config = uvicorn.Config(app, host=self.config.api_host, port=self.config.api_port,
                                log_level="warning", http=BoundedHttpProtocol)
        self._api_server = uvicorn.Server(config)
        self._api_thread = threading.Thread(target=self._api_server.run, name="api", daemon=True,
                                            kwargs={"sockets": [self._api_socket]})
        self._api_thread.start()

    def _stop_api(self) -> None:
        if self._api_server is not None:
            self._api_server.should_exit = True  # uvicorn finishes responses in progress first
            self._api_thread.join(API_SHUTDOWN_SECONDS)
