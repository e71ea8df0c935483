"""Review of the market contract (ComputeMarket.vy) against docs/protocol.md: what a client
that reads only the contract's events can know, batch calls given repeated, unknown and
mismatched arguments, and a withdrawal raced by a top-up in one block. A real node sealed
block by block (test_market_review's `Market`, whose `mine` checks conservation and
`balance == totalEscrow + totalStaked + totalOwed` after every block).
"""
from collections import Counter

import numpy as np
import pytest
from test_market_review import ETHER, FEE, Market, names, operands, reward

pytestmark = pytest.mark.timeout(120)
OPEN, CLAIMED, COMMITTED, DONE, CANCELLED = 1, 2, 3, 4, 5
LIVE = (CLAIMED, COMMITTED)
ZERO_ADDRESS, ZERO_ID = "0x" + "00" * 20, b"\0" * 32


@pytest.fixture
def market(tmp_path):
    made = Market(tmp_path / "chain")
    yield made
    made.close()


class EventMirror:
    """Every job's getJob answer and every worker's workerInfo, rebuilt from the market's
    events alone, as a client following the chain does (docs/protocol.md, Events)."""

    def __init__(self):
        self.jobs: dict[int, dict] = {}
        self.workers: dict[str, list[int]] = {}  # address: [stake, withdrawBlock, claims]

    def worker(self, address: str) -> list[int]:
        return self.workers.setdefault(address.lower(), [0, 0, 0])

    def apply(self, name: str, args: dict, block: int) -> None:
        job = self.jobs.get(args.get("jobId"))
        if name == "JobSubmitted":
            self.jobs[args["jobId"]] = {
                "submitter": args["submitter"].lower(), "worker": ZERO_ADDRESS, "status": OPEN,
                "aId": args["aId"], "bId": args["bId"], "cId": ZERO_ID, "batch": args["batch"],
                "m": args["m"], "k": args["k"], "n": args["n"], "precision": args["precision"],
                "fee": args["fee"], "deadline": 0, "commitBlock": 0,
                "timeoutBlocks": args["timeoutBlocks"]}
        elif name == "JobClaimed":
            assert job["status"] == OPEN
            job.update(status=CLAIMED, worker=args["worker"].lower(), deadline=args["deadline"])
            self.worker(args["worker"])[2] += 1
        elif name == "ResultCommitted":
            assert job["status"] == CLAIMED and job["worker"] == args["worker"].lower()
            job.update(status=COMMITTED, cId=args["cId"], commitBlock=block)
        elif name in ("JobVerified", "JobCancelled", "JobReopened"):
            if job["status"] in LIVE:
                self.worker(job["worker"])[2] -= 1
            if name == "JobVerified":
                assert args["fee"] == job["fee"] and args["worker"].lower() == job["worker"]
                assert args["flops"] == 2 * job["batch"] * job["m"] * job["k"] * job["n"]
                job["status"] = DONE
            elif name == "JobCancelled":
                job["status"] = CANCELLED
            else:
                job.update(status=OPEN, worker=ZERO_ADDRESS, cId=ZERO_ID, deadline=0,
                           commitBlock=0)
        elif name == "JobFailed":
            assert job["status"] in LIVE and args["worker"].lower() == job["worker"]
            self.worker(args["worker"])[0] -= args["slashed"]
        elif name == "WorkerRegistered":
            self.worker(args["worker"])[:2] = [args["stake"], 0]
        elif name == "WithdrawRequested":
            self.worker(args["worker"])[1] = args["availableBlock"]
        elif name == "Withdrawn":
            stake, _, claims = self.worker(args["worker"])
            assert args["amount"] == stake and claims == 0
            self.workers[args["worker"].lower()] = [0, 0, 0]
        else:
            raise AssertionError(f"an event the mirror does not know: {name} {args}")


