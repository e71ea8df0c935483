# pragma version ~=0.4.3
"""
@title ComputeMarket
@notice A market for matmul jobs whose results are checked on chain by the
        Freivalds precompile before the worker is paid.
@dev Pre-deployed in genesis (no constructor state: parameters are constants).
     Invariant: self.balance == totalEscrow + totalStaked + totalOwed.
     Payments to others (fees, refunds, slashes) are sent last, with send's 2300-gas
     stipend; one the recipient refuses is owed to it instead (claimOwed), so no recipient
     can block a job's progress.
"""

# Job status codes (shared with clients, see docs/protocol.md); 0 means no such job.
OPEN: constant(uint8) = 1
CLAIMED: constant(uint8) = 2
COMMITTED: constant(uint8) = 3
DONE: constant(uint8) = 4
CANCELLED: constant(uint8) = 5

# Precompile verdicts.
VERDICT_FAIL: constant(uint256) = 0
VERDICT_PASS: constant(uint256) = 1
VERDICT_BAD_OPERANDS: constant(uint256) = 2

FREIVALDS: constant(address) = 0x00000000000000000000000000000000000000f1
REWARD_POOL: constant(address) = 0x0000000000000000000000000000000000000FEE
MIN_STAKE: constant(uint256) = 10**18
WITHDRAW_COOLDOWN: constant(uint256) = 5
FAIL_SLASH_BPS: constant(uint256) = 5000
LATE_SLASH_BPS: constant(uint256) = 1000
VERIFY_ROUNDS: constant(uint256) = 8  # float classes: an error above twice the bound passes w.p. <= 2^-8
EXACT_ROUNDS: constant(uint256) = 1  # exact class: a wrong result passes w.p. <= 1/p < 2^-60
MAX_TIMEOUT_BLOCKS: constant(uint64) = 100000
MAX_BATCH_JOBS: constant(uint256) = 256
MAX_DIM: constant(uint64) = 2**32 - 1
MAX_FEE: constant(uint256) = 2**88 - 1
MASK32: constant(uint256) = 2**32 - 1
MASK40: constant(uint256) = 2**40 - 1
MASK160: constant(uint256) = 2**160 - 1
BLOCKHASH_WINDOW: constant(uint256) = 256


struct Job:
    submitter: address
    worker: address
    status: uint8
    aId: bytes32
    bId: bytes32
    cId: bytes32
    batch: uint64
    m: uint64
    k: uint64
    n: uint64
    precision: uint8
    timeoutBlocks: uint64
    fee: uint256
    deadline: uint256
    commitBlock: uint256


# A job is stored packed in few slots: on py-evm, storage-trie writes dominate the cost
# of a transaction, and submitJob writes only meta, params, aId and bId.
struct StoredJob:
    meta: uint256    # submitter | status << 160 | deadline << 168 | commitBlock << 208
    params: uint256  # batch | m << 32 | k << 64 | n << 96 | precision << 128
                     # | timeoutBlocks << 136 | fee << 168
    aId: bytes32
    bId: bytes32
    worker: address
    cId: bytes32


struct Worker:
    stake: uint256
    withdrawBlock: uint256
    activeClaims: uint256


event WorkerRegistered:
    worker: indexed(address)
    stake: uint256

event WithdrawRequested:
    worker: indexed(address)
    availableBlock: uint256

event Withdrawn:
    worker: indexed(address)
    amount: uint256

event JobSubmitted:
    jobId: indexed(uint256)
    submitter: indexed(address)
    aId: bytes32
    bId: bytes32
    batch: uint64
    m: uint64
    k: uint64
    n: uint64
    precision: uint8
    fee: uint256
    timeoutBlocks: uint64  # a worker's blocks from its claim: known before it claims

event JobClaimed:
    jobId: indexed(uint256)
    worker: indexed(address)
    deadline: uint256

event ResultCommitted:
    jobId: indexed(uint256)
    worker: indexed(address)
    cId: bytes32

event JobVerified:
    jobId: indexed(uint256)
    worker: indexed(address)
    fee: uint256
    flops: uint256

