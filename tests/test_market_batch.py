"""The market's one-step and batched lifecycle calls (commitJobs, finalizeJobs) and the node's
long poll (GET /wait), against a real node process with locally signed transactions.

The reference for every verdict is numpy's product; after each test the market's balance
must equal its escrow plus stakes."""
import asyncio
import threading
import time

import httpx
import numpy as np
import pytest
from helpers import dev_clients

from chain.client import TransactionReverted

pytestmark = pytest.mark.timeout(120)
ETHER = 10**18
FEE = 10**16
REWARD_PER_GFLOP = ETHER // 1000
MARKET = "0x000000000000000000000000000000000000c0DE"
OPEN, COMMITTED, DONE = 1, 3, 4
RNG = np.random.default_rng(5)


@pytest.fixture(scope="module")
def clients(node):
    with dev_clients(node.url, 8) as made:
        yield made


@pytest.fixture(autouse=True)
def market_holds_escrow_plus_stakes(clients):
    yield
    market = clients[0].market
    assert clients[0].w3.eth.get_balance(MARKET) == \
        market.functions.totalEscrow().call() + market.functions.totalStaked().call()


def registered(client, stake=2 * ETHER):
    if client.market.functions.workerStake(client.address).call() < ETHER:
        client.send(client.market.functions.register(), value=stake)
    return client


def submit_jobs(client, count: int, m=6, k=5, n=4):
    """Open `count` float jobs in one transaction; [(job id, A, B)]."""
    ops = [(RNG.standard_normal((m, k), np.float32), RNG.standard_normal((k, n), np.float32))
           for _ in range(count)]
    ids = [(client.put_blob(a), client.put_blob(b)) for a, b in ops]
    receipt = client.send(client.market.functions.submitJobs(
        [i[0] for i in ids], [i[1] for i in ids], [1] * count, [m] * count, [k] * count,
        [n] * count, [1] * count, [FEE] * count, 50), value=FEE * count)
    first = client.events(receipt, "JobSubmitted")[0]["args"]["jobId"]
    return [(first + i, a, b) for i, (a, b) in enumerate(ops)]


def product(a, b):
    return (a.astype(np.float64) @ b).astype(np.float32)


def send_together(client, calls: list) -> list:
    """Sign calls with consecutive nonces and send them in one JSON-RPC batch request (the
    node admits them before it seals); their receipts."""
    raws = [client.sign(call, gas=3_000_000) for call in calls]
    replies = httpx.post(client.url, json=[
        {"jsonrpc": "2.0", "id": i, "method": "eth_sendRawTransaction",
         "params": ["0x" + raw.hex()]} for i, raw in enumerate(raws)]).json()
    hashes = [r["result"] for r in sorted(replies, key=lambda r: r["id"])]
    return [client.wait_for_receipt(bytes.fromhex(h[2:])) for h in hashes]


