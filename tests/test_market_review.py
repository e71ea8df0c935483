"""The market's rules (docs/protocol.md) under adversarial sequences of real signed
transactions: an in-process node sealed block by block, so every boundary (deadlines, the
finalisation window, cooldowns) is hit on the exact block.

After every sealed block the books are checked: the market holds exactly its escrow, stakes
and the payments it owes (`totalEscrow + totalStaked + totalOwed`), and the sum of all
balances changed only by the burned base fees. Transactions tip nothing, so the reward pool
moves only by slashes and block rewards and every balance change can be predicted exactly.
"""
import numpy as np
import pytest
import vyper
from eth_abi import decode as abi_decode
from eth_hash.auto import keccak
from eth_utils import ValidationError, to_canonical_address, to_checksum_address
from helpers import decode_log, events_by_topic
from web3 import Web3

from chain.blobs import encode_array
from chain.compile import compiled_market
from chain.devnet import dev_accounts
from chain.node import Node, NodeConfig
from chain.params import (
    CHAIN_ID,
    DEV_ACCOUNT_COUNT,
    MARKET_ADDRESS,
    REWARD_PER_GFLOP,
    REWARD_POOL_ADDRESS,
)
from chain.replay import replay
from chain.rpc import Rpc, RpcError
from chain.vm import PoUWVMBase

pytestmark = pytest.mark.timeout(60)
ETHER = 10**18
FEE = 10**15
MAX_FEE = 2**88 - 1
OPEN, CLAIMED, COMMITTED, DONE, CANCELLED = 1, 2, 3, 4, 5
ABI = compiled_market()["abi"]
MARKET = Web3().eth.contract(address=to_checksum_address(MARKET_ADDRESS), abi=ABI)
EVENTS = events_by_topic(ABI)
JOB_FIELDS = ("submitter", "worker", "status", "aId", "bId", "cId", "batch", "m", "k", "n",
              "precision", "fee", "deadline", "commitBlock", "timeoutBlocks")

# A contract account using the market (a multisig wallet, say): its receive hook writes
# storage, which send's 2300-gas stipend cannot pay for, as many real wallets' hooks do. Paid
# with more gas, it tries to be paid again (re-entering withdraw and claimOwed).
WALLET_SOURCE = """
# pragma version ~=0.4.3
MARKET: constant(address) = 0x000000000000000000000000000000000000c0DE
received: public(uint256)

@external
@payable
def execute(data: Bytes[1024]):
    raw_call(MARKET, data, value=msg.value)

@external
@payable
def __default__():
    self.received += msg.value
    if msg.gas > 100000:
        again: bool = raw_call(MARKET, method_id("withdraw()"), revert_on_failure=False)
        again = raw_call(MARKET, method_id("claimOwed()"), revert_on_failure=False)
"""


class Signer:
    """A dev account signing EIP-1559 transactions with no tip (nonces counted locally)."""

    def __init__(self, account):
        self.account, self.address, self.nonce = account, account.address, 0

    def raw(self, fn=None, *args, value=0, to=None, data=b"", gas=3_000_000,
            chain_id=CHAIN_ID) -> bytes:
        if fn is not None:
            data = MARKET.encode_abi(fn, args=list(args))
        tx = {"data": data, "value": value, "gas": gas, "maxFeePerGas": 10**10,
              "maxPriorityFeePerGas": 0, "nonce": self.nonce, "chainId": chain_id, "type": 2}
        if to != "create":
            tx["to"] = to or MARKET.address
        self.nonce += 1
        return self.account.sign_transaction(tx).raw_transaction