event JobFailed:
    jobId: indexed(uint256)
    worker: indexed(address)
    slashed: uint256

event JobReopened:
    jobId: indexed(uint256)

event JobCancelled:
    jobId: indexed(uint256)


jobs: HashMap[uint256, StoredJob]
workers: HashMap[address, Worker]
jobCount: public(uint256)
totalEscrow: public(uint256)
totalStaked: public(uint256)
owed: public(HashMap[address, uint256])
totalOwed: public(uint256)


@external
@view
def minStake() -> uint256:
    return MIN_STAKE


@external
@view
def withdrawCooldown() -> uint256:
    return WITHDRAW_COOLDOWN


@external
@view
def rewardPool() -> address:
    return REWARD_POOL


@external
@view
def workerStake(worker: address) -> uint256:
    return self.workers[worker].stake


@external
@view
def workerInfo(worker: address) -> (uint256, uint256, uint256):
    w: Worker = self.workers[worker]
    return w.stake, w.withdrawBlock, w.activeClaims


@internal
@view
def _load(jobId: uint256) -> Job:
    s: StoredJob = self.jobs[jobId]
    return Job(
        submitter=convert(convert(s.meta & MASK160, uint160), address),
        worker=s.worker,
        status=convert((s.meta >> 160) & 255, uint8),
        aId=s.aId,
        bId=s.bId,
        cId=s.cId,
        batch=convert(s.params & MASK32, uint64),
        m=convert((s.params >> 32) & MASK32, uint64),
        k=convert((s.params >> 64) & MASK32, uint64),
        n=convert((s.params >> 96) & MASK32, uint64),
        precision=convert((s.params >> 128) & 255, uint8),
        timeoutBlocks=convert((s.params >> 136) & MASK32, uint64),
        fee=s.params >> 168,
        deadline=(s.meta >> 168) & MASK40,
        commitBlock=(s.meta >> 208) & MASK40,
    )


@internal
def _storeMeta(jobId: uint256, j: Job):
    """Write submitter, status, deadline and commitBlock (one slot)."""
    self.jobs[jobId].meta = convert(convert(j.submitter, uint160), uint256) \
        | convert(j.status, uint256) << 160 | j.deadline << 168 | j.commitBlock << 208


@external
@view
def getJob(jobId: uint256) -> (
    address, address, uint8, bytes32, bytes32, bytes32, uint64, uint64, uint64, uint64,
    uint8, uint256, uint256, uint256, uint64
):
    j: Job = self._load(jobId)
    return (
        j.submitter, j.worker, j.status, j.aId, j.bId, j.cId, j.batch, j.m, j.k, j.n,
        j.precision, j.fee, j.deadline, j.commitBlock, j.timeoutBlocks
    )


@internal
@pure
def _flops(j: Job) -> uint256:
    return 2 * convert(j.batch, uint256) * convert(j.m, uint256) * convert(j.k, uint256) \
        * convert(j.n, uint256)


@internal
def _payCaller(amount: uint256):
    """Pay msg.sender with all the remaining gas (a contract wallet may need more than
    send's stipend); state is final before the call. Reverts if the caller refuses."""
    if amount > 0:
        raw_call(msg.sender, b"", value=amount)


@internal
def _pay(recipient: address, amount: uint256):
    """Pay someone other than the caller with send's 2300-gas stipend (no reentrancy, no
    gas griefing). A recipient that refuses (a contract that reverts or needs more gas)
    cannot make the transaction revert: the amount is owed to it (owed(recipient)), for
    claimOwed()."""
    if amount == 0:
        return
    if not raw_call(recipient, b"", value=amount, gas=0, revert_on_failure=False):
        self.owed[recipient] += amount
        self.totalOwed += amount


@external
def claimOwed():
    """Collect the payments this account refused (see _pay)."""
    amount: uint256 = self.owed[msg.sender]
    assert amount > 0, "nothing owed"
    self.owed[msg.sender] = 0
    self.totalOwed -= amount
    self._payCaller(amount)


