"""The node's view of the chain: the ComputeMarket contract, its events, and the blob store.

A thin layer over `chain.client.ChainClient` (signing, nonces, receipts) that adds what
workers and clients need: typed job records, the verdict of a finalised job, new-job
discovery from events, and streamed binary blob transfer with a size limit and a hash
check on both ends.
"""

from __future__ import annotations

import errno
import http.client
import re
import socket
from collections.abc import Callable
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from typing import NamedTuple

import httpx
import numpy as np
import requests
from eth_abi import decode as abi_decode
from eth_account.signers.local import LocalAccount
from eth_utils import keccak
from hexbytes import HexBytes
from web3.datastructures import AttributeDict

from chain.blobs import blob_id, encode_array
from chain.client import ChainClient, TransactionReverted, checksummed, log_spans
from chain.precompile import check_gas

JOB_NONE, JOB_OPEN, JOB_CLAIMED, JOB_COMMITTED, JOB_DONE, JOB_CANCELLED = range(6)
STATUS_NAMES = ("none", "open", "claimed", "committed", "done", "cancelled")
PRECISIONS = {0: "exact", 1: "fp32", 2: "tf32", 3: "bf16"}
VERIFY_ROUNDS = 8  # ComputeMarket.VERIFY_ROUNDS: the float classes' Freivalds rounds
EXACT_ROUNDS = 1  # ComputeMarket.EXACT_ROUNDS: the exact class's
BLOCKHASH_WINDOW = 256  # ComputeMarket.BLOCKHASH_WINDOW: a commit is finalised within this
# Fixed gas limits for the job lifecycle (no estimate round trip; measured use in
# docs/protocol.md, with margin): a revert then costs only the gas used.
CLAIM_GAS = 150_000  # measured: 87k
COMMIT_GAS = 200_000  # measured: 60k
FINALIZE_JOBS_GAS = 100_000  # plus finalize_gas(job) per job
FINALIZE_BOOKKEEPING_GAS = 300_000  # the contract's own work in a finalize (measured: ~50k)
ZERO_ADDRESS = "0x" + "00" * 20
UPLOAD_THREADS = 8
PRESIGN_BYTES = 1 << 20  # blobs up to this size in all: their transaction signed during upload
# workers compute jobs up to this many FLOPs before claiming them (claim and commit in one
# transaction, no deadline to miss); larger ones they claim only where the deadline leaves time
DIRECT_COMMIT_FLOPS = 2 * 512**3
# and never one whose deadline is fewer blocks after the claim than this (by default): anyone
# can submit a 1-block job, and a claim that expires cuts 10 % of the worker's stake
MIN_DEADLINE_BLOCKS = 5

NETWORK_DOWN_ERRNOS = frozenset({errno.ENETDOWN, errno.ENETUNREACH, errno.EHOSTDOWN,
                                 errno.EHOSTUNREACH})

TxReverted = TransactionReverted


def node_refusal(err: Exception) -> str:
    """What the chain node said when it refused a request (a JSON-RPC error's message, e.g.
    "insufficient funds: ..."), for the one line a user sees. The node's insufficient-funds
    amounts are in wei (`balance 9994976999979456137055`); they are given in ETH, exactly,
    as every other amount the user sees."""
    answer = getattr(err, "rpc_response", None)
    answer = answer.get("error") if isinstance(answer, dict) else None
    message = answer.get("message") if isinstance(answer, dict) else None
    message = str(message or err)

    def in_ether(amount: re.Match) -> str:
        whole, fraction = divmod(int(amount["wei"]), 10**18)
        digits = f"{fraction:018d}".rstrip("0")
        return f"{amount['what']} {whole}{'.' if digits else ''}{digits} ETH"

    if message.startswith("insufficient funds: "):
        message = re.sub(r"(?P<what>balance|with|cost) (?P<wei>\d+)\b", in_ether, message)
    return f"the chain node refused: {message}"


