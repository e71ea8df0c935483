"""Model-based fuzzing of the market's money and state rules (docs/protocol.md).

`Model` restates ComputeMarket's rules in a few lines of Python: balances, stakes,
totalStaked, totalEscrow, every job's fields, active claims, pending withdrawals and the
reward pool. A seeded run sends random signed transactions by several submitters and
workers to an in-process node sealed block by block, many of them invalid on purpose (the
wrong party, too little value, the wrong status, a block too early or too late). The model
executes each transaction in the sealed block's order; after every block the chain must
agree with it on every balance (the market's own included), every stake, every job field and
every event, and the model's own books must hold:

- nothing created or lost: all balances plus the burned base fees are constant;
- the market holds exactly its escrow plus stakes (no contract here refuses a payment, so
  nothing is ever owed), and the escrow is exactly the fees of the jobs not yet finished;
- no job is paid twice, a finished job stays finished, a slash never exceeds the stake;
- a worker's active claims are its live jobs, and a worker holding one cannot withdraw.
"""
from __future__ import annotations

import copy
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
import pytest
from eth_abi import decode as abi_decode
from eth_utils import to_canonical_address, to_checksum_address
from helpers import decode_log, events_by_topic
from web3 import Web3

from chain.blobs import encode_array
from chain.compile import compiled_market
from chain.devnet import dev_accounts
from chain.node import Node, NodeConfig
from chain.params import CHAIN_ID, MARKET_ADDRESS, REWARD_PER_GFLOP, REWARD_POOL_ADDRESS
from chain.rpc import Rpc

pytestmark = pytest.mark.timeout(180)
BLOCKS = 1000  # blocks of 1 to 4 random transactions (and runs of empty blocks between)

ETHER = 10**18
MIN_STAKE = ETHER
WITHDRAW_COOLDOWN = 5
FAIL_SLASH_BPS, LATE_SLASH_BPS = 5000, 1000
WINDOW = 256  # blocks after a commit in which it can be finalised
MAX_BLOCK_REWARD = 2 * ETHER
OPEN, CLAIMED, COMMITTED, DONE, CANCELLED = 1, 2, 3, 4, 5
LIVE, FINISHED = (CLAIMED, COMMITTED), (DONE, CANCELLED)
FAIL, PASS, BAD_OPERANDS = 0, 1, 2
ZERO = "0x" + "00" * 20
EMPTY = b"\0" * 32
MARKET = to_checksum_address(MARKET_ADDRESS).lower()
POOL = to_checksum_address(REWARD_POOL_ADDRESS).lower()

ABI = compiled_market()["abi"]
CONTRACT = Web3().eth.contract(address=to_checksum_address(MARKET_ADDRESS), abi=ABI)
EVENTS = events_by_topic(ABI)


class Revert(Exception):
    """The model's transaction reverts: nothing but the sender's gas changes."""


def require(condition: bool) -> None:
    if not condition:
        raise Revert


@dataclass
class Job:
    submitter: str
    a_id: bytes
    b_id: bytes
    batch: int
    m: int
    k: int
    n: int
    precision: int
    timeout: int
    fee: int
    worker: str = ZERO
    status: int = OPEN
    c_id: bytes = EMPTY
    deadline: int = 0
    commit_block: int = 0

    def fields(self) -> tuple:
        """getJob's answer."""
        return (self.submitter, self.worker, self.status, self.a_id, self.b_id, self.c_id,
                self.batch, self.m, self.k, self.n, self.precision, self.fee, self.deadline,
                self.commit_block, self.timeout)

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n


@dataclass
class Worker:
    stake: int = 0
    withdraw_block: int = 0
    claims: int = 0


@dataclass
class Operands:
    """A job's blobs as stored on the node, with a right and a wrong result."""

    a_id: bytes
    b_id: bytes
    shape: tuple[int, int, int, int]  # batch, m, k, n
    precision: int
    right: bytes
    wrong: bytes