class Market:
    """A node driven block by block; every sealed block's books are checked."""

    def __init__(self, path):
        self.node = Node(NodeConfig(path, block_time=0, decode_process=False))
        self.rpc = Rpc(self.node)
        self.accounts = [Signer(a) for a in dev_accounts(DEV_ACCOUNT_COUNT)]
        self.contracts: list[str] = []
        self.supply = self.total_balance()

    def close(self):
        self.node.stop()

    @property
    def block(self) -> int:
        """The number of the last sealed block."""
        return self.node.head().block_number

    def mine(self, *raws) -> list[dict]:
        """Admit the raw transactions, seal one block with them (and any pending), check the
        books; the receipts (status as an int, logs decoded, the sender's gas cost)."""
        hashes = [self.node.admit(raw) for raw in raws]
        sealed = self.node.seal()
        assert set(hashes) <= {tx.hash for tx in sealed.transactions}
        receipts = [self.rpc.rpc_eth__getTransactionReceipt("0x" + h.hex()) for h in hashes]
        burned = sealed.header.gas_used * sealed.header.base_fee_per_gas
        supply = self.total_balance()
        assert supply == self.supply - burned, "balances changed by more than the burned fees"
        self.supply = supply
        assert self.balance(MARKET.address) == \
            self.view("totalEscrow") + self.view("totalStaked") + self.view("totalOwed")
        return [{"status": int(r["status"], 16), "events": [self._decode(e) for e in r["logs"]],
                 "contract": r["contractAddress"],
                 "cost": int(r["gasUsed"], 16) * int(r["effectiveGasPrice"], 16)}
                for r in receipts]

    def send(self, signer, fn, *args, value=0) -> dict:
        """One transaction alone in a block; it must succeed."""
        [receipt] = self.mine(signer.raw(fn, *args, value=value))
        assert receipt["status"] == 1, f"{fn}{args} reverted"
        return receipt

    def refused(self, signer, fn, *args, value=0, reason: str) -> None:
        """The call reverts with `reason` on top of the head, and so does the transaction
        mined alone in the next block (changing nothing but the sender's gas)."""
        with pytest.raises(RpcError, match=reason):
            self.rpc.rpc_eth__call({"from": signer.address, "to": MARKET.address,
                                    "value": hex(value),
                                    "data": MARKET.encode_abi(fn, args=list(args))})
        [receipt] = self.mine(signer.raw(fn, *args, value=value))
        assert receipt["status"] == 0 and receipt["events"] == []

    def empty_blocks(self, until: int) -> None:
        """Seal empty blocks until the last sealed block is `until`."""
        while self.block < until:
            self.mine()

    def view(self, fn, *args):
        out = self.rpc.rpc_eth__call({"to": MARKET.address,
                                      "data": MARKET.encode_abi(fn, args=list(args))})
        abi = next(e for e in ABI if e.get("name") == fn)
        values = abi_decode([o["type"] for o in abi["outputs"]], bytes.fromhex(out[2:]))
        return values[0] if len(values) == 1 else values

    def job(self, job_id: int) -> dict:
        return dict(zip(JOB_FIELDS, self.view("getJob", job_id), strict=True))

    def claims(self, worker) -> int:
        return self.view("workerInfo", worker.address)[2]

    def balance(self, address) -> int:
        return self.node.state_at().get_balance(to_canonical_address(address))

    def total_balance(self) -> int:
        addresses = [a.address for a in self.accounts] + self.contracts + \
            [MARKET.address, to_checksum_address(REWARD_POOL_ADDRESS)]
        return sum(self.balance(a) for a in addresses)

    def deploy_wallet(self, signer) -> str:
        code = vyper.compile_code(WALLET_SOURCE, output_formats=["bytecode"])["bytecode"]
        [receipt] = self.mine(signer.raw(data=bytes.fromhex(code[2:]), to="create"))
        assert receipt["status"] == 1
        self.contracts.append(to_checksum_address(receipt["contract"]))
        return self.contracts[-1]

    def through(self, signer, wallet: str, fn, *args, value=0) -> bytes:
        """A raw transaction from `signer` making `wallet` call the market."""
        data = MARKET.encode_abi(fn, args=list(args))
        calldata = keccak(b"execute(bytes)")[:4] + \
            Web3().codec.encode(["bytes"], [bytes.fromhex(data[2:])])
        return signer.raw(to=wallet, data=calldata, value=value)

    def received(self, wallet: str) -> int:
        out = self.rpc.rpc_eth__call({"to": wallet, "data": "0x" + keccak(b"received()")[:4].hex()})
        return int(out, 16)

    @staticmethod
    def _decode(log: dict) -> tuple:
        decoded = decode_log(log, EVENTS)
        if decoded is None or log["address"].lower() != MARKET.address.lower():
            return ("foreign", log["address"])
        return decoded


def names(receipt) -> list[str]:
    return [name for name, _ in receipt["events"]]


@pytest.fixture
def market(tmp_path):
    made = Market(tmp_path / "chain")
    yield made
    made.close()


RNG = np.random.default_rng(11)


def operands(market, m=4, k=3, n=2):
    """Float operands stored on the node; (aId, bId, right C's id, wrong C's id). The wrong
    C is off in one entry, which every +-1 vector catches: C + 1 everywhere passed a round
    whose two signs cancelled (n = 2), so the chain accepted it with probability 2^-rounds
    (1/32 here), and the tests that expect it failed now and then."""
    a, b = RNG.standard_normal((m, k), np.float32), RNG.standard_normal((k, n), np.float32)
    c = (a.astype(np.float64) @ b).astype(np.float32)
    wrong = c.copy()
    wrong[0, 0] += 1
    return tuple(market.node.blobs.put(encode_array(x)) for x in (a, b, c, wrong))