def is_transient(err: BaseException) -> bool:
    """Network trouble worth retrying (as opposed to a revert or bad data): a connection
    refused, reset, or cut off in the middle of an answer (http.client's IncompleteRead: the
    node restarting while it answered), a timeout, a host name that does not resolve (a
    compose service's name while its container restarts) or a network that is down. A URL
    without http:// (httpx's UnsupportedProtocol, a TransportError) will never work."""
    if isinstance(err, httpx.UnsupportedProtocol):
        return False
    if isinstance(err, OSError) and err.errno in NETWORK_DOWN_ERRNOS:
        return True
    return isinstance(
        err, (ConnectionError, TimeoutError, socket.gaierror, http.client.IncompleteRead,
              requests.ConnectionError, requests.Timeout, httpx.TransportError)
    )


@dataclass(frozen=True)
class Job:
    job_id: int
    submitter: str
    worker: str
    status: int
    a_id: bytes
    b_id: bytes
    c_id: bytes
    batch: int
    m: int
    k: int
    n: int
    precision: int
    fee_wei: int
    deadline: int
    commit_block: int
    timeout_blocks: int  # a claim's deadline is its block + this


@dataclass(frozen=True)
class Verdict:
    passed: bool
    fee_wei: int = 0
    flops: int = 0
    slashed_wei: int = 0
    cancelled: bool = False  # the operands were rejected: fee refunded, nobody slashed


class JobNews(NamedTuple):
    """Jobs open after a range of blocks (the Job as submitted, from its event, or None where
    it must be looked up; oldest first), jobs claimed or cancelled in it, and who claimed
    (address -> its latest block)."""

    opened: dict[int, Job | None]
    taken: set[int]
    claimers: dict[str, int]


def commit_jobs_gas(count: int) -> int:
    """Gas for `commitJobs` of `count` jobs."""
    return 100_000 + 100_000 * count  # measured: 50k + 62k per job


def submit_jobs_gas(count: int) -> int:
    """Gas for `submitJobs` of `count` jobs."""
    return 150_000 + 150_000 * count  # measured: 82k + 97k per job


def finalize_gas(job: Job) -> int:
    """`finalize_gas_for` a job on chain."""
    return finalize_gas_for(job.batch, job.m, job.k, job.n, job.precision == 0)


def finalize_gas_for(batch: int, m: int, k: int, n: int, exact: bool) -> int:
    """A gas limit for `finalize` that always suffices and no more: the precompile's cost,
    which the chain charges exactly from the declared shapes and the class's rounds
    (docs/protocol.md), the 1/64 of the gas that the contract's call to it keeps back
    (EIP-150), and the contract's own bookkeeping. Doubling the check's cost instead made
    jobs from 6144^3 on ask for more than the block gas limit, and the node refused every
    finalize of them (and a transaction's whole gas limit must be covered by the sender's
    balance at the max fee)."""
    precompile = check_gas(batch, m, k, n, EXACT_ROUNDS if exact else VERIFY_ROUNDS)
    return FINALIZE_BOOKKEEPING_GAS + precompile + precompile // 63 + 1


def _bytes(value) -> bytes:
    return bytes.fromhex(value[2:]) if isinstance(value, str) else bytes(value)


def _int(value) -> int:
    return int(value, 16) if isinstance(value, str) else value


def _topic_value(abi_type: str, topic: bytes):
    if abi_type.startswith("uint"):
        return int.from_bytes(topic, "big")
    if abi_type == "address":
        return "0x" + topic[12:].hex()
    return abi_decode([abi_type], topic)[0]


