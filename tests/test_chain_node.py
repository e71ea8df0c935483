"""A real node process driven over HTTP with web3.py and locally signed transactions.

After every scenario the supply is audited: the sum of all balances (dev accounts, the
market contract that holds escrow and stakes, the reward pool) must equal the genesis
supply minus the burned base fees, and the market's balance must equal its escrow plus
stakes. Rewards move value from the pool to workers, so they do not change the sum.
"""
import threading
import time

import httpx
import numpy as np
import pytest
import rlp
from eth_account import Account
from eth_hash.auto import keccak
from helpers import dev_clients
from web3.exceptions import ContractLogicError

from chain.blobs import encode_array
from chain.client import TransactionReverted
from chain.devnet import dev_accounts
from chain.launch import NodeProcess
from chain.node import Node, NodeConfig, TxRejected
from chain.params import CHAIN_ID
from node.market import EventDecoder

ETHER = 10**18
GENESIS_SUPPLY = 20 * 10_000 * ETHER + 1_000_000 * ETHER  # documented in docs/protocol.md
POOL = "0x0000000000000000000000000000000000000FEE"
MARKET = "0x000000000000000000000000000000000000c0DE"
REWARD_PER_GFLOP = ETHER // 1000
RNG = np.random.default_rng(11)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    data = tmp_path_factory.mktemp("chain") / "data"
    with NodeProcess(data, block_time=0.25, extra_args=("--max-blob-mb", "1")) as proc:
        yield proc


@pytest.fixture(scope="module")
def clients(node):
    with dev_clients(node.url, 10) as made:
        yield made


@pytest.fixture(scope="module")
def w3(clients):
    return clients[0].w3


_burned: dict[int, int] = {}


def burned_until(w3, number: int) -> int:
    for n in range(1, number + 1):
        if n not in _burned:
            block = w3.eth.get_block(n)
            _burned[n] = block["gasUsed"] * block["baseFeePerGas"]
    return sum(_burned[n] for n in range(1, number + 1))


def assert_conserved(w3, market):
    n = w3.eth.block_number
    holders = [a.address for a in dev_accounts(20)] + [MARKET, POOL]
    total = sum(w3.eth.get_balance(a, n) for a in holders)
    assert total == GENESIS_SUPPLY - burned_until(w3, n)
    escrow = market.functions.totalEscrow().call(block_identifier=n)
    staked = market.functions.totalStaked().call(block_identifier=n)
    assert w3.eth.get_balance(MARKET, n) == escrow + staked


@pytest.fixture(autouse=True)
def conservation(clients):
    yield
    assert_conserved(clients[0].w3, clients[0].market)


def gas_cost(receipt) -> int:
    return receipt["gasUsed"] * receipt["effectiveGasPrice"]


def tips(w3, block_number: int) -> int:
    """Priority fees paid to the coinbase (the reward pool) in a block."""
    block = w3.eth.get_block(block_number, full_transactions=True)
    total = 0
    for tx in block["transactions"]:
        receipt = w3.eth.get_transaction_receipt(tx["hash"])
        total += receipt["gasUsed"] * (receipt["effectiveGasPrice"] - block["baseFeePerGas"])
    return total