def test_commit_jobs_claims_open_jobs_in_one_step_and_skips_taken_ones(clients):
    submitter, first, second, anyone = clients[1], registered(clients[2]), \
        registered(clients[3]), clients[4]
    jobs = submit_jobs(submitter, 3)
    (j0, a0, b0), (j1, a1, b1), (j2, a2, b2) = jobs
    first.send(first.market.functions.commitJobs([j0], [first.put_blob(product(a0, b0))]))
    claims_before = first.market.functions.workerInfo(second.address).call()[2]
    c_ids = [second.put_blob(product(a, b)) for _, a, b in jobs]
    receipt = second.send(second.market.functions.commitJobs([j0, j1, j2], c_ids))
    committed = [e["args"]["jobId"] for e in second.events(receipt, "ResultCommitted")]
    assert committed == [j1, j2]  # j0 was no longer open: skipped, not reverted
    assert [e["args"]["jobId"] for e in second.events(receipt, "JobClaimed")] == [j1, j2]
    assert first.get_job(j0)["worker"] == first.address
    assert second.get_job(j1)["worker"] == second.address
    assert second.get_job(j2)["status"] == COMMITTED
    assert second.market.functions.workerInfo(second.address).call()[2] == claims_before + 2

    escrow = anyone.market.functions.totalEscrow().call()
    w3 = anyone.w3
    paid_before = [w3.eth.get_balance(w.address) for w in (first, second)]
    receipt = anyone.send(anyone.market.functions.finalizeJobs([j0, j1, j2]))
    verified = {e["args"]["jobId"]: e["args"]["worker"]
                for e in anyone.events(receipt, "JobVerified")}
    assert verified == {j0: first.address, j1: second.address, j2: second.address}
    assert all(anyone.get_job(j)["status"] == DONE for j, _, _ in jobs)
    assert anyone.market.functions.totalEscrow().call() == escrow - 3 * FEE
    # fees, plus the block's reward split by FLOPs (docs/protocol.md: 0.001 ETH per GFLOP)
    flops = [2 * 6 * 5 * 4, 2 * (2 * 6 * 5 * 4)]
    reward = REWARD_PER_GFLOP * sum(flops) // 10**9
    for worker, jobs_done, f, before in zip((first, second), (1, 2), flops, paid_before,
                                            strict=True):
        assert w3.eth.get_balance(worker.address) - before == \
            jobs_done * FEE + reward * f // sum(flops)
    for j, a, b in jobs:
        np.testing.assert_allclose(anyone.get_blob(anyone.get_job(j)["cId"]),
                                   a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


def test_finalize_jobs_waits_for_a_later_block_and_slashes_a_wrong_result(clients):
    submitter, worker = clients[1], registered(clients[5])
    (j0, a0, b0), (j1, a1, b1) = submit_jobs(submitter, 2)
    right = worker.put_blob(product(a0, b0))
    wrong = worker.put_blob(product(a1, b1) + np.float32(0.5))
    f = worker.market.functions
    commit, early = send_together(worker, [f.commitJobs([j0, j1], [right, wrong]),
                                           f.finalizeJobs([j0, j1])])
    assert commit["blockNumber"] == early["blockNumber"] and early["status"] == 1
    # the seed comes from the commit's block hash: nothing is finalised in that block
    assert worker.events(early, "JobVerified") == worker.events(early, "JobFailed") == []
    assert worker.get_job(j0)["status"] == worker.get_job(j1)["status"] == COMMITTED

    stake = f.workerStake(worker.address).call()
    submitter_before = worker.w3.eth.get_balance(submitter.address)
    receipt = worker.send(f.finalizeJobs([j0, j1]))
    assert [e["args"]["jobId"] for e in worker.events(receipt, "JobVerified")] == [j0]
    [failed] = worker.events(receipt, "JobFailed")
    assert failed["args"]["jobId"] == j1 and failed["args"]["slashed"] == stake // 2
    assert f.workerStake(worker.address).call() == stake - stake // 2
    assert worker.w3.eth.get_balance(submitter.address) - submitter_before == stake // 4
    assert worker.get_job(j1)["status"] == OPEN and worker.get_job(j1)["worker"] == "0x" + "0" * 40


def test_commit_jobs_refuses_unstaked_senders_and_mismatched_lists(clients):
    submitter, unstaked, worker = clients[1], clients[6], registered(clients[7])
    [(job, a, b)] = submit_jobs(submitter, 1)
    c_id = unstaked.put_blob(product(a, b))
    with pytest.raises(TransactionReverted, match="stake below minStake"):
        unstaked.send(unstaked.market.functions.commitJobs([job], [c_id]))
    with pytest.raises(TransactionReverted, match="length mismatch"):
        worker.send(worker.market.functions.commitJobs([job], [c_id, c_id]))
    # with fixed gas the revert is mined; its reason is still reported
    with pytest.raises(TransactionReverted, match="stake below minStake"):
        unstaked.send(unstaked.market.functions.commitJobs([job], [c_id]), gas=300_000)
    assert worker.get_job(job)["status"] == OPEN


def test_wait_answers_when_a_block_or_transaction_is_sealed(node, clients):
    client = clients[1]
    head = client.w3.eth.block_number
    # no transaction, no block (block time 0): the long poll times out with the same head
    assert httpx.get(f"{node.url}/wait", params={"block": head + 1, "timeout": 0.2}) \
        .json() == {"head": head, "gas_price": client.w3.eth.gas_price}
    raw = client.sign(client.market.functions.register(), value=ETHER, gas=200_000)
    sender = threading.Timer(0.2, client.w3.eth.send_raw_transaction, (raw,))
    sender.start()
    answer = httpx.get(f"{node.url}/wait", params={"block": head + 1, "timeout": 30},
                       timeout=60).json()
    sender.join()
    assert answer["head"] >= head + 1 and client.w3.eth.block_number >= head + 1
    tx_hash = client.w3.eth.send_raw_transaction(
        client.sign(client.market.functions.register(), value=ETHER, gas=200_000))
    httpx.get(f"{node.url}/wait", params={"tx": tx_hash.to_0x_hex(), "timeout": 30},
              timeout=60).raise_for_status()
    assert client.w3.eth.get_transaction_receipt(tx_hash)["status"] == 1
    assert httpx.get(f"{node.url}/wait", params={"tx": "0xzz"}).status_code == 400


def test_one_long_poll_waits_for_several_transactions(node, clients):
    """GET /wait with several `tx` answers once all are mined, each receipt as
    eth_getTransactionReceipt gives it; `confirm_all` returns web3's receipts from it and
    names a revert among them; `send_raw` returns the hash and names a refusal."""
    from eth_utils import keccak
    from web3.exceptions import Web3RPCError

    client = clients[0]  # registers here; the other tests keep their roles
    f = client.market.functions
    register = client.sign(f.register(), value=ETHER, gas=200_000)
    assert client.send_raw(register) == keccak(register)
    with pytest.raises(Web3RPCError, match="already known|nonce too low"):
        client.send_raw(register)
    calls = [f.workerStake(client.address), f.commitJobs([1], [b"\1" * 32] * 2)]
    # a view called as a transaction succeeds; the commit reverts: both mined
    posted = [(call, client.post(call, gas=300_000)) for call in calls]
    answer = httpx.get(f"{node.url}/wait", params={"tx": ["0x" + h.hex() for _, h in posted],
                                                   "timeout": 30}, timeout=60).json()
    expected = [httpx.post(node.url, json={
        "jsonrpc": "2.0", "id": 1, "method": "eth_getTransactionReceipt",
        "params": ["0x" + h.hex()]}).json()["result"] for _, h in posted]
    assert answer["receipts"] == expected and answer["receipt"] == expected[0]
    assert [r["status"] for r in expected] == ["0x1", "0x0"]
    assert client.confirm_all(posted[:1]) == [client.w3.eth.get_transaction_receipt(
        posted[0][1])]
    with pytest.raises(TransactionReverted, match="commitJobs reverted.*length mismatch"):
        client.confirm_all(posted)
    # a hash the node never saw has left the mempool: null, and the client asks for it alone
    unknown = "0x" + "ab" * 32
    answer = httpx.get(f"{node.url}/wait", params={"tx": [unknown, "0x" + posted[0][1].hex()],
                                                   "timeout": 1}).json()
    assert answer["receipts"] == [None, expected[0]]
    bad = httpx.get(f"{node.url}/wait", params={"tx": [unknown] * 65, "timeout": 0})
    assert bad.status_code == 400 and "more than 64 tx" in bad.json()["error"]


def test_views_from_one_eth_call_equal_web3s(clients):
    """ChainClient.call (one eth_call, decoded here) returns what web3's call returns for the
    views the workers read; a call that reverts raises web3's ContractLogicError with the
    same message; balance() is eth_getBalance."""
    from web3.exceptions import ContractLogicError

    client = registered(clients[5])
    [(job, _, _)] = submit_jobs(client, 1)
    f = client.market.functions
    for call in (f.getJob(job), f.getJob(10**6), f.workerInfo(client.address),
                 f.workerStake(client.address), f.jobCount(), f.minStake(), f.totalEscrow()):
        assert client.call(call) == call.call()
    assert client.balance(client.address) == client.w3.eth.get_balance(client.address)
    reverting = f.commitJobs([job], [b"\1" * 32] * 2)
    with pytest.raises(ContractLogicError) as by_web3:
        reverting.call()
    with pytest.raises(ContractLogicError) as by_call:
        client.call(reverting)
    assert str(by_call.value) == str(by_web3.value) and "execution reverted" in str(by_web3.value)


def pending_behind_gap(client) -> tuple[bytes, bytes, int]:
    """Two registrations signed, the second sent: it stays pending behind the nonce of the
    first. (The first, raw; the second's hash; the head once the node sealed the block its
    admission woke up, without it.)"""
    first, second = (client.sign(client.market.functions.register(), value=ETHER,
                                 gas=200_000) for _ in range(2))
    gapped = client.send_raw(second)
    time.sleep(0.3)
    return first, gapped, client.w3.eth.block_number


def test_a_transaction_behind_a_nonce_gap_waits_without_empty_blocks(node, clients):
    """A pending transaction whose nonce is ahead of its sender's next one cannot be
    included: the node (sealing on pending, no block time) seals no more blocks for it (it
    sealed hundreds of empty ones a second), and includes it once the gap is filled."""
    client = clients[7]
    first, gapped, head = pending_behind_gap(client)
    time.sleep(0.5)
    assert client.w3.eth.block_number == head
    receipts = client.wait_for_receipts([client.send_raw(first), gapped])
    assert [r["blockNumber"] for r in receipts] == [head + 1, head + 1]
    assert [r["status"] for r in receipts] == [1, 1]


def test_long_polls_of_one_block_all_answered_when_it_is_sealed(node, clients):
    """Forty long polls wait on the node's event loop at once, for the next block (with the
    market's logs) and for a pending transaction (behind a nonce gap): the block that
    includes it answers all of them, each as eth_getLogs and eth_getTransactionReceipt
    answer; a poll with a short timeout answers with the old head meanwhile."""
    client = clients[6]
    first, gapped, head = pending_behind_gap(client)
    tx = "0x" + gapped.hex()
    polls = [{"block": head + 1, "logs": MARKET, "timeout": 30}] * 20 + \
        [{"tx": tx, "timeout": 30}] * 20

    async def wait_all():
        async with httpx.AsyncClient(timeout=60) as http:
            waiting = [asyncio.create_task(http.get(f"{node.url}/wait", params=p))
                       for p in polls]
            short = await http.get(f"{node.url}/wait", params={"block": head + 1,
                                                                "timeout": 0.3})
            assert short.json()["head"] == head and not any(t.done() for t in waiting)
            await asyncio.to_thread(client.send_raw, first)
            return [r.json() for r in await asyncio.gather(*waiting)]

    answers = asyncio.run(wait_all())
    logs = client.w3.provider.make_request("eth_getLogs", [{
        "address": MARKET, "fromBlock": hex(head + 1), "toBlock": hex(head + 1)}])["result"]
    receipt = client.w3.provider.make_request("eth_getTransactionReceipt", [tx])["result"]
    assert len(logs) == 2 and receipt["blockNumber"] == hex(head + 1)
    assert all(a["head"] == head + 1 and a["logs"] == logs for a in answers[:20])
    assert all(a["receipt"] == receipt and a["receipts"] == [receipt] for a in answers[20:])


def test_receipts_from_long_polls_are_formatted_as_web3_formats_them(node, clients):
    """formatted_receipt (used on every receipt a long poll brings) gives web3's receipt, field
    by field and type by type: with logs, reverted without logs, and one whose fields are
    not the node's hex strings (web3's formatter then)."""
    from web3._utils.method_formatters import receipt_formatter
    from web3.datastructures import AttributeDict

    from chain.client import formatted_receipt

    client = registered(clients[4])
    receipt = client.send(client.market.functions.submitJobs(
        [b"\1" * 32] * 2, [b"\2" * 32] * 2, [1] * 2, [2] * 2, [2] * 2, [2] * 2, [1] * 2,
        [FEE] * 2, 50), value=2 * FEE)
    reverted = client.post(client.market.functions.commitJobs([1], [b"\1" * 32] * 2),
                           gas=300_000)
    client.wait_for_block(client.w3.eth.block_number + 1, 5)
    for tx_hash in (receipt["transactionHash"], reverted):
        raw = client.w3.provider.make_request("eth_getTransactionReceipt",
                                              ["0x" + bytes(tx_hash).hex()])["result"]
        odd = {**raw, "gasUsed": int(raw["gasUsed"], 16)}
        for value in (raw, odd):
            expected = AttributeDict.recursive(receipt_formatter(value))
            got = formatted_receipt(value)
            assert got == expected == client.w3.eth.get_transaction_receipt(tx_hash)
            assert {k: type(v) for k, v in got.items()} == \
                {k: type(v) for k, v in expected.items()}
            for log, web3_log in zip(got["logs"], expected["logs"], strict=True):
                assert {k: type(v) for k, v in log.items()} == \
                    {k: type(v) for k, v in web3_log.items()}
    assert len(receipt["logs"]) == 2
