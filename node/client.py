"""Job submission: the client side of a remote matmul, used by `needle.remote.Network` and
the `needle-net submit` command.

    upload A, B -> submitJob(s) -> wait: claimed -> committed -> finalised (verified, paid)
    -> fetch C (hash checked) -> optional local Freivalds check -> C

While waiting the client keeps the job moving on its own: it reopens a claim whose
deadline passed (a dead or stalled worker) and finalises a commit nobody finalised.
Every failure is a RemoteJobError that names the stage it happened in.
"""

from __future__ import annotations

import numbers
import shlex
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field

import numpy as np
from eth_account import Account
from eth_utils import keccak
from web3.exceptions import Web3RPCError

from chain.blobhttp import BlobPortUnreachable
from chain.blobs import encode_header
from chain.client import nonce_taken
from chain.params import GENESIS_GAS_LIMIT
from chain.timeline import mark
from node.compute import may_overflow
from node.market import (
    DIRECT_COMMIT_FLOPS,
    MIN_DEADLINE_BLOCKS,
    PRESIGN_BYTES,
    UPLOAD_THREADS,
    Market,
    TxReverted,
    finalize_gas_for,
    is_transient,
    node_refusal,
    submit_jobs_gas,
)

STAGES = ("submitted", "claimed", "committed", "verified", "paid")
DEFAULT_FEE_WEI = 10**15
FINALIZE_PATIENCE_BLOCKS = 4  # the worker finalises itself; step in only if it does not
EXACT_DTYPES = (np.int8, np.int16, np.int32, np.int64)
PRECISION_CODES = {"exact": 0, "fp32": 1, "tf32": 2, "bf16": 3}
MIB = 1 << 20
MAX_BATCH_JOBS = 256  # ComputeMarket.MAX_BATCH_JOBS: the jobs one submitJobs opens
MAX_TIMEOUT_BLOCKS = 100_000  # ComputeMarket.MAX_TIMEOUT_BLOCKS
SUBMIT_SENDS = 5  # sends of one submission whose answers are lost, at most


class RemoteJobError(RuntimeError):
    """A remote matmul that failed; `stage` says where: validate, upload, submit, then the
    stage a job was in when it failed or timed out (submitted, claimed, committed), finalize,
    fetch, check. `results` holds, by job id, the verified Cs of the jobs of its batch that
    finished before it failed: they are paid for, and not lost with the error."""

    def __init__(self, stage: str, message: str, job_id: int | None = None,
                 results: dict[int, np.ndarray] | None = None) -> None:
        where = f"job {job_id}, " if job_id is not None else ""
        super().__init__(f"[{where}stage {stage}] {message}")
        self.stage = stage
        self.job_id = job_id
        self.message = message
        self.results = results or {}