def reward(flops: int) -> int:
    return REWARD_PER_GFLOP * flops // 10**9


# --- one job, one payment ------------------------------------------------------------------
def test_a_job_is_claimed_once_paid_once_and_final(market):
    submitter, first, second, anyone = market.accounts[:4]
    a_id, b_id, c_id, _ = operands(market)
    market.mine(first.raw("register", value=ETHER), second.raw("register", value=ETHER),
                submitter.raw("submitJob", a_id, b_id, 1, 4, 3, 2, 1, 10, value=FEE))
    # two claims in one block: the first wins, the second reverts
    won, lost = market.mine(first.raw("claimJob", 0), second.raw("claimJob", 0))
    assert (won["status"], lost["status"]) == (1, 0)
    assert market.job(0)["worker"] == first.address.lower()
    assert (market.claims(first), market.claims(second)) == (1, 0)
    market.refused(second, "commitResult", 0, c_id, reason="not the claimant")
    market.refused(submitter, "cancel", 0, reason="job not open")
    # commitJobs skips a job another worker holds
    [skipped] = market.mine(second.raw("commitJobs", [0], [c_id]))
    assert skipped["status"] == 1 and skipped["events"] == []
    # the commit and a finalize in its own block: the seed's block is not sealed yet
    commit, early = market.mine(first.raw("commitResult", 0, c_id), anyone.raw("finalize", 0))
    assert (commit["status"], early["status"]) == (1, 0)
    [verified] = market.mine(anyone.raw("finalizeJobs", [0]))  # a later block: finalised
    assert names(verified) == ["JobVerified"]

    assert market.job(0)["status"] == DONE and market.claims(first) == 0
    assert market.view("totalEscrow") == 0
    for fn, args, reason in (("finalize", (0,), "job not committed"),
                             ("cancel", (0,), "job not open"),
                             ("reopenExpired", (0,), "job not claimed or committed"),
                             ("claimJob", (0,), "job not open"),
                             ("commitResult", (0, c_id), "job not claimed")):
        market.refused(first if fn in ("claimJob", "commitResult") else submitter, fn, *args,
                       reason=reason)
    paid = market.balance(first.address)
    for receipt in market.mine(anyone.raw("finalizeJobs", [0, 0]),
                               second.raw("commitJobs", [0], [c_id])):
        assert receipt["status"] == 1 and receipt["events"] == []
    assert market.balance(first.address) == paid  # no second payment
    assert market.job(0)["status"] == DONE


def test_worker_is_paid_the_fee_and_the_reward_exactly(market):
    submitter, worker, anyone = market.accounts[:3]
    a_id, b_id, c_id, _ = operands(market)
    market.mine(worker.raw("register", value=ETHER),
                submitter.raw("submitJob", a_id, b_id, 1, 4, 3, 2, 1, 10, value=FEE),
                submitter.raw("submitJob", a_id, b_id, 1, 4, 3, 2, 1, 10, value=0))
    market.send(worker, "commitJobs", [0, 1], [c_id, c_id])
    before = market.balance(worker.address), market.balance(submitter.address)
    receipt = market.send(anyone, "finalizeJobs", [0, 1])
    assert names(receipt) == ["JobVerified", "JobVerified"]  # a fee of 0 is a job like any
    flops = 2 * (2 * 4 * 3 * 2)
    assert market.balance(worker.address) - before[0] == FEE + reward(flops)
    assert market.balance(submitter.address) == before[1]


# --- cancelling ----------------------------------------------------------------------------
def test_only_the_submitter_cancels_and_only_an_open_job(market):
    submitter, worker, other = market.accounts[:3]
    a_id, b_id, _, _ = operands(market)
    market.mine(worker.raw("register", value=2 * ETHER),
                submitter.raw("submitJob", a_id, b_id, 1, 4, 3, 2, 1, 2, value=FEE))
    market.refused(other, "cancel", 0, reason="not the submitter")
    market.refused(other, "cancel", 7, reason="not the submitter")  # no such job
    claimed = market.send(worker, "claimJob", 0)
    market.refused(submitter, "cancel", 0, reason="job not open")
    deadline = dict(claimed["events"])["JobClaimed"]["deadline"]
    market.empty_blocks(deadline)
    market.send(other, "reopenExpired", 0)  # reopened: the submitter may cancel again
    before = market.balance(submitter.address)
    [receipt] = market.mine(submitter.raw("cancel", 0))
    assert names(receipt) == ["JobCancelled"]
    assert market.balance(submitter.address) == before + FEE - receipt["cost"]
    market.refused(submitter, "cancel", 0, reason="job not open")
    market.refused(worker, "claimJob", 0, reason="job not open")