class EventDecoder:
    """A contract's events decoded exactly as web3's ``process_log`` decodes them (the same
    AttributeDict), from raw JSON-RPC logs or web3-formatted ones, without web3's per-log
    machinery: 20-50x faster, and a block of 100 small jobs carries 300 market events that
    every worker and the client read. Indexed inputs must be static types (as the market's
    are); their values are then the topics themselves."""

    def __init__(self, abi: list[dict]) -> None:
        self.events: dict[bytes, tuple] = {}
        for entry in (e for e in abi if e["type"] == "event"):
            inputs = entry["inputs"]
            indexed = [(i["name"], i["type"]) for i in inputs if i["indexed"]]
            if any(t in ("string", "bytes") or t.endswith("]") or t.startswith("tuple")
                   for _, t in indexed):
                raise ValueError(f"event {entry['name']}: dynamic indexed inputs are not "
                                 "supported")
            data = [(i["name"], i["type"]) for i in inputs if not i["indexed"]]
            signature = f"{entry['name']}({','.join(i['type'] for i in inputs)})"
            self.events[keccak(text=signature)] = (entry["name"], indexed, data)

    def decode(self, log) -> AttributeDict | None:
        """The event of one log, or None if it is not one of this contract's events."""
        topics = log["topics"]
        found = self.events.get(_bytes(topics[0])) if topics else None
        if found is None:
            return None
        name, indexed, data = found
        values = [_topic_value(t, _bytes(topic)) for (_, t), topic in
                  zip(indexed, topics[1:], strict=True)]
        values += abi_decode([t for _, t in data], _bytes(log["data"]))
        args = {arg: checksummed(v) if t == "address" else v
                for (arg, t), v in zip(indexed + data, values, strict=True)}
        return AttributeDict({
            "args": AttributeDict(args), "event": name, "logIndex": _int(log["logIndex"]),
            "transactionIndex": _int(log["transactionIndex"]),
            "transactionHash": HexBytes(log["transactionHash"]),
            "address": checksummed(log["address"]),
            "blockHash": HexBytes(log["blockHash"]), "blockNumber": _int(log["blockNumber"]),
        })