def test_the_market_events_alone_rebuild_every_job_and_worker(market):
    """Random transactions, many invalid and several racing in one block, by EOAs and by
    contract wallets that refuse send's stipend (their payments owed); after every block
    the jobs and workers rebuilt from the events equal getJob and workerInfo, and escrow
    and stakes add up from them."""
    rng = np.random.default_rng(24)
    eoas, deployer = market.accounts[:6], market.accounts[8]
    wallets = [market.deploy_wallet(deployer) for _ in range(2)]
    workers, submitters = [*eoas[:3], wallets[0]], [*eoas[3:], wallets[1]]
    address = {a: (a if isinstance(a, str) else a.address).lower() for a in workers + submitters}
    ops = [operands(market) for _ in range(2)]
    results = {a_id: (c_id, wrong) for a_id, _, c_id, wrong in ops}
    mirror = EventMirror()

    def tx(actor, fn, *args, value=0):
        if isinstance(actor, str):
            return market.through(deployer, actor, fn, *args, value=value)
        return actor.raw(fn, *args, value=value)

    def pick(*statuses):
        live = [i for i, job in mirror.jobs.items() if job["status"] in statuses]
        return int(rng.choice(live)) if live and rng.random() < 0.85 \
            else int(rng.integers(0, len(mirror.jobs) + 2))

    def result(job_id):
        job = mirror.jobs.get(job_id)
        c_id, wrong = results.get(job["aId"] if job else b"", (b"\3" * 32,) * 2)
        return c_id if rng.random() < 0.75 else wrong

    def claimant(job_id):
        job = mirror.jobs.get(job_id)
        owner = [w for w in workers if job and address[w] == job["worker"]]
        return owner[0] if owner and rng.random() < 0.9 else workers[rng.integers(len(workers))]

    def random_call():
        worker, submitter = workers[rng.integers(len(workers))], \
            submitters[rng.integers(len(submitters))]
        action = rng.integers(11)
        if action == 0:
            a_id, b_id, _, _ = ops[rng.integers(len(ops))]
            a_id = a_id if rng.random() < 0.85 else b"\7" * 32  # A missing: bad operands
            return tx(submitter, "submitJob", a_id, b_id, 1, 4, 3, 2, 1,
                      int(rng.integers(1, 4)), value=int(rng.choice([0, FEE])))
        if action == 1:
            return tx(worker, "claimJob", pick(OPEN))
        if action == 2:
            job = pick(CLAIMED)
            return tx(claimant(job), "commitResult", job, result(job))
        if action == 3:
            chosen = [pick(OPEN) for _ in range(int(rng.integers(1, 4)))]
            return tx(worker, "commitJobs", chosen, [result(j) for j in chosen])
        if action == 4:
            return tx(submitter, "finalizeJobs", [pick(COMMITTED), pick(COMMITTED)])
        if action == 5:
            return tx(worker, "finalize", pick(COMMITTED))
        if action == 6:
            return tx(submitter, "reopenExpired", pick(CLAIMED, COMMITTED))
        if action == 7:
            job = pick(OPEN)
            mine = [s for s in submitters if mirror.jobs.get(job, {}).get("submitter")
                    == address[s]]
            return tx(mine[0] if mine else submitter, "cancel", job)
        if action == 8:
            return tx(worker, str(rng.choice(["requestWithdraw", "withdraw"])))
        if action == 9:
            return tx(worker, "register", value=int(rng.choice([0, ETHER // 3, ETHER])))
        return tx(rng.choice([worker, submitter]), "claimOwed")

    seen = Counter()

    def mined(*raws) -> None:
        """Seal a block with these transactions and mirror its events."""
        for receipt in market.mine(*raws):
            for name, args in receipt["events"]:
                assert name != "foreign", "a market call logged another contract's event"
                mirror.apply(name, args, market.block)
                seen[name] += 1

    mined(*[tx(w, "register", value=ETHER + 7 * i) for i, w in enumerate(workers)])
    for _ in range(90):
        mined(*[random_call() for _ in range(rng.integers(2, 6))])
        for job_id, job in mirror.jobs.items():
            assert market.job(job_id) == job, f"job {job_id}"
        for actor in workers:
            checksummed = actor if isinstance(actor, str) else actor.address
            assert list(market.view("workerInfo", checksummed)) == \
                mirror.worker(address[actor]), checksummed
        assert market.view("jobCount") == len(mirror.jobs)
        assert market.view("totalEscrow") == sum(
            j["fee"] for j in mirror.jobs.values() if j["status"] not in (DONE, CANCELLED))
        assert market.view("totalStaked") == sum(w[0] for w in mirror.workers.values())
    # every event of the contract was mirrored
    assert len(seen) == 10 and sum(seen.values()) > 100, seen
    assert market.view("totalOwed") > 0  # the wallets' refused payments were among them


def test_batch_calls_act_once_per_job_whatever_the_list(market):
    """commitJobs and finalizeJobs given a job twice, an id that does not exist and one far
    out of range commit, pay and slash each job once; lists of different lengths are
    refused whichever list is the odd one."""
    submitter, worker, anyone = market.accounts[:3]
    a_id, b_id, c_id, wrong = operands(market)
    market.mine(worker.raw("register", value=ETHER),
                *[submitter.raw("submitJob", a_id, b_id, 1, 4, 3, 2, 1, 5, value=FEE)
                  for _ in range(2)])
    far = 2**256 - 1
    [commit] = market.mine(worker.raw("commitJobs", [0, 0, 7, far, 1, 1],
                                      [c_id, wrong, c_id, c_id, wrong, c_id]))
    assert names(commit) == ["JobClaimed", "ResultCommitted"] * 2
    assert (market.job(0)["cId"], market.job(1)["cId"]) == (c_id, wrong)  # the first wins
    assert market.claims(worker) == 2
    paid = market.balance(worker.address)
    [final] = market.mine(anyone.raw("finalizeJobs", [1, 0, 1, far, 0, 7]))
    assert names(final) == ["JobFailed", "JobReopened", "JobVerified"]
    assert dict(final["events"])["JobFailed"]["slashed"] == ETHER // 2  # slashed once
    assert market.view("workerStake", worker.address) == ETHER // 2
    # the fee once, the block reward once
    assert market.balance(worker.address) == paid + FEE + reward(2 * 4 * 3 * 2)
    assert market.claims(worker) == 0 and market.view("totalEscrow") == FEE

    columns = [[a_id], [b_id], [1], [4], [3], [2], [1], [FEE]]
    for odd in range(1, len(columns)):
        args = [c * 2 if i == odd else c for i, c in enumerate(columns)]
        market.refused(submitter, "submitJobs", *args, 5, value=FEE, reason="length mismatch")
    market.refused(worker, "commitJobs", [1], [], reason="length mismatch")
    assert market.view("jobCount") == 2

    # a job whose check needs more gas than a block has is not skipped: the call reverts
    top = 2**32 - 1
    market.mine(submitter.raw("submitJob", a_id, b_id, top, top, top, top, 1, 5))
    market.mine(worker.raw("register", value=ETHER), worker.raw("commitJobs", [1, 2], [c_id] * 2))
    market.refused(anyone, "finalizeJobs", [1, 2], reason="verification did not complete")
    assert market.job(1)["status"] == market.job(2)["status"] == COMMITTED


def test_a_withdrawal_and_a_top_up_in_one_block_either_order(market):
    """withdraw then register in one block: the stake is paid out and a fresh one opened;
    register then withdraw: the top-up cancels the withdrawal, which then reverts. Either
    way the books hold (checked by mine) and the events give the stake. A second
    withdrawal request starts the cooldown again (docs/protocol.md)."""
    first, second = market.accounts[3:5]
    market.mine(first.raw("register", value=ETHER), second.raw("register", value=ETHER))
    market.mine(first.raw("requestWithdraw"), second.raw("requestWithdraw"))
    market.empty_blocks(market.block + 4)
    [again] = market.mine(second.raw("requestWithdraw"))  # starts the cooldown again
    assert dict(again["events"])["WithdrawRequested"]["availableBlock"] == market.block + 5
    market.refused(second, "withdraw", reason="cooldown not over")
    out, back = market.mine(first.raw("withdraw"), first.raw("register", value=2 * ETHER))
    assert names(out) == ["Withdrawn"] and dict(out["events"])["Withdrawn"]["amount"] == ETHER
    assert dict(back["events"])["WorkerRegistered"]["stake"] == 2 * ETHER
    assert market.view("workerInfo", first.address) == (2 * ETHER, 0, 0)
    market.empty_blocks(market.block + 3)  # second's restarted cooldown is over
    topped, refused = market.mine(second.raw("register", value=ETHER // 2),
                                  second.raw("withdraw"))
    assert (topped["status"], refused["status"]) == (1, 0)
    assert market.view("workerInfo", second.address) == (ETHER + ETHER // 2, 0, 0)
    assert market.view("totalStaked") == 3 * ETHER + ETHER // 2