@external
@payable
def register():
    """Stake msg.value (tops up an existing stake; cancels a pending withdrawal)."""
    w: Worker = self.workers[msg.sender]
    w.stake += msg.value
    assert w.stake >= MIN_STAKE, "stake below minStake"
    w.withdrawBlock = 0
    self.workers[msg.sender] = w
    self.totalStaked += msg.value
    log WorkerRegistered(worker=msg.sender, stake=w.stake)


@external
def requestWithdraw():
    assert self.workers[msg.sender].stake > 0, "no stake"
    available: uint256 = block.number + WITHDRAW_COOLDOWN
    self.workers[msg.sender].withdrawBlock = available
    log WithdrawRequested(worker=msg.sender, availableBlock=available)


@external
def withdraw():
    w: Worker = self.workers[msg.sender]
    assert w.withdrawBlock != 0, "no withdrawal requested"
    assert block.number >= w.withdrawBlock, "withdraw cooldown not over"
    assert w.activeClaims == 0, "worker has active claims"
    amount: uint256 = w.stake
    self.workers[msg.sender] = empty(Worker)
    self.totalStaked -= amount
    log Withdrawn(worker=msg.sender, amount=amount)
    self._payCaller(amount)


@internal
def _submit(
    aId: bytes32, bId: bytes32, batch: uint64, m: uint64, k: uint64, n: uint64,
    precision: uint8, timeoutBlocks: uint64, fee: uint256
) -> uint256:
    # one comparison instead of four short-circuit branches (it runs for every job)
    assert batch > 0 and m > 0 and k > 0 and n > 0, "empty shape"
    assert batch | m | k | n <= MAX_DIM, "dim above 2**32-1"
    assert precision <= 3, "unknown precision class"
    assert timeoutBlocks > 0 and timeoutBlocks <= MAX_TIMEOUT_BLOCKS, "bad timeoutBlocks"
    assert fee <= MAX_FEE, "fee above 2**88-1"
    jobId: uint256 = self.jobCount
    self.jobCount = jobId + 1
    self.jobs[jobId].meta = convert(convert(msg.sender, uint160), uint256) \
        | convert(OPEN, uint256) << 160
    self.jobs[jobId].params = convert(batch, uint256) | convert(m, uint256) << 32 \
        | convert(k, uint256) << 64 | convert(n, uint256) << 96 \
        | convert(precision, uint256) << 128 | convert(timeoutBlocks, uint256) << 136 | fee << 168
    self.jobs[jobId].aId = aId
    self.jobs[jobId].bId = bId
    log JobSubmitted(
        jobId=jobId, submitter=msg.sender, aId=aId, bId=bId, batch=batch, m=m, k=k, n=n,
        precision=precision, fee=fee, timeoutBlocks=timeoutBlocks
    )
    return jobId


@external
@payable
def submitJob(
    aId: bytes32, bId: bytes32, batch: uint64, m: uint64, k: uint64, n: uint64,
    precision: uint8, timeoutBlocks: uint64
) -> uint256:
    """Open a job; msg.value is the fee, held in escrow until the job ends."""
    self.totalEscrow += msg.value
    return self._submit(aId, bId, batch, m, k, n, precision, timeoutBlocks, msg.value)


@external
@payable
def submitJobs(
    aIds: DynArray[bytes32, MAX_BATCH_JOBS], bIds: DynArray[bytes32, MAX_BATCH_JOBS],
    batches: DynArray[uint64, MAX_BATCH_JOBS], ms: DynArray[uint64, MAX_BATCH_JOBS],
    ks: DynArray[uint64, MAX_BATCH_JOBS], ns: DynArray[uint64, MAX_BATCH_JOBS],
    precisions: DynArray[uint8, MAX_BATCH_JOBS], fees: DynArray[uint256, MAX_BATCH_JOBS],
    timeoutBlocks: uint64
) -> uint256:
    """Open many jobs in one transaction; returns the first job id (ids are consecutive)."""
    count: uint256 = len(aIds)
    assert count > 0, "no jobs"
    assert len(bIds) == count and len(batches) == count and len(ms) == count, "length mismatch"
    assert len(ks) == count and len(ns) == count and len(precisions) == count, "length mismatch"
    assert len(fees) == count, "length mismatch"
    total: uint256 = 0
    first: uint256 = self.jobCount
    for i: uint256 in range(count, bound=MAX_BATCH_JOBS):
        total += fees[i]
        self._submit(
            aIds[i], bIds[i], batches[i], ms[i], ks[i], ns[i], precisions[i], timeoutBlocks,
            fees[i]
        )
    assert total == msg.value, "fees do not sum to msg.value"
    self.totalEscrow += total
    return first