def wait_for_block(w3, number: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while w3.eth.block_number < number:
        assert time.monotonic() < deadline, f"block {number} not reached"
        time.sleep(0.05)


def ensure_registered(client, stake=2 * ETHER):
    if client.market.functions.workerStake(client.address).call() < ETHER:
        client.send(client.market.functions.register(), value=stake)


def submit(client, a_id, b_id, shape, precision=1, fee=10**16, timeout=100) -> int:
    batch, m, k, n = shape
    receipt = client.send(
        client.market.functions.submitJob(a_id, b_id, batch, m, k, n, precision, timeout),
        value=fee)
    return client.events(receipt, "JobSubmitted")[0]["args"]["jobId"]


def float_job(client, m=16, k=8, n=4):
    a, b = RNG.standard_normal((m, k), np.float32), RNG.standard_normal((k, n), np.float32)
    return a, b, client.put_blob(a), client.put_blob(b)


# --- the job lifecycle ---------------------------------------------------------------------
def test_full_lifecycle_pays_fee_and_pro_rata_reward(clients, w3):
    submitter, worker, anyone = clients[1], clients[2], clients[3]
    ensure_registered(worker)
    a, b, a_id, b_id = float_job(submitter)
    fee = 10**16
    job = submit(submitter, a_id, b_id, (1, 16, 8, 4), fee=fee)
    assert submitter.get_job(job)["status"] == 1
    claim = worker.send(worker.market.functions.claimJob(job))
    assert worker.events(claim, "JobClaimed")[0]["args"]["deadline"] == claim["blockNumber"] + 100
    c_id = worker.put_blob(a @ b)
    commit = worker.send(worker.market.functions.commitResult(job, c_id))
    assert worker.get_job(job)["status"] == 3

    worker_before = w3.eth.get_balance(worker.address)
    pool_before = w3.eth.get_balance(POOL)
    final = anyone.send(anyone.market.functions.finalize(job))
    assert final["blockNumber"] > commit["blockNumber"]
    flops = 2 * 16 * 8 * 4
    (verified,) = anyone.events(final, "JobVerified")
    assert verified["args"]["flops"] == flops and verified["args"]["fee"] == fee
    reward = min(2 * ETHER, REWARD_PER_GFLOP * flops // 10**9)
    assert w3.eth.get_balance(worker.address) - worker_before == fee + reward
    assert w3.eth.get_balance(POOL) - pool_before == tips(w3, final["blockNumber"]) - reward

    job_view = submitter.get_job(job)
    assert job_view["status"] == 4 and job_view["cId"] == c_id and job_view["worker"] == \
        worker.address
    np.testing.assert_array_equal(submitter.get_blob(c_id), a @ b)
    seal = w3.eth.get_block(final["blockNumber"])["extraData"]
    worker_bytes = bytes.fromhex(worker.address[2:])
    assert seal == keccak(rlp.encode([[job, worker_bytes, flops]]))


def test_reward_split_pro_rata_between_workers(clients, w3):
    submitter, workers = clients[1], (clients[4], clients[5])
    for worker in workers:
        ensure_registered(worker)
    shapes = [(1, 16, 8, 4), (1, 32, 8, 4)]
    jobs = []
    for worker, (_, m, k, n) in zip(workers, shapes, strict=True):
        a, b, a_id, b_id = float_job(submitter, m, k, n)
        job = submit(submitter, a_id, b_id, (1, m, k, n))
        worker.send(worker.market.functions.claimJob(job))
        worker.send(worker.market.functions.commitResult(job, worker.put_blob(a @ b)))
        jobs.append(job)
    wait_for_block(w3, w3.eth.block_number + 1)
    # both finalizations in one block, signed ahead and sent in one batch request
    raws = [submitter.sign(submitter.market.functions.finalize(job), gas=3_000_000)
            for job in jobs]
    before = [w3.eth.get_balance(w.address) for w in workers]
    replies = httpx.post(submitter.url, json=[
        {"jsonrpc": "2.0", "id": i, "method": "eth_sendRawTransaction",
         "params": ["0x" + raw.hex()]} for i, raw in enumerate(raws)]).json()
    hashes = [r["result"] for r in sorted(replies, key=lambda r: r["id"])]
    receipts = [w3.eth.wait_for_transaction_receipt(h, timeout=30) for h in hashes]
    assert all(r["status"] == 1 for r in receipts)
    assert receipts[0]["blockNumber"] == receipts[1]["blockNumber"]
    flops = [2 * m * k * n for _, m, k, n in shapes]
    reward = REWARD_PER_GFLOP * sum(flops) // 10**9
    for worker, f, b0 in zip(workers, flops, before, strict=True):
        assert w3.eth.get_balance(worker.address) - b0 == 10**16 + reward * f // sum(flops)


def test_wrong_result_is_slashed_and_not_paid(clients, w3):
    submitter, worker, anyone = clients[1], clients[6], clients[3]
    ensure_registered(worker, stake=4 * ETHER)
    a, b, a_id, b_id = float_job(submitter)
    job = submit(submitter, a_id, b_id, (1, 16, 8, 4))
    worker.send(worker.market.functions.claimJob(job))
    wrong = a @ b
    wrong[3, 1] += 0.25
    worker.send(worker.market.functions.commitResult(job, worker.put_blob(wrong)))
    stake = worker.market.functions.workerStake(worker.address).call()
    balances = {c.address: w3.eth.get_balance(c.address) for c in (submitter, worker)}
    pool_before = w3.eth.get_balance(POOL)
    final = anyone.send(anyone.market.functions.finalize(job))
    assert not anyone.events(final, "JobVerified")
    slashed = anyone.events(final, "JobFailed")[0]["args"]["slashed"]
    assert slashed == stake // 2
    assert anyone.events(final, "JobReopened")[0]["args"]["jobId"] == job
    assert worker.market.functions.workerStake(worker.address).call() == stake - slashed
    assert w3.eth.get_balance(worker.address) == balances[worker.address]  # not paid
    assert w3.eth.get_balance(submitter.address) - balances[submitter.address] == slashed // 2
    assert w3.eth.get_balance(POOL) - pool_before == \
        slashed - slashed // 2 + tips(w3, final["blockNumber"])
    view = submitter.get_job(job)
    assert view["status"] == 1 and view["worker"] == "0x" + "0" * 40 and view["fee"] == 10**16
    assert w3.eth.get_block(final["blockNumber"])["extraData"] == keccak(rlp.encode([]))


def test_missed_deadline_reopens_and_cuts_stake(clients, w3):
    submitter, worker, anyone = clients[1], clients[7], clients[3]
    ensure_registered(worker)
    _, _, a_id, b_id = float_job(submitter)
    patient = submit(submitter, a_id, b_id, (1, 16, 8, 4), timeout=1000)
    worker.send(worker.market.functions.claimJob(patient))
    with pytest.raises(TransactionReverted, match="deadline not passed"):
        anyone.send(anyone.market.functions.reopenExpired(patient))

    job = submit(submitter, a_id, b_id, (1, 16, 8, 4), timeout=2)
    claim = worker.send(worker.market.functions.claimJob(job))
    deadline = claim["blockNumber"] + 2
    wait_for_block(w3, deadline + 1)
    with pytest.raises(TransactionReverted, match="deadline passed"):
        worker.send(worker.market.functions.commitResult(job, b"\1" * 32))
    stake = worker.market.functions.workerStake(worker.address).call()
    receipt = anyone.send(anyone.market.functions.reopenExpired(job))
    cut = anyone.events(receipt, "JobFailed")[0]["args"]["slashed"]
    assert cut == stake // 10
    assert anyone.events(receipt, "JobReopened")
    assert worker.market.functions.workerStake(worker.address).call() == stake - cut
    assert submitter.get_job(job)["status"] == 1
    # the job can be claimed again by someone else
    other = clients[8]
    ensure_registered(other)
    other.send(other.market.functions.claimJob(job))
    assert submitter.get_job(job)["worker"] == other.address


def test_cancel_refunds_only_open_jobs(clients, w3):
    submitter, stranger = clients[1], clients[3]
    _, _, a_id, b_id = float_job(submitter)
    before = w3.eth.get_balance(submitter.address)
    escrow = submitter.market.functions.totalEscrow().call()
    fee = 5 * 10**16
    receipt = submitter.send(
        submitter.market.functions.submitJob(a_id, b_id, 1, 16, 8, 4, 1, 100), value=fee)
    job = submitter.events(receipt, "JobSubmitted")[0]["args"]["jobId"]
    assert submitter.market.functions.totalEscrow().call() == escrow + fee
    with pytest.raises(TransactionReverted, match="not the submitter"):
        stranger.send(stranger.market.functions.cancel(job))
    cancel = submitter.send(submitter.market.functions.cancel(job))
    assert submitter.events(cancel, "JobCancelled")[0]["args"]["jobId"] == job
    assert w3.eth.get_balance(submitter.address) == before - gas_cost(receipt) - gas_cost(cancel)
    assert submitter.market.functions.totalEscrow().call() == escrow
    assert submitter.get_job(job)["status"] == 5
    with pytest.raises(TransactionReverted, match="job not open"):
        submitter.send(submitter.market.functions.cancel(job))


def test_registration_and_withdrawal_after_cooldown(clients, w3):
    worker = clients[9]
    market = worker.market.functions
    with pytest.raises(TransactionReverted, match="below minStake"):
        worker.send(market.register(), value=ETHER // 2)
    reg = worker.send(market.register(), value=ETHER)
    worker.send(market.register(), value=ETHER // 2)  # top up
    assert worker.events(reg, "WorkerRegistered")[0]["args"]["stake"] == ETHER
    assert market.workerStake(worker.address).call() == 3 * ETHER // 2
    request = worker.send(market.requestWithdraw())
    available = worker.events(request, "WithdrawRequested")[0]["args"]["availableBlock"]
    assert available == request["blockNumber"] + market.withdrawCooldown().call()
    _, _, a_id, b_id = float_job(clients[1])
    job = submit(clients[1], a_id, b_id, (1, 16, 8, 4))
    with pytest.raises(TransactionReverted, match="withdrawing"):
        worker.send(market.claimJob(job))
    if w3.eth.block_number + 1 < available:
        with pytest.raises(TransactionReverted, match="cooldown"):
            worker.send(market.withdraw())
    wait_for_block(w3, available)
    before = w3.eth.get_balance(worker.address)
    receipt = worker.send(market.withdraw())
    assert worker.events(receipt, "Withdrawn")[0]["args"]["amount"] == 3 * ETHER // 2
    assert w3.eth.get_balance(worker.address) == before + 3 * ETHER // 2 - gas_cost(receipt)
    assert market.workerStake(worker.address).call() == 0


def test_batched_submission_and_batched_products(clients, w3):
    submitter, worker = clients[1], clients[2]
    ensure_registered(worker)
    a2, b2 = RNG.standard_normal((5, 3), np.float32), RNG.standard_normal((3, 2), np.float32)
    a3 = RNG.standard_normal((4, 5, 3), np.float32)
    b3 = RNG.standard_normal((4, 3, 2), np.float32)
    ai, bi = RNG.integers(-9, 9, (2, 3, 3)).astype(np.int32), np.eye(3, dtype=np.int32) * 2
    specs = [  # (A, B, C, batch, precision)
        (a2, b2, a2 @ b2, 1, 1),
        (a3, b2, a3 @ b2, 4, 1),  # B shared by the batch
        (a3, b3, a3 @ b3, 4, 3),  # bf16 class
        (ai, bi, (ai.astype(np.int64) @ bi).astype(np.int64), 2, 0),  # exact
    ]
    ids = [(submitter.put_blob(a), submitter.put_blob(b)) for a, b, *_ in specs]
    fees = [10**15 * (i + 1) for i in range(len(specs))]
    shapes = [(batch, a.shape[-2], a.shape[-1], b.shape[-1]) for a, b, _, batch, _ in specs]
    args = ([i[0] for i in ids], [i[1] for i in ids], [s[0] for s in shapes],
            [s[1] for s in shapes], [s[2] for s in shapes], [s[3] for s in shapes],
            [p for *_, p in specs], fees, 100)
    with pytest.raises(TransactionReverted, match="fees do not sum"):
        submitter.send(submitter.market.functions.submitJobs(*args), value=sum(fees) - 1)
    receipt = submitter.send(submitter.market.functions.submitJobs(*args), value=sum(fees))
    jobs = [e["args"]["jobId"] for e in submitter.events(receipt, "JobSubmitted")]
    assert len(jobs) == 4 and jobs == list(range(jobs[0], jobs[0] + 4))
    for job, (_, _, c, *_), fee in zip(jobs, specs, fees, strict=True):
        assert submitter.get_job(job)["fee"] == fee
        worker.send(worker.market.functions.claimJob(job))
        worker.send(worker.market.functions.commitResult(job, worker.put_blob(c)))
    for job, shape in zip(jobs, shapes, strict=True):
        receipt = worker.send(worker.market.functions.finalize(job))
        (event,) = worker.events(receipt, "JobVerified")
        batch, m, k, n = shape
        assert event["args"]["flops"] == 2 * batch * m * k * n
        assert worker.get_job(job)["status"] == 4


def test_missing_operand_cancels_without_slashing(clients, w3):
    submitter, worker = clients[1], clients[2]
    ensure_registered(worker)
    a, b, a_id, _ = float_job(submitter)
    never_uploaded = keccak(b"no such blob")
    fee = 10**16
    before = w3.eth.get_balance(submitter.address)
    sub = submitter.send(submitter.market.functions.submitJob(
        a_id, never_uploaded, 1, 16, 8, 4, 1, 100), value=fee)
    job = submitter.events(sub, "JobSubmitted")[0]["args"]["jobId"]
    worker.send(worker.market.functions.claimJob(job))
    worker.send(worker.market.functions.commitResult(job, worker.put_blob(a @ b)))
    stake = worker.market.functions.workerStake(worker.address).call()
    final = worker.send(worker.market.functions.finalize(job))
    assert worker.events(final, "JobCancelled") and not worker.events(final, "JobFailed")
    assert worker.market.functions.workerStake(worker.address).call() == stake
    assert w3.eth.get_balance(submitter.address) == before - gas_cost(sub)
    assert submitter.get_job(job)["status"] == 5


def test_finalize_gas_follows_documented_formula(clients, w3):
    submitter, workers = clients[1], (clients[4], clients[5])
    gas = []
    for worker, m in zip(workers, (16, 48), strict=True):
        ensure_registered(worker)
        a, b, a_id, b_id = float_job(submitter, m, 8, 4)
        job = submit(submitter, a_id, b_id, (1, m, 8, 4))
        worker.send(worker.market.functions.claimJob(job))
        worker.send(worker.market.functions.commitResult(job, worker.put_blob(a @ b)))
        gas.append(worker.send(worker.market.functions.finalize(job))["gasUsed"])
    rounds = 8
    # 5000 + (1 + rounds) * batch * (mk + kn + mn): only the m-dependent part differs
    assert gas[1] - gas[0] == (1 + rounds) * ((48 - 16) * 8 + (48 - 16) * 4)


# --- transaction admission -----------------------------------------------------------------
def _signed(account, nonce, chain_id=1414, value=1, to=None, gas=21_000):
    tx = {"to": to or dev_accounts(1)[0].address, "value": value, "gas": gas,
          "maxFeePerGas": 10**11, "maxPriorityFeePerGas": 1, "nonce": nonce,
          "chainId": chain_id, "type": 2}
    return account.sign_transaction(tx).raw_transaction


def _send_raw(url, raw: bytes) -> dict:
    return httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "eth_sendRawTransaction",
                                 "params": ["0x" + raw.hex()]}).json()


def _tamper_signature(raw: bytes) -> bytes:
    fields = rlp.decode(raw[1:])
    fields[-1] = b"\xff" * 32  # s above the curve order
    return raw[:1] + rlp.encode(fields)


def test_bad_transactions_rejected_and_state_unchanged(node, clients, w3):
    sender = dev_accounts(10)[3]
    stranger = Account.create()
    pending_nonce = w3.eth.get_transaction_count(sender.address, "pending")
    mined = _signed(sender, pending_nonce)
    assert "result" in _send_raw(node.url, mined)
    w3.eth.wait_for_transaction_receipt(keccak(mined), timeout=30)
    nonce = pending_nonce + 1

    unprotected = Account.sign_transaction(
        {"to": stranger.address, "value": 1, "gas": 21_000, "gasPrice": 10**11, "nonce": nonce},
        sender.key).raw_transaction
    cases = {
        "invalid signature|invalid transaction": _tamper_signature(_signed(sender, nonce)),
        "invalid chain id 1": _signed(sender, nonce, chain_id=1),
        "nonce too low": mined,  # replay of a mined transaction
        "nonce too low: next nonce": _signed(sender, nonce - 1, value=7),
        "insufficient funds": _signed(stranger, 0, value=ETHER),
        "replay-protected": unprotected,
        "intrinsic gas too low": _signed(sender, nonce, gas=20_000),
        "exceeds the block gas limit": _signed(sender, nonce, gas=3 * 10**9),
        "could not be decoded": b"\x02\xc0\x01",
    }
    root = w3.eth.get_block("latest")["stateRoot"]
    balances = [w3.eth.get_balance(a) for a in (sender.address, stranger.address)]
    for message, raw in cases.items():
        reply = _send_raw(node.url, raw)
        assert "error" in reply, message
        assert reply["error"]["code"] == -32000
        assert any(m in reply["error"]["message"] for m in message.split("|")), reply
    wait_for_block(w3, w3.eth.block_number + 2)
    assert w3.eth.get_block("latest")["stateRoot"] == root
    assert [w3.eth.get_balance(a) for a in (sender.address, stranger.address)] == balances
    assert w3.eth.get_transaction_count(sender.address) == nonce


# --- JSON-RPC surface ----------------------------------------------------------------------
def _rpc(url, payload):
    return httpx.post(url, json=payload).json()


def test_standard_methods_and_error_codes(node, w3):
    assert w3.eth.chain_id == 1414 and w3.net.version == "1414"
    assert w3.client_version.startswith("needle-net")
    assert len(w3.eth.get_code(MARKET)) > 1000
    assert w3.eth.get_code(POOL) == b""
    assert w3.eth.gas_price > 0 and w3.eth.max_priority_fee > 0
    history = w3.eth.fee_history(4, "latest", [50])
    assert len(history["baseFeePerGas"]) == 5 and len(history["reward"]) == 4
    block = w3.eth.get_block("latest")
    assert w3.eth.get_block(block["hash"])["number"] == block["number"]
    jobs = w3.eth.get_storage_at(MARKET, 0)
    assert len(jobs) == 32
    batch = _rpc(node.url, [
        {"jsonrpc": "2.0", "id": 1, "method": "eth_blockNumber"},
        {"jsonrpc": "2.0", "id": 2, "method": "no_such_method"},
        {"jsonrpc": "2.0", "id": 3, "method": "eth_getBalance", "params": ["0x12", "latest"]},
        {"jsonrpc": "2.0", "id": 4, "method": "eth_chainId"},
    ])
    by_id = {r["id"]: r for r in batch}
    assert int(by_id[1]["result"], 16) >= block["number"]
    assert by_id[2]["error"]["code"] == -32601
    assert by_id[3]["error"]["code"] == -32602
    assert by_id[4]["result"] == hex(1414)
    parse = httpx.post(node.url, content=b"{not json").json()
    assert parse["error"]["code"] == -32700
    assert _rpc(node.url, [])["error"]["code"] == -32600
    notification = httpx.post(f"{node.url}/rpc", json={"jsonrpc": "2.0",
                                                       "method": "eth_chainId"})
    assert notification.status_code == 204 and notification.content == b""
    huge = httpx.post(node.url, content=b" " * (64 * 2**20 + 1))
    assert huge.status_code == 413 and "request body over" in huge.json()["error"]
    for block in ("latest", "1_0", " 5", "-1", "\u0663", "0x10"):
        bad = httpx.get(f"{node.url}/wait", params={"block": block, "timeout": 0})
        assert bad.status_code == 400 and "block and timeout must be numbers" in \
            bad.json()["error"], block
    assert httpx.get(f"{node.url}/info").json()["chain_id"] == 1414


def test_call_reverts_carry_the_reason(clients):
    client = clients[1]  # a submitter, never registered as a worker
    with pytest.raises(ContractLogicError, match="worker stake below minStake"):
        client.market.functions.claimJob(10**9).call({"from": client.address})
    with pytest.raises(TransactionReverted, match="cancel would revert: .*not the submitter"):
        client.send(client.market.functions.cancel(10**9))


def test_logs_and_filters_follow_new_jobs(clients, w3):
    submitter = clients[1]
    event = submitter.market.events.JobSubmitted
    flt = w3.eth.filter({"address": MARKET, "topics": [event.topic],
                         "fromBlock": "latest"})
    _, _, a_id, b_id = float_job(submitter)
    job = submit(submitter, a_id, b_id, (1, 16, 8, 4))
    changes = flt.get_new_entries()
    assert [event.process_log(log)["args"]["jobId"] for log in changes] == [job]
    assert flt.get_new_entries() == []
    logs = w3.eth.get_logs({"address": MARKET, "fromBlock": 0, "toBlock": "latest",
                            "topics": [event.topic, "0x" + job.to_bytes(32, "big").hex()]})
    assert len(logs) == 1 and logs[0]["transactionHash"] == changes[0]["transactionHash"]
    assert w3.eth.uninstall_filter(flt.filter_id)


def test_long_poll_answers_equal_receipts_logs_and_gas_price(node, clients, w3):
    """GET /wait's receipt and logs are what eth_getTransactionReceipt and eth_getLogs
    answer; the client's receipts and logs taken from them equal web3's own."""
    def rpc(method, *params):
        return httpx.post(node.url, json={"jsonrpc": "2.0", "id": 1, "method": method,
                                          "params": list(params)}).json()["result"]

    submitter = clients[1]
    _, _, a_id, b_id = float_job(submitter)
    call = submitter.market.functions.submitJob(a_id, b_id, 1, 16, 8, 4, 1, 100)
    tx_hash = submitter.post(call, value=10**16, gas=400_000)
    answer = httpx.get(f"{node.url}/wait", params={"tx": "0x" + tx_hash.hex(),
                                                   "timeout": 30}).json()
    assert answer["receipt"] == rpc("eth_getTransactionReceipt", "0x" + tx_hash.hex())
    assert answer["receipt"]["logs"] and answer["receipt"]["status"] == "0x1"
    number = int(answer["receipt"]["blockNumber"], 16)
    answer = httpx.get(f"{node.url}/wait", params={"block": number, "logs": MARKET,
                                                   "timeout": 5}).json()
    assert answer["logs"] == rpc("eth_getLogs", {"address": MARKET, "fromBlock": hex(number),
                                                 "toBlock": hex(answer["head"])})
    assert answer["logs"][0]["transactionHash"] == "0x" + tx_hash.hex()

    assert submitter.wait_for_receipt(tx_hash) == w3.eth.get_transaction_receipt(tx_hash)
    head, logs = submitter.wait_for_logs(number, 5)
    assert logs == rpc("eth_getLogs", {"address": MARKET, "fromBlock": hex(number),
                                       "toBlock": hex(head)})
    for _ in range(20):  # the gas price of the head the answer names (empty blocks move it)
        before = w3.eth.block_number
        answer = httpx.get(f"{node.url}/wait", params={"block": before, "timeout": 5}).json()
        price = w3.eth.gas_price
        if before == answer["head"] == w3.eth.block_number:
            assert answer["gas_price"] == price
            break
    else:
        pytest.fail("the head moved during every attempt")

    bad = httpx.get(f"{node.url}/wait", params={"block": 0, "logs": "0x12", "timeout": 0})
    assert bad.status_code == 400 and "logs must be 20 bytes" in bad.json()["error"]


def test_admission_goes_on_while_a_block_is_sealing(tmp_path):
    """Admission takes the mempool's lock, not the chain's: while the chain's lock is held
    (as a seal holds it) transactions are still admitted or refused against the head, and
    the next block includes what was admitted."""
    node = Node(NodeConfig(tmp_path / "node", block_time=0, seal_on_pending=False,
                           decode_process=False))
    alice = dev_accounts(1)[0]
    raws = [bytes(alice.sign_transaction({
        "to": POOL, "value": 1, "gas": 21_000, "maxFeePerGas": 10**11,
        "maxPriorityFeePerGas": 1, "nonce": nonce, "chainId": CHAIN_ID, "type": 2,
    }).raw_transaction) for nonce in range(3)]
    outcomes = {}

    def admit(i):
        try:
            outcomes[i] = node.admit(raws[i])
        except TxRejected as exc:
            outcomes[i] = exc

    try:
        node.admit(raws[0])
        node.seal()
        with node.lock:
            threads = [threading.Thread(target=admit, args=(i,)) for i in (1, 0, 2)]
            for thread in threads:
                thread.start()
                thread.join(30)
                assert not thread.is_alive(), "admission waited for the chain's lock"
        assert "nonce too low" in str(outcomes[0])
        block = node.seal()
        assert [tx.hash for tx in block.transactions] == [outcomes[1], outcomes[2]]
        assert len(node.mempool) == 0
    finally:
        node.stop()


# --- blob endpoints ------------------------------------------------------------------------
def test_blob_endpoints_check_hash_size_and_format(node, clients):
    client = clients[1]
    array = RNG.standard_normal((10, 10), np.float32)
    blob = encode_array(array)
    id_ = client.put_blob(blob)
    url = f"{node.url}/blobs/0x{id_.hex()}"
    assert httpx.head(url).status_code == 200
    assert httpx.get(url).content == blob
    np.testing.assert_array_equal(client.get_blob(id_), array)
    assert httpx.put(url, content=blob[:-4] + b"\0\0\0\0").status_code == 400
    garbage = b"not a blob at all"
    assert httpx.put(f"{node.url}/blobs/0x{keccak(b'x').hex()}", content=garbage).status_code \
        == 400
    from blake3 import blake3
    assert httpx.put(f"{node.url}/blobs/0x{blake3(garbage).hexdigest()}",
                     content=garbage).status_code == 400
    big = encode_array(np.zeros(300_000, np.float32))  # 1.2 MB > the 1 MiB limit
    assert httpx.put(f"{node.url}/blobs/0x{blake3(big).hexdigest()}",
                     content=big).status_code == 413
    missing = f"{node.url}/blobs/0x{'ab' * 32}"
    assert httpx.get(missing).status_code == 404 and httpx.head(missing).status_code == 404
    assert httpx.get(f"{node.url}/blobs/0x1234").status_code == 400


def test_legacy_eip155_transfer_and_lookups(w3):
    sender, receiver = dev_accounts(12)[10], dev_accounts(12)[11]
    before = w3.eth.get_balance(receiver.address)
    raw = sender.sign_transaction({
        "to": receiver.address, "value": 12345, "gas": 21_000, "gasPrice": w3.eth.gas_price,
        "nonce": w3.eth.get_transaction_count(sender.address, "pending"), "chainId": 1414,
    }).raw_transaction
    tx_hash = w3.eth.send_raw_transaction(raw)
    receipt = w3.eth.wait_for_transaction_receipt(tx_hash, timeout=30)
    assert receipt["status"] == 1 and receipt["gasUsed"] == 21_000
    assert receipt["from"] == sender.address and receipt["to"] == receiver.address
    assert w3.eth.get_balance(receiver.address) == before + 12345
    tx = w3.eth.get_transaction(tx_hash)
    assert tx["blockNumber"] == receipt["blockNumber"] and tx["value"] == 12345
    block = w3.eth.get_block(receipt["blockNumber"], full_transactions=True)
    assert [t["hash"] for t in block["transactions"]][receipt["transactionIndex"]] == tx_hash
    unknown = "0x" + keccak(b"unknown").hex()
    assert w3.provider.make_request("eth_getTransactionReceipt", [unknown])["result"] is None
    assert w3.provider.make_request("eth_getTransactionByHash", [unknown])["result"] is None


# --- last: every kind of market event has happened by now -----------------------------------
def test_event_decoder_equals_web3_on_every_market_event(node, clients, w3):
    """node.market.EventDecoder (the workers' and clients' fast path) against web3's
    process_log, on every market log of this chain, from raw JSON and from web3's logs."""
    market = clients[0].market
    decoder = EventDecoder(market.abi)
    head = w3.eth.block_number
    formatted = w3.eth.get_logs({"address": MARKET, "fromBlock": 0, "toBlock": head})
    raw = clients[0].raw_logs(0, head)
    assert len(raw) == len(formatted) > 0
    by_topic = {bytes.fromhex(e.topic[2:]): e for e in (getattr(market.events, a["name"])()
                                            for a in market.abi if a["type"] == "event")}
    names = set()
    for raw_log, log in zip(raw, formatted, strict=True):
        expected = by_topic[bytes(log["topics"][0])].process_log(log)
        assert decoder.decode(raw_log) == expected
        assert decoder.decode(log) == expected
        names.add(expected["event"])
    assert names == {a["name"] for a in market.abi if a["type"] == "event"}
    transfer = dict(raw[0], topics=["0x" + "00" * 32])  # not a market event
    assert decoder.decode(transfer) is None