# --- who may claim -------------------------------------------------------------------------
def test_unstaked_withdrawing_slashed_and_withdrawn_workers_cannot_claim(market):
    submitter, worker, stranger, anyone = market.accounts[:4]
    a_id, b_id, c_id, wrong = operands(market)
    market.mine(*[submitter.raw("submitJob", a_id, b_id, 1, 4, 3, 2, 1, 20, value=FEE)
                  for _ in range(4)])
    market.refused(stranger, "claimJob", 0, reason="stake below minStake")
    market.refused(stranger, "commitJobs", [0], [c_id], reason="stake below minStake")
    market.refused(stranger, "register", value=ETHER // 2, reason="stake below minStake")
    market.refused(stranger, "requestWithdraw", reason="no stake")
    market.refused(stranger, "withdraw", reason="no withdrawal requested")

    market.send(worker, "register", value=ETHER)
    market.send(worker, "claimJob", 0)
    requested = market.send(worker, "requestWithdraw")
    available = dict(requested["events"])["WithdrawRequested"]["availableBlock"]
    assert available == market.block + 5
    market.refused(worker, "claimJob", 1, reason="worker is withdrawing")
    market.refused(worker, "commitJobs", [1], [c_id], reason="worker is withdrawing")
    market.empty_blocks(available - 2)
    market.refused(worker, "withdraw", reason="cooldown not over")  # block available - 1
    market.refused(worker, "withdraw", reason="active claims")  # at `available`: the claim
    market.send(worker, "commitResult", 0, c_id)  # a withdrawing worker still finishes its job
    market.send(anyone, "finalize", 0)
    market.send(worker, "register")  # a top-up of nothing cancels the withdrawal
    assert market.view("workerInfo", worker.address)[1] == 0

    # a wrong result halves the stake: below minStake, no new claims, but its claims stand
    market.send(worker, "claimJob", 1)
    market.send(worker, "claimJob", 2)
    market.send(worker, "commitResult", 1, wrong)
    failed = market.send(anyone, "finalize", 1)
    assert names(failed) == ["JobFailed", "JobReopened"]
    assert market.view("workerStake", worker.address) == ETHER // 2
    market.refused(worker, "claimJob", 3, reason="stake below minStake")
    market.refused(worker, "commitJobs", [3], [c_id], reason="stake below minStake")
    market.send(worker, "commitResult", 2, c_id)
    market.send(anyone, "finalize", 2)
    assert market.job(2)["status"] == DONE

    # withdrawn: the whole remaining stake and not a wei more; then no stake, no claims
    market.send(worker, "requestWithdraw")
    market.empty_blocks(market.block + 4)
    before = market.balance(worker.address)
    [receipt] = market.mine(worker.raw("withdraw"))
    assert dict(receipt["events"])["Withdrawn"]["amount"] == ETHER // 2
    assert market.balance(worker.address) == before + ETHER // 2 - receipt["cost"]
    assert market.view("workerInfo", worker.address) == (0, 0, 0)
    market.refused(worker, "withdraw", reason="no withdrawal requested")
    market.refused(worker, "claimJob", 3, reason="stake below minStake")


# --- deadlines, to the block ---------------------------------------------------------------
def test_claim_deadline_is_inclusive_and_a_late_claim_costs_ten_percent(market):
    submitter, worker, anyone = market.accounts[:3]
    a_id, b_id, c_id, _ = operands(market)
    stake = 3 * ETHER + 7  # odd: the integer split is checked too
    market.mine(worker.raw("register", value=stake),
                *[submitter.raw("submitJob", a_id, b_id, 1, 4, 3, 2, 1, 3, value=FEE)
                  for _ in range(2)])
    market.mine(worker.raw("claimJob", 0), worker.raw("claimJob", 1))
    deadline = market.block + 3
    assert market.job(0)["deadline"] == market.job(1)["deadline"] == deadline
    market.empty_blocks(deadline - 1)
    # at the deadline: a commit is on time, the claim has not expired
    market.refused(anyone, "reopenExpired", 1, reason="deadline not passed")
    assert market.block == deadline
    # one block later (deadline + 1): too late to commit, expired
    pool, paid = market.balance(to_checksum_address(REWARD_POOL_ADDRESS)), \
        market.balance(submitter.address)
    late, reopened = market.mine(worker.raw("commitResult", 1, c_id),
                                 anyone.raw("reopenExpired", 1))
    assert market.block == deadline + 1
    assert (late["status"], reopened["status"]) == (0, 1)
    assert names(reopened) == ["JobFailed", "JobReopened"]
    cut = stake // 10
    assert dict(reopened["events"])["JobFailed"]["slashed"] == cut
    assert market.view("workerStake", worker.address) == stake - cut
    assert market.balance(submitter.address) == paid  # a late cut is the pool's alone
    assert market.balance(to_checksum_address(REWARD_POOL_ADDRESS)) - pool == cut
    assert market.job(1)["status"] == OPEN and market.claims(worker) == 1
    market.refused(anyone, "reopenExpired", 1, reason="job not claimed or committed")
    market.refused(worker, "commitResult", 0, c_id, reason="deadline passed")


def test_claim_committed_on_its_deadline_block_is_paid(market):
    submitter, worker, anyone = market.accounts[:3]
    a_id, b_id, c_id, _ = operands(market)
    market.mine(worker.raw("register", value=ETHER),
                submitter.raw("submitJob", a_id, b_id, 1, 4, 3, 2, 1, 1, value=FEE))
    market.send(worker, "claimJob", 0)
    assert market.job(0)["deadline"] == market.block + 1
    committed = market.send(worker, "commitResult", 0, c_id)  # the deadline block itself
    assert names(committed) == ["ResultCommitted"]
    market.refused(anyone, "reopenExpired", 0, reason="commit can still be finalized")
    assert names(market.send(anyone, "finalize", 0)) == ["JobVerified"]


def commit_right_and_wrong(market):
    """Jobs 0 (right C) and 1 (wrong C) committed in one block, then 255 empty blocks:
    (worker, a third account, the commit block)."""
    submitter, worker, anyone = market.accounts[:3]
    a_id, b_id, c_id, wrong = operands(market)
    market.mine(worker.raw("register", value=ETHER),
                *[submitter.raw("submitJob", a_id, b_id, 1, 4, 3, 2, 1, 5, value=FEE)
                  for _ in range(2)])
    market.send(worker, "commitJobs", [0, 1], [c_id, wrong])
    commit = market.block
    market.empty_blocks(commit + 255)
    return worker, anyone, commit


def test_finalisation_window_is_256_blocks_then_the_job_reopens_uncut(market):
    worker, anyone, commit = commit_right_and_wrong(market)
    # block commit + 256: the commit block is the oldest blockhash still available
    market.refused(anyone, "reopenExpired", 0, reason="commit can still be finalized")
    assert market.block == commit + 256
    # block commit + 257: the commit block's hash is gone; the job can only be reopened
    market.refused(anyone, "finalize", 1, reason="commit too old")
    market.refused(anyone, "reopenExpired", 5, reason="job not claimed or committed")
    [skipped] = market.mine(anyone.raw("finalizeJobs", [0, 1]))
    assert skipped["status"] == 1 and skipped["events"] == []
    stake = market.view("workerStake", worker.address)
    [receipt] = market.mine(anyone.raw("reopenExpired", 1))
    assert names(receipt) == ["JobReopened"]  # the wrong result is not slashed: no seed
    assert market.view("workerStake", worker.address) == stake and market.claims(worker) == 1
    assert market.job(1)["status"] == OPEN and market.view("totalEscrow") == 2 * FEE


def test_finalize_on_the_last_block_of_the_window_verifies(market):
    worker, anyone, commit = commit_right_and_wrong(market)
    right, failed = market.mine(anyone.raw("finalize", 0), anyone.raw("finalize", 1))
    assert market.block == commit + 256
    assert names(right) == ["JobVerified"]
    assert names(failed) == ["JobFailed", "JobReopened"]  # a real seed: the wrong C is caught


# --- payments a recipient refuses ----------------------------------------------------------
def test_a_recipient_refusing_payment_cannot_block_the_market(market):
    """A contract submitter or worker whose receive hook needs more than send's stipend (or
    reverts): its payments are owed to it, and the job goes on. It used to revert the
    transaction: an expired claim of such a submitter's job could never be reopened (the
    worker's stake locked for good), a wrong result could not be slashed, a right one not
    finalised, and a contract worker could never withdraw its stake."""
    deployer, worker, anyone = market.accounts[:3]
    submitter_wallet, worker_wallet = market.deploy_wallet(deployer), \
        market.deploy_wallet(deployer)
    a_id, b_id, c_id, wrong = operands(market)
    missing = b"\7" * 32
    market.mine(worker.raw("register", value=ETHER),
                market.through(deployer, worker_wallet, "register", value=2 * ETHER),
                market.through(deployer, submitter_wallet, "submitJob", a_id, b_id, 1, 4, 3, 2,
                               1, 2, value=FEE),
                market.through(deployer, submitter_wallet, "submitJob", missing, b_id, 1, 4, 3,
                               2, 1, 9, value=FEE),
                market.through(deployer, submitter_wallet, "submitJob", a_id, b_id, 1, 4, 3, 2,
                               1, 9, value=FEE),
                market.through(deployer, submitter_wallet, "submitJob", a_id, b_id, 1, 4, 3, 2,
                               1, 9, value=FEE))
    assert market.job(0)["submitter"] == submitter_wallet.lower()
    owed = 0

    # an EOA worker misses job 0's deadline: reopened (the cut is the pool's, none of it the
    # wallet's)
    market.send(worker, "claimJob", 0)
    market.empty_blocks(market.job(0)["deadline"])
    receipt = market.send(anyone, "reopenExpired", 0)
    assert names(receipt) == ["JobFailed", "JobReopened"]
    assert market.claims(worker) == 0 and market.view("owed", submitter_wallet) == owed == 0

    # job 1's A is missing: cancelled, the refund owed
    market.mine(market.through(deployer, worker_wallet, "commitJobs", [1, 2], [c_id, wrong]))
    bad, failed = market.mine(anyone.raw("finalize", 1), anyone.raw("finalize", 2))
    assert names(bad) == ["JobCancelled"]
    owed += FEE
    # job 2's result is wrong: the wallet worker is slashed, half of it owed to the submitter
    assert names(failed) == ["JobFailed", "JobReopened"]
    owed += ETHER // 2
    assert market.view("owed", submitter_wallet) == owed
    assert market.view("workerStake", worker_wallet) == ETHER

    # job 3 verified: the fee owed to the wallet worker, the block reward paid as always
    market.mine(market.through(deployer, worker_wallet, "commitJobs", [3], [c_id]))
    [verified] = market.mine(anyone.raw("finalize", 3))
    assert names(verified) == ["JobVerified"]
    assert market.view("owed", worker_wallet) == FEE
    assert market.view("totalOwed") == owed + FEE
    assert market.balance(worker_wallet) == reward(2 * 4 * 3 * 2)

    # the wallets collect with all their gas: what they are owed, once
    market.mine(market.through(deployer, submitter_wallet, "claimOwed"),
                market.through(deployer, worker_wallet, "claimOwed"))
    assert market.received(submitter_wallet) == owed
    assert market.received(worker_wallet) == FEE
    assert market.view("totalOwed") == 0
    [again] = market.mine(market.through(deployer, worker_wallet, "claimOwed"))
    assert again["status"] == 0
    # a contract worker withdraws its stake; a contract submitter cancels its open job
    market.mine(market.through(deployer, worker_wallet, "requestWithdraw"))
    market.empty_blocks(market.block + 4)
    market.mine(market.through(deployer, worker_wallet, "withdraw"),
                market.through(deployer, submitter_wallet, "cancel", 2))
    assert market.received(worker_wallet) == FEE + ETHER
    assert market.received(submitter_wallet) == owed + FEE
    assert market.view("totalStaked") == market.view("workerStake", worker.address)
    assert market.view("totalEscrow") == FEE  # job 0, open again


# --- arguments at their limits -------------------------------------------------------------
def test_fee_timeout_and_dimension_limits(market):
    submitter, worker, anyone = market.accounts[:3]
    ids = (b"\1" * 32, b"\2" * 32)
    market.refused(submitter, "submitJob", *ids, 1, 4, 3, 2, 1, 0, reason="bad timeoutBlocks")
    market.refused(submitter, "submitJob", *ids, 1, 4, 3, 2, 1, 100_001,
                   reason="bad timeoutBlocks")
    market.refused(submitter, "submitJob", *ids, 1, 4, 3, 2, 4, 5,
                   reason="unknown precision class")
    market.refused(submitter, "submitJob", *ids, 1, 2**32, 3, 2, 1, 5, reason="dim above")
    # fees summing to msg.value only modulo 2^256, or above the packed field's 88 bits
    market.refused(submitter, "submitJobs", [ids[0]] * 2, [ids[1]] * 2, [1, 1], [4, 4],
                   [3, 3], [2, 2], [1, 1], [2**256 - 1, 1], 5, reason="fee above")
    market.refused(submitter, "submitJobs", [ids[0]] * 2, [ids[1]] * 2, [1, 1], [4, 4],
                   [3, 3], [2, 2], [1, 1], [MAX_FEE, 2**256 - MAX_FEE], 5,
                   reason="execution reverted")  # the sum overflows: checked arithmetic
    market.refused(submitter, "submitJobs", [ids[0]], [ids[1]], [1], [4], [3], [2], [1],
                   [FEE], 5, value=FEE - 1, reason="fees do not sum")
    top = 2**32 - 1
    market.mine(worker.raw("register", value=ETHER),
                submitter.raw("submitJobs", [ids[0]] * 2, [ids[1]] * 2, [top, 1], [top, 1],
                              [top, 1], [top, 1], [0, 1], [0, FEE], 100_000, value=FEE))
    job = market.job(0)
    assert (job["batch"], job["m"], job["k"], job["n"], job["fee"]) == (top,) * 4 + (0,)
    assert market.job(1)["fee"] == FEE and market.view("totalEscrow") == FEE
    market.send(worker, "claimJob", 1)
    assert market.job(1)["deadline"] == market.block + 100_000
    # a job whose check needs more gas than exists: finalize reverts, nothing moves
    market.send(worker, "commitJobs", [0], [b"\3" * 32])
    market.refused(anyone, "finalize", 0, reason="verification did not complete")
    assert market.job(0)["status"] == COMMITTED and market.claims(worker) == 2


# --- transactions that must not be accepted twice or from elsewhere ------------------------
def test_replayed_and_foreign_chain_transactions(market, monkeypatch):
    from eth.vm.forks.frontier import FrontierVM
    from eth.vm.forks.prague.transactions import PragueTransactionBuilder

    worker = market.accounts[5]
    raw = worker.raw("register", value=ETHER)
    market.node.admit(raw)
    with pytest.raises(ValueError, match="already known"):
        market.node.admit(raw)
    market.mine()
    with pytest.raises(ValueError, match="nonce too low"):
        market.node.admit(raw)
    assert market.view("workerStake", worker.address) == ETHER  # staked once

    other = market.accounts[6]
    foreign = other.raw("register", value=ETHER, chain_id=1)
    unprotected = other.account.sign_transaction({
        "to": MARKET.address, "data": MARKET.encode_abi("register", args=[]), "value": ETHER,
        "gas": 300_000, "gasPrice": 10**10, "nonce": 0}).raw_transaction
    with pytest.raises(ValueError, match="invalid chain id 1"):
        market.node.admit(foreign)
    with pytest.raises(ValueError, match="not replay-protected"):
        market.node.admit(unprotected)
    # a producer that skips admission: the block rules refuse them too
    for raw in (foreign, unprotected):
        market.node.mempool.add(PragueTransactionBuilder.decode(raw))
        market.mine()
        assert market.node.head().gas_used == 0 and len(market.node.mempool) == 0  # dropped
    assert market.view("workerStake", other.address) == 0
    # and a block that includes one anyway does not import
    monkeypatch.setattr(PoUWVMBase, "validate_transaction_against_header",
                        FrontierVM.validate_transaction_against_header)
    market.node.mempool.add(PragueTransactionBuilder.decode(foreign))
    rogue = market.node.seal()
    assert len(rogue.transactions) == 1
    monkeypatch.undo()
    with pytest.raises(ValidationError, match=f"block #{rogue.number} is invalid.*chain id 1"):
        replay(market.node.chain, market.node.blobs)
    assert replay(market.node.chain, market.node.blobs, upto=rogue.number - 1) == \
        rogue.number - 1


# --- random sequences, every invariant after every block -----------------------------------
def test_random_sequences_keep_the_books(market):
    """Workers and submitters (one of each a contract wallet) send random transactions,
    mostly aimed at live jobs, many of them invalid (the wrong sender, state or block). After
    every block: escrow is the fees of live jobs, stakes the workers' stakes, owed the sum
    owed, each worker's active claims its live jobs; every fee is as submitted, finished jobs
    stay finished, and no job is paid twice."""
    rng = np.random.default_rng(3)
    eoas, deployer = market.accounts[:8], market.accounts[8]
    wallets = [market.deploy_wallet(deployer) for _ in range(2)]
    workers, submitters = [*eoas[:4], wallets[0]], [*eoas[4:], wallets[1]]
    address = {a: a if isinstance(a, str) else a.address for a in workers + submitters}
    ops = [operands(market) for _ in range(3)]
    results = {a_id: (c_id, wrong) for a_id, _, c_id, wrong in ops}  # by the job's A

    def result(job_id):
        """The job's right result mostly, else a wrong one."""
        a_id = jobs[job_id]["aId"] if job_id < len(jobs) else b""
        c_id, wrong = results.get(a_id, (b"\3" * 32, b"\3" * 32))
        return c_id if rng.random() < 0.8 else wrong

    def tx(actor, fn, *args, value=0):
        if isinstance(actor, str):
            return market.through(deployer, actor, fn, *args, value=value)
        return actor.raw(fn, *args, value=value)

    market.mine(*[tx(w, "register", value=int(rng.choice([ETHER, 3 * ETHER + 1])))
                  for w in workers])
    fees, paid, finished, jobs = {}, {}, {}, []

    def pick(*statuses):
        """A job in one of these states (else any id, maybe one that does not exist)."""
        live = [i for i, job in enumerate(jobs) if job["status"] in statuses]
        return int(rng.choice(live)) if live and rng.random() < 0.85 \
            else int(rng.integers(0, len(jobs) + 1))

    def owner(job_id, field, crowd):
        """The job's submitter or worker, usually; else anyone of the crowd."""
        if job_id < len(jobs) and rng.random() < 0.85:
            return next((a for a in crowd if address[a].lower() == jobs[job_id][field]),
                        crowd[rng.integers(len(crowd))])
        return crowd[rng.integers(len(crowd))]

    for _ in range(70):
        raws = []
        for _ in range(rng.integers(2, 6)):
            a_id, b_id, _, _ = ops[rng.integers(len(ops))]
            worker = workers[rng.integers(len(workers))]
            submitter = submitters[rng.integers(len(submitters))]
            action = rng.integers(10)
            if action == 0 and len(jobs) < 24:
                a = a_id if rng.random() < 0.85 else b"\7" * 32  # sometimes A is missing
                raws.append(tx(submitter, "submitJob", a, b_id, 1, 4, 3, 2, 1,
                               int(rng.integers(1, 5)), value=int(rng.choice([0, 1, FEE]))))
            elif action == 1:
                raws.append(tx(worker, "claimJob", pick(OPEN)))
            elif action == 2:
                job = pick(CLAIMED)
                raws.append(tx(owner(job, "worker", workers), "commitResult", job, result(job)))
            elif action == 3:
                chosen = [pick(OPEN), pick(OPEN)]
                raws.append(tx(worker, "commitJobs", chosen, [result(j) for j in chosen]))
            elif action == 4:
                raws.append(tx(submitter, "finalizeJobs", [pick(COMMITTED), pick(COMMITTED)]))
            elif action == 5:
                raws.append(tx(submitter, "finalize", pick(COMMITTED)))
            elif action == 6:
                raws.append(tx(submitter, "reopenExpired", pick(CLAIMED, COMMITTED)))
            elif action == 7:
                job = pick(OPEN)
                raws.append(tx(owner(job, "submitter", submitters), "cancel", job))
            elif action == 8:
                fn = str(rng.choice(["requestWithdraw", "withdraw", "register"]))
                raws.append(tx(worker, fn, value=ETHER // 4 if fn == "register" else 0))
            else:
                raws.append(tx(rng.choice([worker, submitter]), "claimOwed"))
        for receipt in market.mine(*raws):
            for name, args in receipt["events"]:
                if name == "JobSubmitted":
                    fees[args["jobId"]] = args["fee"]
                elif name == "JobVerified":
                    assert args["jobId"] not in paid, "a job paid twice"
                    paid[args["jobId"]] = args["fee"]

        jobs = [market.job(i) for i in range(market.view("jobCount"))]
        live_claims = {}
        for job_id, job in enumerate(jobs):
            assert job["fee"] == fees[job_id]
            assert finished.get(job_id, job["status"]) == job["status"], "a finished job changed"
            if job["status"] in (DONE, CANCELLED):
                finished[job_id] = job["status"]
            if job["status"] in (CLAIMED, COMMITTED):
                live_claims[job["worker"]] = live_claims.get(job["worker"], 0) + 1
            assert (job["status"] == DONE) == (job_id in paid)
        assert market.view("totalEscrow") == \
            sum(job["fee"] for job in jobs if job["status"] not in (DONE, CANCELLED))
        infos = [market.view("workerInfo", address[w]) for w in workers]
        assert market.view("totalStaked") == sum(stake for stake, _, _ in infos)
        assert [claims for _, _, claims in infos] == \
            [live_claims.get(address[w].lower(), 0) for w in workers]
        assert market.view("totalOwed") == \
            sum(market.view("owed", a) for a in set(address.values()))
    # the sequence did reach every outcome
    outcomes = {job["status"] for job in jobs}
    assert {OPEN, DONE, CANCELLED} <= outcomes and len(paid) >= 5
    assert market.view("totalOwed") or any(market.received(w) for w in wallets)