@external
def claimJob(jobId: uint256):
    w: Worker = self.workers[msg.sender]
    assert w.stake >= MIN_STAKE, "worker stake below minStake"
    assert w.withdrawBlock == 0, "worker is withdrawing"
    j: Job = self._load(jobId)
    assert j.status == OPEN, "job not open"
    deadline: uint256 = block.number + convert(j.timeoutBlocks, uint256)
    j.status = CLAIMED
    j.deadline = deadline
    self._storeMeta(jobId, j)
    self.jobs[jobId].worker = msg.sender
    self.workers[msg.sender].activeClaims = w.activeClaims + 1
    log JobClaimed(jobId=jobId, worker=msg.sender, deadline=deadline)


@external
def commitResult(jobId: uint256, cId: bytes32):
    j: Job = self._load(jobId)
    assert j.status == CLAIMED, "job not claimed"
    assert j.worker == msg.sender, "not the claimant"
    assert block.number <= j.deadline, "deadline passed"
    j.status = COMMITTED
    j.commitBlock = block.number
    self._storeMeta(jobId, j)
    self.jobs[jobId].cId = cId
    log ResultCommitted(jobId=jobId, worker=msg.sender, cId=cId)


@external
def commitJobs(
    jobIds: DynArray[uint256, MAX_BATCH_JOBS], cIds: DynArray[bytes32, MAX_BATCH_JOBS]
) -> uint256:
    """Claim and commit open jobs in one step, for a worker that computed them before
    claiming (small jobs: one transaction instead of two). A job that is no longer open
    (another worker was first) is skipped; returns how many were committed. The commit is
    the same as commitResult's: same stake rules, finalized from the next block on."""
    assert len(cIds) == len(jobIds), "length mismatch"
    w: Worker = self.workers[msg.sender]
    assert w.stake >= MIN_STAKE, "worker stake below minStake"
    assert w.withdrawBlock == 0, "worker is withdrawing"
    committed: uint256 = 0
    for i: uint256 in range(len(jobIds), bound=MAX_BATCH_JOBS):
        j: Job = self._load(jobIds[i])
        if j.status != OPEN:
            continue
        j.status = COMMITTED
        j.deadline = block.number
        j.commitBlock = block.number
        self._storeMeta(jobIds[i], j)
        self.jobs[jobIds[i]].worker = msg.sender
        self.jobs[jobIds[i]].cId = cIds[i]
        committed += 1
        log JobClaimed(jobId=jobIds[i], worker=msg.sender, deadline=block.number)
        log ResultCommitted(jobId=jobIds[i], worker=msg.sender, cId=cIds[i])
    self.workers[msg.sender].activeClaims = w.activeClaims + committed
    return committed


@internal
def _reopen(jobId: uint256, j: Job):
    j.status = OPEN
    j.deadline = 0
    j.commitBlock = 0
    self._storeMeta(jobId, j)
    self.jobs[jobId].worker = empty(address)
    self.jobs[jobId].cId = empty(bytes32)
    log JobReopened(jobId=jobId)


@internal
def _slash(worker: address, bps: uint256) -> uint256:
    """Take bps/10000 of the stake (paid out by _paySlash once the job's state is final)."""
    amount: uint256 = self.workers[worker].stake * bps // 10000
    self.workers[worker].stake -= amount
    self.totalStaked -= amount
    return amount