@dataclass
class Model:
    """ComputeMarket's rules, each function checked first and then applied (a revert
    restores the state, as the EVM does)."""

    balances: dict[str, int]
    operands: list[Operands]
    jobs: list[Job] = field(default_factory=list)
    workers: dict[str, Worker] = field(default_factory=lambda: defaultdict(Worker))
    escrow: int = 0
    staked: int = 0
    block: int = 0  # the number of the block executing
    events: list = field(default_factory=list)  # the executing transaction's
    verified: list = field(default_factory=list)  # (worker, flops) in this block

    def execute(self, sender: str, fn: str, args: tuple, value: int, cost: int) -> list | None:
        """Run one transaction; its events, or None if it reverts."""
        saved = copy.deepcopy((self.jobs, self.workers, self.escrow, self.staked,
                               self.balances, self.verified))
        self.events = []
        try:
            self._move(sender, MARKET, value)
            getattr(self, fn)(sender, value, *args)
            events = self.events
        except Revert:
            (self.jobs, self.workers, self.escrow, self.staked, self.balances,
             self.verified) = saved
            events = None
        self.balances[sender] -= cost
        return events

    def end_block(self) -> None:
        """The protocol's block reward: from the pool to this block's verified workers."""
        total = sum(flops for _, flops in self.verified)
        if total:
            reward = min(MAX_BLOCK_REWARD, self.balances[POOL], REWARD_PER_GFLOP * total // 10**9)
            per_worker = Counter()
            for worker, flops in self.verified:
                per_worker[worker] += flops
            for worker, flops in per_worker.items():
                self._move(POOL, worker, reward * flops // total)
        self.verified = []

    # --- the contract's external functions ---------------------------------------------------
    def register(self, sender, value):
        w = self.workers[sender]
        require(w.stake + value >= MIN_STAKE)
        w.stake += value
        w.withdraw_block = 0
        self.staked += value
        self.emit("WorkerRegistered", worker=sender, stake=w.stake)

    def requestWithdraw(self, sender, value):
        require(self.workers[sender].stake > 0)
        self.workers[sender].withdraw_block = self.block + WITHDRAW_COOLDOWN
        self.emit("WithdrawRequested", worker=sender, availableBlock=self.block + WITHDRAW_COOLDOWN)

    def withdraw(self, sender, value):
        w = self.workers[sender]
        require(w.withdraw_block != 0 and self.block >= w.withdraw_block and w.claims == 0)
        self.workers[sender] = Worker()
        self.staked -= w.stake
        self.emit("Withdrawn", worker=sender, amount=w.stake)
        self._move(MARKET, sender, w.stake)

    def submitJob(self, sender, value, a_id, b_id, batch, m, k, n, precision, timeout):
        self.escrow += value
        self._submit(sender, a_id, b_id, batch, m, k, n, precision, timeout, value)

    def submitJobs(self, sender, value, a_ids, b_ids, batches, ms, ks, ns, precisions, fees,
                   timeout):
        columns = (a_ids, b_ids, batches, ms, ks, ns, precisions, fees)
        require(len(a_ids) > 0 and all(len(c) == len(a_ids) for c in columns))
        for job in zip(*columns, strict=True):
            self._submit(sender, *job[:7], timeout, job[7])
        require(sum(fees) == value)
        self.escrow += value

    def claimJob(self, sender, value, job_id):
        w = self.workers[sender]
        require(w.stake >= MIN_STAKE and w.withdraw_block == 0)
        job = self._job(job_id)
        require(job.status == OPEN)
        job.status, job.worker, job.deadline = CLAIMED, sender, self.block + job.timeout
        w.claims += 1
        self.emit("JobClaimed", jobId=job_id, worker=sender, deadline=job.deadline)

    def commitResult(self, sender, value, job_id, c_id):
        job = self._job(job_id)
        require(job.status == CLAIMED and job.worker == sender and self.block <= job.deadline)
        job.status, job.commit_block, job.c_id = COMMITTED, self.block, c_id
        self.emit("ResultCommitted", jobId=job_id, worker=sender, cId=c_id)

    def commitJobs(self, sender, value, job_ids, c_ids):
        w = self.workers[sender]
        require(len(job_ids) == len(c_ids) and w.stake >= MIN_STAKE and w.withdraw_block == 0)
        for job_id, c_id in zip(job_ids, c_ids, strict=True):
            job = self._job(job_id)
            if job.status != OPEN:
                continue
            job.status, job.worker, job.c_id = COMMITTED, sender, c_id
            job.deadline = job.commit_block = self.block
            w.claims += 1
            self.emit("JobClaimed", jobId=job_id, worker=sender, deadline=self.block)
            self.emit("ResultCommitted", jobId=job_id, worker=sender, cId=c_id)

    def finalize(self, sender, value, job_id):
        require(self._finalizable(self._job(job_id)))
        self._finalize(job_id)

    def finalizeJobs(self, sender, value, job_ids):
        for job_id in job_ids:
            if self._finalizable(self._job(job_id)):
                self._finalize(job_id)

    def reopenExpired(self, sender, value, job_id):
        job = self._job(job_id)
        slashed = 0
        if job.status == CLAIMED:
            require(self.block > job.deadline)
            slashed = self._slash(job.worker, LATE_SLASH_BPS)
            self.emit("JobFailed", jobId=job_id, worker=job.worker, slashed=slashed)
        else:
            require(job.status == COMMITTED and self.block > job.commit_block + WINDOW)
        self.workers[job.worker].claims -= 1
        self._reopen(job_id)
        self._move(MARKET, POOL, slashed)  # a late cut: all to the pool

    def cancel(self, sender, value, job_id):
        job = self._job(job_id)
        require(job.submitter == sender and job.status == OPEN)
        job.status = CANCELLED
        self.escrow -= job.fee
        self.emit("JobCancelled", jobId=job_id)
        self._move(MARKET, sender, job.fee)

    def claimOwed(self, sender, value):
        raise Revert  # every account here takes its payments: nothing is ever owed

    # --- internals ---------------------------------------------------------------------------
    def emit(self, name: str, **args) -> None:
        self.events.append((name, args))

    def _move(self, source: str, target: str, amount: int) -> None:
        assert self.balances[source] >= amount, f"{source} pays {amount} it does not hold"
        self.balances[source] -= amount
        self.balances[target] += amount

    def _job(self, job_id: int) -> Job:
        """The job, or one with status 0 and no submitter where there is no such job."""
        if job_id < len(self.jobs):
            return self.jobs[job_id]
        return Job(ZERO, EMPTY, EMPTY, 0, 0, 0, 0, 0, 0, 0, status=0)

    def _submit(self, sender, a_id, b_id, batch, m, k, n, precision, timeout, fee):
        require(min(batch, m, k, n) > 0 and max(batch, m, k, n) < 2**32)
        require(precision <= 3 and 0 < timeout <= 100_000 and fee < 2**88)
        job_id = len(self.jobs)
        self.jobs.append(Job(sender, a_id, b_id, batch, m, k, n, precision, timeout, fee))
        self.emit("JobSubmitted", jobId=job_id, submitter=sender, aId=a_id, bId=b_id,
                  batch=batch, m=m, k=k, n=n, precision=precision, fee=fee,
                  timeoutBlocks=timeout)

    def _finalizable(self, job: Job) -> bool:
        return job.status == COMMITTED and job.commit_block < self.block <= \
            job.commit_block + WINDOW

    def _verdict(self, job: Job) -> int:
        """The precompile's: operands unknown to the store or not as declared are the
        submitter's; else the result must be the right one."""
        declared = ((job.batch, job.m, job.k, job.n), job.precision)
        ops = next((o for o in self.operands if (o.a_id, o.b_id) == (job.a_id, job.b_id)
                    and (o.shape, o.precision) == declared), None)
        if ops is None:
            return BAD_OPERANDS
        return PASS if job.c_id == ops.right else FAIL

    def _finalize(self, job_id: int) -> None:
        job = self.jobs[job_id]
        verdict = self._verdict(job)
        self.workers[job.worker].claims -= 1
        if verdict == PASS:
            job.status = DONE
            self.escrow -= job.fee
            self.emit("JobVerified", jobId=job_id, worker=job.worker, fee=job.fee,
                      flops=job.flops)
            self.verified.append((job.worker, job.flops))
            self._move(MARKET, job.worker, job.fee)
        elif verdict == BAD_OPERANDS:
            job.status = CANCELLED
            self.escrow -= job.fee
            self.emit("JobCancelled", jobId=job_id)
            self._move(MARKET, job.submitter, job.fee)
        else:
            slashed = self._slash(job.worker, FAIL_SLASH_BPS)
            self.emit("JobFailed", jobId=job_id, worker=job.worker, slashed=slashed)
            self._reopen(job_id)
            self._pay_slash(slashed, job.submitter)

    def _slash(self, worker: str, bps: int) -> int:
        w = self.workers[worker]
        amount = w.stake * bps // 10_000
        assert amount <= w.stake
        w.stake -= amount
        self.staked -= amount
        return amount

    def _pay_slash(self, amount: int, submitter: str) -> None:
        self._move(MARKET, submitter, amount // 2)
        self._move(MARKET, POOL, amount - amount // 2)

    def _reopen(self, job_id: int) -> None:
        job = self.jobs[job_id]
        job.status, job.worker, job.c_id, job.deadline, job.commit_block = \
            OPEN, ZERO, EMPTY, 0, 0
        self.emit("JobReopened", jobId=job_id)

    def check_books(self, supply: int) -> None:
        """The invariants that hold between blocks, whatever happened."""
        assert sum(self.balances.values()) == supply, "ether created or lost"
        assert self.balances[MARKET] == self.escrow + self.staked
        assert self.escrow == sum(j.fee for j in self.jobs if j.status not in FINISHED)
        assert self.staked == sum(w.stake for w in self.workers.values())
        live = Counter(j.worker for j in self.jobs if j.status in LIVE)
        assert {a: w.claims for a, w in self.workers.items() if w.claims} == dict(live)


class Signer:
    """A dev account signing EIP-1559 transactions that tip nothing (nonces counted here)."""

    def __init__(self, account):
        self.account, self.address, self.nonce = account, account.address.lower(), 0

    def raw(self, fn: str, *args, value: int = 0) -> bytes:
        tx = {"to": CONTRACT.address, "data": CONTRACT.encode_abi(fn, args=list(args)),
              "value": value, "gas": 3_000_000, "maxFeePerGas": 10**10,
              "maxPriorityFeePerGas": 0, "nonce": self.nonce, "chainId": CHAIN_ID, "type": 2}
        self.nonce += 1
        return self.account.sign_transaction(tx).raw_transaction


def decode_event(log: dict) -> tuple[str, dict]:
    assert log["address"].lower() == MARKET
    decoded = decode_log(log, EVENTS)
    assert decoded is not None, log
    return decoded


class Harness:
    """A node sealed block by block, the model run over each block, and the comparison."""

    def __init__(self, path, rng: np.random.Generator):
        self.node = Node(NodeConfig(path, block_time=0, decode_process=False))
        self.rpc = Rpc(self.node)
        self.rng = rng
        signers = [Signer(a) for a in dev_accounts(8)]
        self.submitters, self.workers, self.third = signers[:3], signers[3:7], signers[7]
        self.signers = {s.address: s for s in signers}
        accounts = [*self.signers, MARKET, POOL]
        self.model = Model({a: self.balance(a) for a in accounts}, self.store_operands())
        self.supply = sum(self.model.balances.values())
        self.finished: dict[int, int] = {}
        self.paid: set[int] = set()
        self.kinds: Counter = Counter()
        self.outcomes: Counter = Counter()  # (function, "ok" or "revert")
        self.events: Counter = Counter()
        self.boundaries: Counter = Counter()  # (function, block - the job's edge)

    def store_operands(self) -> list[Operands]:
        """fp32 and bf16-class float jobs, exact int8/int16 jobs; 2-D and batched."""
        rng = self.rng
        made = []
        for (batch, m, k, n), precision, a_shape, b_shape, dtype in (
                ((1, 4, 3, 2), 1, (4, 3), (3, 2), np.float32),
                ((2, 3, 4, 2), 3, (2, 3, 4), (4, 2), np.float32),
                ((1, 3, 5, 2), 0, (3, 5), (5, 2), np.int8),
                ((2, 2, 3, 2), 0, (2, 2, 3), (2, 3, 2), np.int16)):
            if precision:
                a, b = rng.standard_normal(a_shape, dtype), rng.standard_normal(b_shape, dtype)
                c = (a.astype(np.float64) @ b).astype(np.float32)
            else:
                a, b = (rng.integers(-100, 100, s).astype(dtype) for s in (a_shape, b_shape))
                c = a.astype(np.int64) @ b.astype(np.int64)
            wrong = c.copy()
            wrong.flat[rng.integers(c.size)] += 4  # off in one entry: every round sees it
            a_id, b_id, right, wrong_id = (self.node.blobs.put(encode_array(x))
                                           for x in (a, b, c, wrong))
            made.append(Operands(a_id, b_id, (batch, m, k, n), precision, right, wrong_id))
        return made

    def close(self):
        self.node.stop()

    @property
    def head(self) -> int:
        return self.node.head().block_number

    def balance(self, address: str) -> int:
        return self.node.state_at().get_balance(to_canonical_address(address))

    def view(self, fn: str, *args):
        out = self.rpc.rpc_eth__call({"to": CONTRACT.address,
                                      "data": CONTRACT.encode_abi(fn, args=list(args))})
        abi = next(e for e in ABI if e.get("name") == fn)
        values = abi_decode([o["type"] for o in abi["outputs"]], bytes.fromhex(out[2:]))
        return values[0] if len(values) == 1 else values

    # --- one block -----------------------------------------------------------------------------
    def mine(self, calls: list[tuple]) -> None:
        """Seal one block with these (signer, fn, args, value) calls, run the model over it in
        the block's order and compare."""
        sent = {}
        for signer, fn, args, value in calls:
            sent[self.node.admit(signer.raw(fn, *args, value=value))] = (signer, fn, args, value)
            self.kinds[fn] += 1
        block = self.node.seal()
        assert {tx.hash for tx in block.transactions} == set(sent)
        self.model.block = block.number
        costs, touched = 0, set()
        for tx in block.transactions:
            signer, fn, args, value = sent[tx.hash]
            self.count_boundary(fn, args)
            receipt = self.rpc.rpc_eth__getTransactionReceipt("0x" + tx.hash.hex())
            cost = int(receipt["gasUsed"], 16) * int(receipt["effectiveGasPrice"], 16)
            costs += cost
            expected = self.model.execute(signer.address, fn, args, value, cost)
            status = int(receipt["status"], 16)
            assert status == (expected is not None), \
                f"block {block.number}: {fn}{args} value {value} by {signer.address}: " \
                f"chain status {status}, model {'ok' if expected is not None else 'revert'}"
            events = [decode_event(e) for e in receipt["logs"]]
            assert events == (expected or []), f"block {block.number}: {fn}{args}"
            self.outcomes[fn, "ok" if status else "revert"] += 1
            for name, event in events:
                self.events[name] += 1
                touched.add(event.get("jobId"))
                if name == "JobVerified":
                    assert event["jobId"] not in self.paid, "a job paid twice"
                    self.paid.add(event["jobId"])
        self.model.end_block()
        burned = block.header.gas_used * block.header.base_fee_per_gas
        assert costs == burned  # no tips: every wei of gas paid is burned
        self.supply -= burned
        # every 20 blocks all jobs, else those whose events say they changed
        self.compare(None if block.number % 20 == 0 else touched)

    def count_boundary(self, fn: str, args: tuple) -> None:
        """Count a call landing within a block of its job's deadline or window end."""
        if fn not in ("commitResult", "finalize", "reopenExpired") or \
                args[0] >= len(self.model.jobs):
            return
        job = self.model.jobs[args[0]]
        edge = {CLAIMED: job.deadline, COMMITTED: job.commit_block + WINDOW}.get(job.status)
        if edge is not None and abs(self.model.block - edge) <= 1:
            self.boundaries[fn, self.model.block - edge] += 1

    def empty_blocks(self, until: int) -> None:
        """Seal empty blocks until the last sealed one is `until` (they change nothing)."""
        while self.head < until:
            block = self.node.seal()
            assert not block.transactions and self.balance(POOL) == self.model.balances[POOL]
            self.kinds["empty block"] += 1

    def compare(self, job_ids: set[int] | None = None) -> None:
        """The chain against the model: balances, totals, workers and these jobs (all of
        them where None)."""
        model = self.model
        model.check_books(self.supply)
        assert {a: self.balance(a) for a in model.balances} == model.balances
        assert self.view("totalEscrow") == model.escrow
        assert self.view("totalStaked") == model.staked
        assert self.view("totalOwed") == 0
        assert self.view("jobCount") == len(model.jobs)
        for address in self.signers:
            w = model.workers.get(address, Worker())
            info = self.view("workerInfo", to_checksum_address(address))
            assert info == (w.stake, w.withdraw_block, w.claims)
        for job_id, job in enumerate(model.jobs):
            if job_ids is not None and job_id not in job_ids:
                continue
            on_chain = self.view("getJob", job_id)
            assert on_chain == job.fields(), f"job {job_id}"
            before = self.finished.get(job_id)
            assert before not in FINISHED or before == job.status, f"job {job_id} reopened"
            self.finished[job_id] = job.status
            assert (job.status == DONE) == (job_id in self.paid)

    # --- random actions --------------------------------------------------------------------
    def pick(self, *statuses: int, on_time: bool = False) -> int:
        """A job in one of these states (a claim not yet expired, if on_time), mostly; else
        any id (one past the last too)."""
        jobs = self.model.jobs
        live = [i for i, j in enumerate(jobs) if j.status in statuses
                and not (on_time and j.deadline <= self.head)]
        if live and self.rng.random() < 0.85:
            return int(self.rng.choice(live))
        return int(self.rng.integers(len(jobs) + 1))

    def party(self, job_id: int, role: str, crowd: list[Signer]) -> Signer:
        """The job's submitter or worker, mostly; else anyone, the third party included."""
        jobs = self.model.jobs
        if job_id < len(jobs) and self.rng.random() < 0.85:
            owner = self.signers.get(getattr(jobs[job_id], role))
            if owner is not None:
                return owner
        return self.one([*crowd, self.third])

    def one(self, items: list):
        return items[self.rng.integers(len(items))]

    def declaration(self) -> tuple:
        """(aId, bId, batch, m, k, n, precision) of a stored job, sometimes one whose operands
        the precompile must refuse (A missing, or blobs of the other precision class)."""
        ops = self.one(self.model.operands)
        a_id, precision = ops.a_id, ops.precision
        roll = self.rng.random()
        if roll < 0.08:
            a_id = bytes(self.rng.integers(0, 256, 32, dtype=np.uint8))
        elif roll < 0.14:
            precision = 1 if precision == 0 else 0
        return (a_id, ops.b_id, *ops.shape, precision)

    def result(self, job_id: int) -> bytes:
        """Mostly the right C of the job's operands; else a wrong, missing or foreign one."""
        jobs = self.model.jobs
        ops = next((o for o in self.model.operands
                    if job_id < len(jobs) and o.a_id == jobs[job_id].a_id), None)
        roll = self.rng.random()
        if ops is not None and roll < 0.7:
            return ops.right
        if ops is not None and roll < 0.85:
            return ops.wrong
        if roll < 0.93:
            return self.one(self.model.operands).right
        return bytes(self.rng.integers(0, 256, 32, dtype=np.uint8))

    def fee(self) -> int:
        return int(self.rng.choice([0, 1, 10**15, 3 * 10**15 + 7]))

    # how often each function is called, relative to the others
    WEIGHTS = {"submitJob": 3, "submitJobs": 2, "cancel": 2, "register": 2,
               "requestWithdraw": 1, "withdraw": 1, "claimJob": 5, "commitResult": 5,
               "commitJobs": 2, "finalize": 4, "finalizeJobs": 2, "reopenExpired": 2,
               "claimOwed": 1}

    def call(self) -> tuple:
        """One random (signer, fn, args, value)."""
        rng, model = self.rng, self.model
        names, weights = zip(*self.WEIGHTS.items(), strict=True)
        fn = str(rng.choice(names, p=np.array(weights) / sum(weights)))
        worker, submitter = self.one(self.workers), self.one(self.submitters)
        anyone = self.one([*self.submitters, *self.workers, self.third])
        if fn == "submitJob":
            timeout = int(rng.choice([1, 2, 4, 8, 20, 0] if rng.random() < 0.9 else [100_001]))
            return submitter, fn, (*self.declaration(), timeout), self.fee()
        if fn == "submitJobs":
            count = int(rng.integers(1, 4))
            decls = [self.declaration() for _ in range(count)]
            fees = [self.fee() for _ in range(count)]
            value = sum(fees) + (1 if rng.random() < 0.15 else 0)  # fees must sum to it
            columns = [list(c) for c in zip(*decls, strict=True)]
            return submitter, fn, (*columns, fees, int(rng.choice([1, 3, 10]))), value
        if fn == "cancel":
            job = self.pick(OPEN)
            return self.party(job, "submitter", self.submitters), fn, (job,), 0
        if fn == "register":
            unstaked = model.workers.get(worker.address, Worker()).stake < MIN_STAKE
            values = [ETHER // 2, ETHER, 2 * ETHER + 1] if unstaked else [0, ETHER // 2]
            signer = self.third if rng.random() < 0.1 else worker
            return signer, fn, (), int(rng.choice(values))
        if fn == "withdraw":
            waiting = [s for s in self.workers
                       if model.workers.get(s.address, Worker()).withdraw_block]
            return (self.one(waiting) if waiting and rng.random() < 0.8 else worker), fn, (), 0
        if fn == "claimJob":
            return (worker if rng.random() < 0.9 else self.third), fn, (self.pick(OPEN),), 0
        if fn == "commitResult":
            job = self.pick(CLAIMED, on_time=True)
            return self.party(job, "worker", self.workers), fn, (job, self.result(job)), 0
        if fn == "commitJobs":
            jobs = [self.pick(OPEN) for _ in range(rng.integers(1, 4))]
            return worker, fn, (jobs, [self.result(j) for j in jobs]), 0
        if fn == "finalize":
            return anyone, fn, (self.pick(COMMITTED),), 0
        if fn == "finalizeJobs":
            return anyone, fn, ([self.pick(COMMITTED) for _ in range(rng.integers(1, 4))],), 0
        if fn == "reopenExpired":
            return anyone, fn, (self.pick(CLAIMED, COMMITTED),), 0
        return (worker if fn == "requestWithdraw" else anyone), fn, (), 0

    def advance(self) -> list[tuple]:
        """Seal empty blocks so that the next block lands on an edge (or one block either
        side of it): a claim's deadline, a commit's last block of finalisation, a withdrawal's
        cooldown; the calls aimed at that edge, for the next block."""
        model, rng = self.model, self.rng
        edges = []  # (the edge's block, calls to make there)
        for job_id, job in enumerate(model.jobs):
            anyone = self.one([*self.submitters, *self.workers, self.third])
            if job.status == CLAIMED:
                edges.append((job.deadline, [
                    (self.signers[job.worker], "commitResult", (job_id, self.result(job_id)), 0),
                    (anyone, "reopenExpired", (job_id,), 0)]))
            elif job.status == COMMITTED and rng.random() < 0.1:
                edges.append((job.commit_block + WINDOW, [
                    (anyone, str(rng.choice(["finalize", "reopenExpired"])), (job_id,), 0),
                    (anyone, "finalizeJobs", ([job_id],), 0)]))
        for address, w in model.workers.items():
            if w.withdraw_block and address in self.signers:
                edges.append((w.withdraw_block, [(self.signers[address], "withdraw", (), 0)]))
        edges = [(edge + int(rng.integers(-1, 2)), calls) for edge, calls in edges]
        edges = [(edge, calls) for edge, calls in edges if edge > self.head + 1]
        if not edges:
            return []
        edge, calls = self.one(edges)
        self.empty_blocks(edge - 1)
        return [calls[i] for i in sorted(rng.choice(len(calls), rng.integers(1, len(calls) + 1),
                                                    replace=False))]


def test_random_transactions_keep_the_chain_equal_to_the_model(tmp_path):
    harness = Harness(tmp_path / "chain", np.random.default_rng(22))
    try:
        harness.mine([(w, "register", (), ETHER + i) for i, w in enumerate(harness.workers)])
        for _ in range(BLOCKS):
            aimed = harness.advance() if harness.rng.random() < 0.15 else []
            harness.mine(aimed + [harness.call() for _ in range(harness.rng.integers(1, 4))])
        print("transactions:", dict(harness.kinds))
        print("outcomes:", dict(harness.outcomes))
        print("events:", dict(harness.events))
        print("at a deadline or window end:", dict(harness.boundaries))
        harness.compare()
    finally:
        harness.close()
    # the run reached every outcome the rules have
    assert all(harness.outcomes[fn, "ok"] and harness.outcomes[fn, "revert"] for fn in (
        "submitJob", "submitJobs", "cancel", "register", "requestWithdraw", "withdraw",
        "claimJob", "commitResult", "commitJobs", "finalize", "reopenExpired"))
    assert min(harness.events.values()) >= 5 and len(harness.events) == len(EVENTS)
    assert len(harness.boundaries) >= 8  # most of (function, -1/0/+1 block from its edge)