def validate_operands(a: np.ndarray, b: np.ndarray, max_bytes: int) -> tuple[int, int, int, int]:
    """(batch, m, k, n) of a valid job; ValueError naming what is wrong otherwise."""
    if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
        raise ValueError(f"operands must be numpy arrays, got {type(a).__name__} and "
                         f"{type(b).__name__}")
    if a.dtype != b.dtype:
        raise ValueError(f"operand dtypes differ: A is {a.dtype}, B is {b.dtype}")
    if a.dtype != np.float32 and not any(a.dtype == t for t in EXACT_DTYPES):  # longlong too
        raise ValueError(f"unsupported dtype {a.dtype}: use float32 for float jobs, or int8, "
                         "int16, int32 or int64 for exact jobs")
    if a.ndim not in (2, 3) or b.ndim not in (2, a.ndim):
        raise ValueError(f"operands must be 2-D, or 3-D (batched) A with 3-D or shared 2-D B, "
                         f"got shapes {a.shape} and {b.shape}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"shape mismatch: A {a.shape} @ B {b.shape} (inner dims "
                         f"{a.shape[-1]} != {b.shape[-2]})")
    if b.ndim == 3 and a.shape[0] != b.shape[0]:
        raise ValueError(f"batch sizes differ: A {a.shape}, B {b.shape}")
    if 0 in a.shape or 0 in b.shape:
        raise ValueError(f"empty operand: A {a.shape}, B {b.shape}")
    batch = a.shape[0] if a.ndim == 3 else 1
    # C as a worker uploads it (float32, or int64 for exact jobs); no memory is touched
    c = np.broadcast_to(np.zeros((), np.float32 if a.dtype == np.float32 else np.int64),
                        (*a.shape[:-1], b.shape[-1]))
    for name, x in (("A", a), ("B", b), ("C", c)):
        size = len(encode_header(x)) + x.nbytes
        if size > max_bytes:
            raise ValueError(f"{name} is a blob of {size} bytes ({size / MIB:.1f} MiB), over the "
                             f"node's {max_bytes}-byte ({max_bytes / MIB:g} MiB) blob limit")
        if x is not c and x.dtype == np.float32 and not np.isfinite(x).all():
            raise ValueError(f"{name} contains NaN or infinity")
    if a.dtype != np.float32:
        _check_exact_range(a, b)
    else:
        from verifier.floating import MAX_INNER

        if a.shape[-1] >= MAX_INNER:  # the chain would cancel the job at finalisation
            raise ValueError(f"inner dimension k = {a.shape[-1]} is too large for a float32 "
                             f"job: the verifier bounds rounding errors only for k < "
                             f"{MAX_INNER}; split the product along k")
    dims = batch, a.shape[-2], a.shape[-1], b.shape[-1]
    gas = finalize_gas_for(*dims, a.dtype != np.float32)
    if gas > GENESIS_GAS_LIMIT:  # possible only where a node allows blobs above 256 MiB
        raise ValueError(f"A {a.shape} @ B {b.shape} would need {gas} gas to be verified, above "
                         f"the block gas limit {GENESIS_GAS_LIMIT}: no worker could be paid "
                         "for it; split the product")
    return dims


def _check_exact_range(a: np.ndarray, b: np.ndarray) -> None:
    """An exact job is checkable (by this client and the chain) only while C is determined
    mod p: 2 * k * max|A| * max|B| < p = 2^61 - 1, as `verifier` requires. Checked here,
    before a fee is spent on a job no verifier can accept."""
    from verifier import P
    from verifier.exact import operand_bounds

    bound_a, bound_b = operand_bounds(a, b)
    bound = a.shape[-1] * bound_a * bound_b
    if 2 * bound >= P:
        raise ValueError(f"exact job out of range: k * max|A| * max|B| = {bound}, not below "
                         f"(2^61 - 1) / 2, the bound the verifier needs")


def _checked_fee(fee_wei, timeout: float, timeout_blocks: int) -> int:
    """The fee as an int of wei, once the job settings are checked, before anything is
    connected or paid: a float fee (1e15, as people write it) used to fail only at signing,
    as "ABI Not Found", a NaN timeout never passed, and a claim deadline the contract refuses
    reverted the submission on chain, for gas."""
    if isinstance(fee_wei, float) and fee_wei.is_integer():
        fee_wei = int(fee_wei)
    if not isinstance(fee_wei, numbers.Integral) or isinstance(fee_wei, bool) or fee_wei < 0:
        raise ValueError(f"fee_wei must be a whole number of wei, 0 or more (10**15 wei is "
                         f"0.001 ETH), got {fee_wei!r}")
    if not isinstance(timeout, numbers.Real) or isinstance(timeout, bool) or \
            not timeout > 0:  # NaN too
        raise ValueError(f"timeout must be a positive number of seconds (inf waits for good), "
                         f"got {timeout!r}")
    if not isinstance(timeout_blocks, numbers.Integral) or \
            not 1 <= timeout_blocks <= MAX_TIMEOUT_BLOCKS:
        raise ValueError(f"timeout_blocks (the blocks a worker has to deliver after claiming) "
                         f"must be an integer from 1 to {MAX_TIMEOUT_BLOCKS}, got "
                         f"{timeout_blocks!r}")
    return int(fee_wei)


def _native_byte_order(x):
    """`x` in the machine's byte order (a big-endian .npy file loads as >f4): the checks and
    the blob format take native arrays."""
    if isinstance(x, np.ndarray) and not x.dtype.isnative:
        return x.astype(x.dtype.newbyteorder("="))
    return x


@dataclass
class _Pending:
    job_id: int
    a: np.ndarray
    b: np.ndarray
    precision: str
    submit_block: int
    stage: str = "submitted"
    times: dict[str, float] = field(default_factory=dict)  # perf_counter when each stage began
    deadline: int = 0
    commit_block: int = 0
    c_id: bytes = b""
    # C fetched and checked as soon as it was committed (while the chain finalises it):
    # (its id, C or the RemoteJobError its fetch or check raised)
    early: tuple[bytes, np.ndarray | RemoteJobError] | None = None
    result: np.ndarray | None = None
    nudge_refused: str = ""  # why the node refused this client's latest finalize or reopen
    reopened: int = 0  # claims or commits of it that ended unfinished (JobReopened)


def default_key():
    """The first account of the local development network (public test mnemonic)."""
    from chain.devnet import dev_accounts

    return dev_accounts(1)[0]


class JobClient:
    def __init__(
        self,
        rpc_url: str,
        key=None,
        *,
        fee_wei: int | None = None,
        timeout: float = 120.0,
        timeout_blocks: int = 20,
        local_check: bool = True,
        progress: bool = False,
        max_blob_bytes: int | None = None,
        poll_interval: float = 1.0,
        output_name: str = "C.npy",
    ) -> None:
        fee_wei = _checked_fee(DEFAULT_FEE_WEI if fee_wei is None else fee_wei, timeout,
                               timeout_blocks)
        account = default_key() if key is None else key
        if not hasattr(account, "key"):
            account = Account.from_key(account)
        self.market = Market(rpc_url, account, max_blob_bytes)
        # A and B uploaded while the chain node (its blob store) restarts: a refused
        # connection is waited out until the timeout, as the submission's send is
        self.market.blobs.refused_upload_wait = timeout
        self.address = account.address
        self.fee_wei = fee_wei
        self.timeout = timeout
        self.timeout_blocks = timeout_blocks
        self.local_check = local_check
        self.progress = progress
        self.poll_interval = poll_interval
        self.output_name = output_name  # the file the fetch commands in messages write
        self.job_ids: list[int] = []  # of the latest `matmul_batch`, once opened on chain
        self._pool = ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix="fetch")

    def close(self) -> None:
        self._pool.shutdown()
        self.market.close()

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.matmul_batch([(a, b)])[0]

    def matmul_batch(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """Submit all products in one transaction and return their verified results."""
        opened: list[_Pending] = []
        self.job_ids = []
        try:
            self._submit(pairs, opened)
            self.job_ids = [p.job_id for p in opened]
            return self.wait(opened)
        except KeyboardInterrupt as err:
            # a Ctrl-C between the steps (the jobs opened, `wait` not yet following them)
            # carries no account of the jobs: they are cancelled here, as `wait` would
            if err.args or not opened:
                raise
            raise KeyboardInterrupt(f"interrupted: {self.abandon(opened)}") from None

    def submit(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[_Pending]:
        """Validate and upload the operands, then open one job per pair in one transaction."""
        opened: list[_Pending] = []
        self._submit(pairs, opened)
        return opened

    def _submit(self, pairs: list[tuple[np.ndarray, np.ndarray]], opened: list[_Pending]
                ) -> None:
        """`submit`, filling `opened` in one step once the jobs are on chain, so that a
        Ctrl-C at any later point finds them there to cancel."""
        if not pairs:
            return
        pairs = [(_native_byte_order(a), _native_byte_order(b)) for a, b in pairs]
        if len(pairs) > MAX_BATCH_JOBS:  # else uploaded, then reverted on chain for gas
            raise RemoteJobError("validate", f"{len(pairs)} products in one batch: one "
                                 f"submitJobs transaction opens at most {MAX_BATCH_JOBS} "
                                 f"jobs; submit them in batches of up to {MAX_BATCH_JOBS}")
        shapes = []
        for i, (a, b) in enumerate(pairs):
            try:
                shapes.append(validate_operands(a, b, self.market.max_blob_bytes))
            except ValueError as err:
                raise RemoteJobError("validate", f"pair {i}: {err}") from err
        start = time.perf_counter()
        mark("job start")
        precisions = ["fp32" if a.dtype == np.float32 else "exact" for a, _ in pairs]
        arrays = [x for pair in pairs for x in pair]
        signing = None
        try:
            if sum(x.nbytes for x in arrays) <= PRESIGN_BYTES:
                # small operands: the submission is signed on a pool thread while this one
                # uploads them (and waits for the store's fsync)
                flat, signing = self.market.put_arrays_signing(
                    arrays, lambda ids: self._sign_submission(ids, shapes, precisions),
                    self._pool, put=self._put_arrays)
            else:
                flat = self._put_arrays(arrays)
        except KeyboardInterrupt:
            raise KeyboardInterrupt("interrupted during the upload: no job was submitted") \
                from None
        except Exception as err:
            raise RemoteJobError("upload", f"{type(err).__name__}: {err}") from err
        uploaded = time.perf_counter()
        mark("job uploaded")
        signed = receipt = None
        try:
            signed = _presigned(signing) or self._sign_submission(flat, shapes, precisions)
            receipt = self._send_submission(
                signed, lambda: self._sign_submission(flat, shapes, precisions))
            times = {"start": start, "uploaded": uploaded, "submitted": time.perf_counter()}
            opened.extend(self._opened_by(receipt, pairs, precisions, times))
        except KeyboardInterrupt:
            if signed is None:  # its nonce (taken on a pool thread, perhaps) was never sent
                if signing:
                    wait_for([signing])
                self.market.client.forget_nonce()
                raise KeyboardInterrupt("interrupted before the submission was sent: no job "
                                        "was submitted") from None
            raise KeyboardInterrupt(self._interrupted_submission(
                signed, receipt, pairs, precisions, opened)) from None
        except Exception as err:
            if signing:
                self.market.client.forget_nonce()  # in case signing failed after its nonce
            message = f"{node_refusal(err)} (account {self.address})" \
                if isinstance(err, Web3RPCError) else f"{type(err).__name__}: {err}"
            if signed is not None and is_transient(err):  # it may have reached the node
                message += (f"; the submission (transaction 0x{keccak(signed[1]).hex()}) may "
                            "still open the jobs: `needle-net jobs` lists them and "
                            "`needle-net cancel JOB_ID` refunds each")
            raise RemoteJobError("submit", message) from err

    def _put_arrays(self, arrays: list[np.ndarray]) -> list[bytes]:
        """`market.put_arrays`, tried again until the timeout where the connection was cut
        or reset (the chain node killed and restarted mid-upload): the first reset failed
        the submission at once. Blobs are stored under their hash, so one that arrived
        before the cut is stored once whatever is sent again. A store that cannot be reached
        at all is the blob client's to wait for (`refused_upload_wait`), not tried again
        here: a wrong or dead blob URL failed only after the whole timeout."""
        end = time.monotonic() + self.timeout
        while True:
            try:
                return self.market.put_arrays(arrays)
            except Exception as err:
                if not _cut_off(err) or time.monotonic() > end:
                    raise
                time.sleep(self.poll_interval)

    def _opened_by(self, receipt, pairs: list[tuple[np.ndarray, np.ndarray]],
                   precisions: list[str], times: dict[str, float]) -> list[_Pending]:
        """The jobs a mined submission opened, in the order of `pairs`."""
        job_ids = [int(e["jobId"]) for e in self.market.events_in(receipt, "JobSubmitted")]
        return [_Pending(job_id, a, b, p, receipt["blockNumber"], times=dict(times))
                for job_id, (a, b), p in zip(job_ids, pairs, precisions, strict=True)]

    def _interrupted_submission(self, signed: tuple, receipt, pairs: list,
                                precisions: list[str], opened: list[_Pending]) -> str:
        """What a Ctrl-C during the submission left behind. Jobs it opened are cancelled, for
        their fees back: the node is asked once whether a transaction sent is mined
        already (the chain may have sealed it while its answer was on the way)."""
        if not opened:
            try:
                receipt = receipt or self.market.client.receipt(keccak(signed[1]))
                if receipt is not None and receipt["status"] == 1:
                    opened.extend(self._opened_by(receipt, pairs, precisions, {}))
            except Exception:  # noqa: BLE001 - the node unreachable: the user is told below
                pass
        if opened:
            return f"interrupted: {self.abandon(opened)}"
        self.market.client.forget_nonce()  # the node counts it if it has the transaction
        return (f"interrupted while the submission (transaction 0x{keccak(signed[1]).hex()}) "
                "was sent: it may still open the job; `needle-net jobs` lists it and "
                "`needle-net cancel JOB_ID` refunds it")

    def _send_submission(self, signed: tuple, sign_again: Callable[[], tuple]):
        """Send the signed submitJobs and wait for its receipt. Where the node's answer was
        lost (a cut connection, a restart) the same transaction is sent again: its jobs open
        at most once (the node knows it, or its nonce is used and its receipt is found), and
        a submission that did open them is not reported as failed, to be paid for again. Where
        another client with this key took its nonce it never runs, and is signed again once
        with the next nonce. A node that refuses the connection (restarting) never got the
        transaction: it is waited for until the timeout, not counted as a send (five quick
        refusals failed a submission while the node restarted)."""
        end = time.monotonic() + self.timeout
        sends, signed_again = 0, False  # sends that may have reached the node
        while True:
            try:
                return self.market.send_signed(signed)
            except Web3RPCError as err:
                if signed_again or not nonce_taken(err):
                    raise
                signed, signed_again = sign_again(), True
            except Exception as err:
                sends += not isinstance(err, ConnectionRefusedError)
                if not is_transient(err) or sends >= SUBMIT_SENDS or time.monotonic() > end:
                    raise
                time.sleep(self.poll_interval)

    def _sign_submission(self, flat_ids: list[bytes], shapes: list[tuple],
                         precisions: list[str]) -> tuple:
        """submitJobs for the pairs whose A and B ids alternate in `flat_ids`, signed."""
        ids = zip(flat_ids[0::2], flat_ids[1::2], strict=True)
        rows = [(a_id, b_id, *shape, PRECISION_CODES[p], self.fee_wei)
                for (a_id, b_id), shape, p in zip(ids, shapes, precisions, strict=True)]
        columns = [list(column) for column in zip(*rows, strict=True)]
        return self.market.sign_with_gas(submit_jobs_gas(len(rows)), "submitJobs", *columns,
                                         self.timeout_blocks, value=self.fee_wei * len(rows))

    def wait(self, pending: list[_Pending]) -> list[np.ndarray]:
        """Follow the jobs block by block (the long poll brings each block's market events)
        until every result is verified, fetched and checked. A result is fetched and
        checked as soon as it is committed, while the chain finalises it; it is returned
        only once the chain's verdict says verified."""
        deadline = time.time() + self.timeout
        display = None
        by_id = {p.job_id: p for p in pending}
        next_block = min((p.submit_block for p in pending), default=0) + 1
        try:  # from here a Ctrl-C cancels the open jobs (the display's set-up takes a while)
            display = _Progress(len(pending)) if self.progress else None
            while any(p.result is None for p in pending):
                try:
                    head, events = self.market.follow(next_block, self.poll_interval)
                except Exception as err:  # the node unreachable for a moment: ask again
                    if not is_transient(err) or time.time() > deadline:
                        stuck = next(p for p in pending if p.result is None)
                        raise RemoteJobError(
                            stuck.stage, f"lost the chain node ({type(err).__name__}: {err}): "
                            f"{self.abandon(pending)}", stuck.job_id) from err
                    time.sleep(self.poll_interval)
                    continue
                try:
                    if events is not None:
                        mark(f"job wait head {head}")
                        for event in events:
                            p = by_id.get(event["args"].get("jobId"))
                            if p is not None and p.result is None:
                                self._apply(p, event)
                        next_block = head + 1
                    self._fetch_committed(pending, deadline)
                except RemoteJobError as err:  # one job failed: the rest is not left behind
                    wider = self._with_rest_abandoned(err, pending)
                    if wider is err:
                        raise
                    raise wider from err
                for p in pending:
                    if p.result is None:
                        self._nudge(p, head)
                if display:
                    display.update(pending)
                if time.time() > deadline and any(p.result is None for p in pending):
                    stuck = next(p for p in pending if p.result is None)
                    raise RemoteJobError(
                        stuck.stage, f"timed out after {self.timeout:.0f}s (no worker moved "
                        f"the job on{_unclaimed_hint(stuck, self.timeout_blocks)}): "
                        f"{self.abandon(pending)}",
                        stuck.job_id)
        except RemoteJobError as err:  # the jobs done before it are paid for: not dropped
            finished = _finished(pending)
            if not finished:
                raise
            raise RemoteJobError(err.stage, f"{err.message}; {self._finished_note(finished)} (the "
                                 "error's `results` holds them)", err.job_id, finished) from err
        except KeyboardInterrupt:
            finished = _finished(pending)
            done = f"; {self._finished_note(finished)}" if finished else ""
            raise KeyboardInterrupt(f"interrupted: {self.abandon(pending)}{done}") from None
        finally:
            if display:
                display.close()
        return [p.result for p in pending]

    def _with_rest_abandoned(self, err: RemoteJobError, pending: list[_Pending]
                             ) -> RemoteJobError:
        """err, with the batch's other unfinished jobs cancelled where they still can be
        (for their fees) and what became of each said, rather than left unfollowed."""
        others = [p for p in pending if p.result is None and p.job_id != err.job_id]
        if not others:
            return err
        return RemoteJobError(err.stage, f"{err.message}; the rest of the batch: "
                              f"{self.abandon(others)}", err.job_id)

    def fetch_command(self, job_id: int) -> str:
        """The command that downloads a job's result, to the file this client writes."""
        return f"`needle-net fetch {job_id} -o {shlex.quote(self.output_name)}`"

    def _finished_note(self, results: dict[int, np.ndarray]) -> str:
        """The jobs of a batch that finished before its wait ended in an error: paid for,
        their results are still to be had."""
        return "; ".join(f"job {job_id} finished, verified and paid for: "
                         f"{self.fetch_command(job_id)} gets its result" for job_id in results)

    def abandon(self, pending: list[_Pending]) -> str:
        """Cancel the unfinished jobs that are still open, for their fees back (nobody would
        fetch their results), and say what became of each."""
        return "; ".join(self._abandon_one(p) for p in pending if p.result is None)

    def _abandon_one(self, p: _Pending) -> str:
        if p.stage == "submitted":
            try:
                self.market.send("cancel", p.job_id)
                return f"job {p.job_id} cancelled, its {self.fee_wei / 10**18:g} ETH fee refunded"
            except TxReverted:
                pass  # claimed since the last block seen: no longer cancellable
            except Exception as err:  # noqa: BLE001 - reported: the job stays open
                return (f"job {p.job_id} is still open, cancelling it failed ({err}): "
                        f"`needle-net cancel {p.job_id}` refunds it")
        refused = f" ({p.nudge_refused})" if p.nudge_refused else ""
        return (f"job {p.job_id} was taken by a worker and cannot be cancelled now{refused}: "
                f"{self.fetch_command(p.job_id)} gets its result once it is done, "
                f"`needle-net cancel {p.job_id}` refunds it if its worker misses its "
                f"deadline{f' (block {p.deadline})' if p.deadline else ''}")

    def _apply(self, p: _Pending, event) -> None:
        name, args = event["event"], event["args"]
        if name == "JobClaimed":
            p.deadline = args["deadline"]
            _enter(p, "claimed")
        elif name == "ResultCommitted":
            p.commit_block, p.c_id = event["blockNumber"], args["cId"]
            _enter(p, "committed")
        elif name == "JobReopened":
            p.early = None
            p.reopened += 1
            _enter(p, "submitted")
        elif name == "JobCancelled":
            if p.stage == "submitted":  # only its submitter can cancel an open job
                raise RemoteJobError("submitted", "cancelled by its submitter (this key, from "
                                     "elsewhere), the fee refunded", p.job_id)
            raise RemoteJobError("finalize", "the chain's verifier rejected the operands and "
                                 "refunded the fee", p.job_id)
        elif name == "JobVerified":
            _enter(p, "verified")  # finalised with a pass: the fee went to the worker

    def _fetch_committed(self, pending: list[_Pending], deadline: float) -> None:
        """Fetch and check the results committed since the last block (several at a time),
        and hand out those the chain verified. A verified result whose download failed (the
        store unreachable for a moment, a cut connection) is paid for: it is fetched again
        each block until the deadline rather than given up at the first failure."""
        todo = [p for p in pending if p.stage in ("committed", "verified") and p.result is None
                and (p.early is None or p.early[0] != p.c_id)]
        fetched = map(self._try_fetch, todo) if len(todo) < 2 else \
            self._pool.map(self._try_fetch, todo)
        for p, c in zip(todo, fetched, strict=True):
            p.early = (p.c_id, c)
            mark("job fetched and checked")
        for p in pending:
            if p.stage == "verified" and p.result is None:
                found = p.early[1]
                if isinstance(found, RemoteJobError):
                    if found.stage == "fetch" and time.time() < deadline:
                        p.early = None  # fetched again with the next block
                        continue
                    if found.stage == "fetch":
                        raise RemoteJobError(
                            "fetch", f"{found.message}; the result is verified and paid for: "
                            f"{self.fetch_command(p.job_id)} downloads it",
                            p.job_id) from found
                    raise found
                p.result = found
                _enter(p, "paid")

    def _try_fetch(self, p: _Pending) -> np.ndarray | RemoteJobError:
        try:
            return self._fetch(p)
        except RemoteJobError as err:  # raised only if the chain verifies this result
            return err

    def _nudge(self, p: _Pending, head: int) -> None:
        """Keep a job moving when its worker does not."""
        if p.stage == "claimed" and head > p.deadline:
            self._try("reopenExpired", p)  # the worker missed its deadline
        elif p.stage == "committed" and head > p.commit_block + FINALIZE_PATIENCE_BLOCKS:
            self._try("finalize", p)  # nobody finalised: do it ourselves

    def _try(self, fn_name: str, p: _Pending) -> None:
        """Send a nudge; tried again with the next block unless a worker got there first.
        A nudge the node refuses (this account cannot pay its gas, say) is no reason to
        stop following a job that its worker or anyone else may still finalise: the
        refusal is kept for the message if the wait times out."""
        try:
            self.market.send(fn_name, p.job_id)
        except TxReverted:
            pass  # a worker got there first
        except Web3RPCError as err:
            p.nudge_refused = f"{fn_name} sent by this client: {node_refusal(err)}"
        except Exception as err:
            if not is_transient(err):
                raise  # else tried again with the next block

    def _fetch(self, p: _Pending) -> np.ndarray:
        """C of a commit, fetched and checked; RemoteJobError otherwise (kept until the
        chain's verdict: any other error would end the wait on a C the chain may reject).
        An exact job's C comes back as int64 whatever integer type its worker uploaded."""
        try:
            c = self.market.get_array(p.c_id)
        except Exception as err:
            raise RemoteJobError("fetch", f"{type(err).__name__}: {err}", p.job_id) from err
        expected = p.a.shape[:-1] + (p.b.shape[-1],)
        if c.shape != expected:
            raise RemoteJobError("fetch", f"result has shape {c.shape}, expected {expected}",
                                 p.job_id)
        exact = p.precision == "exact"
        if not (np.issubdtype(c.dtype, np.integer) if exact else c.dtype == np.float32):
            raise RemoteJobError("check", f"result is {c.dtype}, a {p.precision} job's C is "
                                 f"{'an integer type' if exact else 'float32'}", p.job_id)
        if self.local_check and not _freivalds_ok(p.a, p.b, c, p.precision):
            raise RemoteJobError("check", "the result failed the client's own Freivalds check",
                                 p.job_id)
        return np.array(c, dtype=np.int64 if exact else np.float32)


def _presigned(signing: Future | None) -> tuple | None:
    """The submission signed while its operands uploaded; None if it was not, or if its
    signing found the node unreachable (restarting while the upload waited for it): that
    took no nonce, and it is signed now that the store, the node's, took the operands."""
    if signing is None:
        return None
    try:
        return signing.result()
    except Exception as err:
        if not is_transient(err):
            raise
        return None


def _finished(pending: list[_Pending]) -> dict[int, np.ndarray]:
    """The results of the jobs that finished, by job id."""
    return {p.job_id: p.result for p in pending if p.result is not None}


def _cut_off(err: BaseException) -> bool:
    """A connection that was made and then reset or cut mid-request (network trouble that
    a resend may get past), as opposed to one that could not be made."""
    unreachable = (ConnectionRefusedError, BlobPortUnreachable)
    return is_transient(err) and not isinstance(err, unreachable) and \
        not isinstance(err.__cause__, unreachable)


def _unclaimed_hint(p: _Pending, timeout_blocks: int) -> str:
    """Why no worker may have claimed a job: workers compute a float product that may
    overflow float32 before claiming it, and skip it if it does (the chain would fail its
    Inf, slashing them); and they claim a large job only where its deadline leaves them time
    to commit (a claim that expires costs them 10 % of their stake)."""
    if p.stage != "submitted":
        return ""
    if p.reopened:  # "no worker moved it on" read as if none had ever taken it
        return (f" since it was reopened: taken {p.reopened} time(s), by workers that missed "
                "their deadline or whose result failed the check")
    if may_overflow(p.a, p.b, p.precision == "exact"):
        return ("; its product may overflow float32 (k max|A| max|B| is at least half the "
                "largest float32), and workers skip a product that does: scale A or B down")
    batch = p.a.shape[0] if p.a.ndim == 3 else p.b.shape[0] if p.b.ndim == 3 else 1
    if 2 * batch * p.a.shape[-2] * p.a.shape[-1] * p.b.shape[-1] <= DIRECT_COMMIT_FLOPS:
        return ""
    return (f"; workers claim a job this large only if its deadline, {timeout_blocks} blocks "
            "after the claim, leaves them twice the time they need (and never below their "
            f"--min-deadline, {MIN_DEADLINE_BLOCKS} blocks by default): a larger --deadline "
            "(timeout_blocks) lets them")


def _enter(p: _Pending, stage: str) -> None:
    mark(f"job {stage}")
    p.stage = stage
    p.times[stage] = time.perf_counter()


def _freivalds_ok(a: np.ndarray, b: np.ndarray, c: np.ndarray, precision: str) -> bool:
    from verifier import verify

    if a.ndim == 2:
        return verify(a, b, c, precision=precision).passed
    bs = b if b.ndim == 3 else [b] * len(a)
    triples = zip(a, bs, c, strict=True)
    return all(verify(x, y, z, precision=precision).passed for x, y, z in triples)


class _Progress:
    """A live rich display of how many jobs reached each stage."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._bar = Progress(TextColumn("{task.description:>10}"), BarColumn(),
                             MofNCompleteColumn())
        self._tasks = {s: self._bar.add_task(s, total=total) for s in STAGES}
        self._bar.start()

    def update(self, pending: list[_Pending]) -> None:
        for i, stage in enumerate(STAGES):
            reached = sum(STAGES.index(p.stage) >= i for p in pending)
            self._bar.update(self._tasks[stage], completed=reached)

    def close(self) -> None:
        self._bar.stop()