@internal
def _paySlash(amount: uint256, submitter: address):
    """Half of a failed result's slash to the submitter, the rest to the reward pool."""
    self._pay(submitter, amount // 2)
    self._pay(REWARD_POOL, amount - amount // 2)


@internal
def _finalize(jobId: uint256, j: Job):
    seed: bytes32 = keccak256(concat(blockhash(j.commitBlock), convert(jobId, bytes32)))
    rounds: uint256 = VERIFY_ROUNDS
    if j.precision == 0:
        rounds = EXACT_ROUNDS
    payload: Bytes[320] = abi_encode(
        j.aId, j.bId, j.cId, j.batch, j.m, j.k, j.n, j.precision, rounds, seed
    )
    ok: bool = False
    out: Bytes[32] = b""
    ok, out = raw_call(FREIVALDS, payload, max_outsize=32, revert_on_failure=False)
    assert ok and len(out) == 32, "verification did not complete (out of gas?)"
    verdict: uint256 = convert(out, uint256)
    self.workers[j.worker].activeClaims -= 1
    if verdict == VERDICT_PASS:
        j.status = DONE
        self._storeMeta(jobId, j)
        self.totalEscrow -= j.fee
        log JobVerified(jobId=jobId, worker=j.worker, fee=j.fee, flops=self._flops(j))
        self._pay(j.worker, j.fee)
    elif verdict == VERDICT_BAD_OPERANDS:
        j.status = CANCELLED
        self._storeMeta(jobId, j)
        self.totalEscrow -= j.fee
        log JobCancelled(jobId=jobId)
        self._pay(j.submitter, j.fee)
    else:
        slashed: uint256 = self._slash(j.worker, FAIL_SLASH_BPS)
        log JobFailed(jobId=jobId, worker=j.worker, slashed=slashed)
        self._reopen(jobId, j)
        self._paySlash(slashed, j.submitter)


@external
def finalize(jobId: uint256):
    """Verify a committed result with the Freivalds precompile; pay or slash."""
    j: Job = self._load(jobId)
    assert j.status == COMMITTED, "job not committed"
    assert block.number > j.commitBlock, "finalize must wait one block after the commit"
    assert block.number <= j.commitBlock + BLOCKHASH_WINDOW, "commit too old; reopenExpired"
    self._finalize(jobId, j)


@external
def finalizeJobs(jobIds: DynArray[uint256, MAX_BATCH_JOBS]) -> uint256:
    """finalize for many jobs in one transaction; a job that cannot be finalized now (not
    committed, already finalized by someone else, committed in this block, or too old) is
    skipped. Returns how many were finalized."""
    done: uint256 = 0
    for jobId: uint256 in jobIds:
        j: Job = self._load(jobId)
        if j.status != COMMITTED or block.number <= j.commitBlock \
                or block.number > j.commitBlock + BLOCKHASH_WINDOW:
            continue
        self._finalize(jobId, j)
        done += 1
    return done


@external
def reopenExpired(jobId: uint256):
    """Reopen a claim that missed its deadline (stake cut) or a commit left unfinalised."""
    j: Job = self._load(jobId)
    slashed: uint256 = 0
    if j.status == CLAIMED:
        assert block.number > j.deadline, "deadline not passed"
        slashed = self._slash(j.worker, LATE_SLASH_BPS)
        log JobFailed(jobId=jobId, worker=j.worker, slashed=slashed)
    else:
        assert j.status == COMMITTED, "job not claimed or committed"
        assert block.number > j.commitBlock + BLOCKHASH_WINDOW, "commit can still be finalized"
    self.workers[j.worker].activeClaims -= 1
    self._reopen(jobId, j)
    # all of a late cut to the pool: a submitter paid half of it gained by every claim that
    # expired, and could make any expire (a one-block timeout, or blocks sealed on demand)
    self._pay(REWARD_POOL, slashed)


@external
def cancel(jobId: uint256):
    j: Job = self._load(jobId)
    assert j.submitter == msg.sender, "not the submitter"
    assert j.status == OPEN, "job not open"
    j.status = CANCELLED
    self._storeMeta(jobId, j)
    self.totalEscrow -= j.fee
    log JobCancelled(jobId=jobId)
    self._payCaller(j.fee)