class Market:
    def __init__(
        self, rpc_url: str, account: LocalAccount, max_blob_bytes: int | None = None
    ) -> None:
        self.client = ChainClient(rpc_url, account.key, max_blob_bytes=max_blob_bytes)
        self.account = account
        self.address = account.address
        self.w3 = self.client.w3
        self.contract = self.client.market
        self.max_blob_bytes = self.client.max_blob_bytes  # None given: the node's
        self.blobs = self.client.blobs
        self.events = EventDecoder(self.contract.abi)

    def close(self) -> None:
        self.client.close()

    # -- transactions and views --------------------------------------------------------

    def send(self, fn_name: str, *args, value: int = 0):
        """Sign and send a contract call; returns the receipt, raises TxReverted on revert."""
        call = getattr(self.contract.functions, fn_name)(*args)
        return self.client.send(call, value=value)

    def send_with_gas(self, gas: int, fn_name: str, *args, value: int = 0):
        """`send` with a fixed gas limit: no estimate, so it can be sent before it would pass
        against the current head (a revert then costs the gas used)."""
        call = getattr(self.contract.functions, fn_name)(*args)
        return self.client.send(call, value=value, gas=gas)

    def sign_with_gas(self, gas: int, fn_name: str, *args, value: int = 0) -> tuple:
        """A contract call signed with a fixed gas limit and not sent yet, for `send_signed`
        (or `client.forget_nonce()` if it is dropped): (call, raw transaction, value)."""
        call = getattr(self.contract.functions, fn_name)(*args)
        return call, self.client.sign(call, value=value, gas=gas), value

    def send_signed(self, signed: tuple):
        """Send a `sign_with_gas` call and wait for it: its receipt; TxReverted on revert."""
        call, raw, value = signed
        return self.client.send_signed(call, raw, value)[-1]

    def send_signed_after(self, posted: list, signed: tuple) -> list:
        """Send a `sign_with_gas` call and wait for it and for calls posted before it: their
        receipts and then its own, in one request; TxReverted for the first that reverted."""
        call, raw, value = signed
        return self.client.send_signed(call, raw, value, after=posted)

    def post_signed(self, signed: tuple):
        """Send a `sign_with_gas` call without waiting; (call, tx hash) for
        `send_signed_after`."""
        call, raw, _ = signed
        return call, self.client.post_signed(call, raw)

    def post_with_gas(self, gas: int, fn_name: str, *args):
        """Send a contract call with a fixed gas limit without waiting; (call, tx hash) for
        `send_signed_after`."""
        call = getattr(self.contract.functions, fn_name)(*args)
        return call, self.client.post(call, gas=gas)

    def block_number(self) -> int:
        return self.w3.eth.block_number

    def balance_of(self, address: str) -> int:
        return self.client.balance(address)

    def stake_of(self, address: str) -> int:
        return self.client.call(self.contract.functions.workerStake(address))

    def min_stake(self) -> int:
        return self.client.call(self.contract.functions.minStake())

    def worker_info(self, address: str) -> tuple[int, int, int]:
        """(stake, withdrawBlock, activeClaims) of a worker."""
        return tuple(self.client.call(self.contract.functions.workerInfo(address)))

    def job(self, job_id: int) -> Job:
        fields = self.client.call(self.contract.functions.getJob(job_id))
        return Job(job_id, *fields)

    def job_count(self) -> int:
        return self.client.call(self.contract.functions.jobCount())

    def wait_for_block(self, number: int, timeout: float) -> int:
        """Wait (long poll) until block `number` exists or `timeout` seconds pass; the head."""
        return self.client.wait_for_block(number, timeout)

    def follow(self, number: int, timeout: float) -> tuple[int, list | None]:
        """Wait (long poll) until block `number` exists or `timeout` seconds pass: (head,
        every market event in blocks `number`..head, decoded, in chain order), or (head,
        None) if block `number` did not come. The long poll's answer carries the logs."""
        head, raw = self.client.wait_for_logs(number, timeout)
        return head, None if raw is None else self._decoded(raw)

    @staticmethod
    def new_jobs(events: list) -> JobNews:
        """What happened to jobs in a range of blocks, from its market events."""
        found: dict[int, Job | None] = {}
        taken: set[int] = set()
        claimers: dict[str, int] = {}
        for event in events:
            args = event["args"]
            if event["event"] in ("JobClaimed", "JobCancelled"):
                found.pop(args["jobId"], None)
                taken.add(args["jobId"])
                if "worker" in args:
                    claimers[args["worker"]] = event["blockNumber"]
            elif event["event"] == "JobSubmitted":
                found[args["jobId"]] = Job(
                    args["jobId"], args["submitter"], ZERO_ADDRESS, JOB_OPEN, args["aId"],
                    args["bId"], b"\0" * 32, args["batch"], args["m"], args["k"], args["n"],
                    args["precision"], args["fee"], 0, 0, args["timeoutBlocks"])
            elif event["event"] == "JobReopened":
                found.pop(args["jobId"], None)
                found[args["jobId"]] = None
                taken.discard(args["jobId"])
        return JobNews(found, taken, claimers)

    def claimed_by(self, worker: str) -> set[int]:
        """Ids of every job `worker` ever claimed, asked for in spans the node answers: one
        query from block 0 was refused (-32005) once the chain passed MAX_LOG_BLOCKS blocks,
        and a worker restarting on such a chain failed to start."""
        head, ids = self.block_number(), set()
        for start, end in log_spans(0, head):
            events = self.contract.events.JobClaimed.get_logs(
                argument_filters={"worker": worker}, from_block=start, to_block=end)
            ids.update(int(e["args"]["jobId"]) for e in events)
        return ids

    def logs(self, from_block: int, to_block: int) -> list:
        """Every market event in [from_block, to_block], decoded, in chain order."""
        return self._decoded(self.client.raw_logs(from_block, to_block))

    def _decoded(self, logs: list) -> list:
        return [e for e in map(self.events.decode, logs) if e is not None]

    def events_in(self, receipt, name: str) -> list[dict]:
        """The arguments of each `name` event the market emitted in a receipt."""
        return [e["args"] for e in self.logs_in(receipt) if e["event"] == name]

    def verdicts_in(self, receipt) -> dict[int, Verdict]:
        """The verdicts a finalize or finalizeJobs transaction reached, by job id."""
        verdicts: dict[int, Verdict] = {}
        for event in self.logs_in(receipt):
            args = event["args"]
            if event["event"] == "JobVerified":
                verdicts[args["jobId"]] = Verdict(True, fee_wei=args["fee"], flops=args["flops"])
            elif event["event"] == "JobFailed":
                verdicts[args["jobId"]] = Verdict(False, slashed_wei=args["slashed"])
            elif event["event"] == "JobCancelled":
                verdicts[args["jobId"]] = Verdict(False, cancelled=True)
        return verdicts

    def logs_in(self, receipt) -> list:
        """Every market event in a receipt, decoded, in log order."""
        return self._decoded(log for log in receipt["logs"]
                             if log["address"] == self.contract.address)

    def verdict(self, job_id: int, worker: str, from_block: int = 0) -> Verdict | None:
        """How the latest finalisation of `worker`'s result for `job_id` went, if it happened.
        A JobCancelled names no worker: it is this worker's verdict (the operands rejected,
        the fee refunded) where the cancelled job still names it, which a job its submitter
        cancelled (open, so no one's) does not."""
        events = self.contract.events
        cancelled = events.JobCancelled.get_logs(argument_filters={"jobId": job_id},
                                                 from_block=from_block)
        if cancelled and self.job(job_id).worker == worker:
            return Verdict(False, cancelled=True)  # final: nothing follows a cancel
        flt = {"jobId": job_id, "worker": worker}
        passed = events.JobVerified.get_logs(argument_filters=flt, from_block=from_block)
        failed = events.JobFailed.get_logs(argument_filters=flt, from_block=from_block)
        latest = max([*passed, *failed], key=lambda e: (e["blockNumber"], e["logIndex"]),
                     default=None)
        if latest is None:
            return None
        if latest["event"] == "JobVerified":
            return Verdict(True, fee_wei=latest["args"]["fee"], flops=latest["args"]["flops"])
        return Verdict(False, slashed_wei=latest["args"]["slashed"])

    def recent_blocks(self, count: int) -> list[dict]:
        head = self.block_number()
        blocks = []
        for number in range(head, max(-1, head - count), -1):
            block = self.w3.eth.get_block(number)
            blocks.append({
                "number": number,
                "hash": block["hash"].to_0x_hex(),
                "transactions": len(block["transactions"]),
                "timestamp": block["timestamp"],
            })
        return blocks

    # -- blobs ---------------------------------------------------------------------------

    def put_blob(self, data: bytes) -> bytes:
        """Upload blob bytes; returns the id (BlobError if the store refuses them)."""
        return self.blobs.put(data)

    def put_array(self, array: np.ndarray) -> bytes:
        return self.blobs.put_array(array)

    def put_arrays(self, arrays: list[np.ndarray]) -> list[bytes]:
        """Upload many arrays; small ones travel batched, several per request."""
        return self.blobs.put_arrays(arrays, UPLOAD_THREADS)

    def put_arrays_signing(self, arrays: list[np.ndarray], sign: Callable[[list[bytes]], tuple],
                           pool: Executor, put: Callable[[list], list[bytes]] | None = None
                           ) -> tuple[list[bytes], Future]:
        """Upload small arrays (`put`, by default `put_arrays`) while `sign(ids)` signs the
        transaction naming them on `pool`, with their ids hashed here: (ids, the signing).
        The transaction may be sent once this returns, the store having acknowledged exactly
        these ids (one naming a missing blob must never go out); if the upload fails, the
        signature is dropped with its nonce."""
        ids = [blob_id(encode_array(a)) for a in arrays]
        signing = pool.submit(sign, ids)
        try:
            if (put or self.put_arrays)(arrays) != ids:
                raise ValueError("the blob store acknowledged other ids than the arrays'")
        except BaseException:
            wait_for([signing])
            self.client.forget_nonce()  # the signed transaction is never sent
            raise
        return ids, signing

    def get_blob(self, id_: bytes) -> memoryview:
        """A blob's bytes (size limit and id checked); BlobError otherwise."""
        return self.blobs.get(id_)

    def get_array(self, id_: bytes) -> np.ndarray:
        return self.blobs.get_array(id_)
