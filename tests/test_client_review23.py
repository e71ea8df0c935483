"""Review of the submitter's path (node/client.py, chain/client.py): a submission whose
answer is lost, a nonce taken by a second client with the same key, and a nudge the node
refuses while a job is being followed.

Against a real chain node process on 127.0.0.1 (the `node` fixture: blocks only when
transactions are pending), its contract and blob store, real HTTP (helpers.FlakyProxy to cut
answers). The "worker" is a staked dev account sending claimJob / commitResult / finalize
itself; numpy is the reference for every result and the chain's books for every fee."""
import threading

import numpy as np
import pytest
from eth_utils import function_abi_to_4byte_selector
from helpers import FlakyProxy, finalize_when_due, wait_for

from chain.blobs import blob_id, encode_array
from chain.client import ChainClient, sign_dynamic_fee
from chain.devnet import dev_account
from node.client import JobClient, RemoteJobError
from node.market import JOB_DONE, JOB_OPEN, Market

pytestmark = pytest.mark.timeout(120)
ETHER = 10**18
WITHDRAW_GAS = 200_000
FEE = 10**15


@pytest.fixture(scope="module")
def worker(node):
    """A staked dev account acting as a worker by hand."""
    market = Market(node.url, dev_account(11))
    market.send("register", value=4 * ETHER)
    yield market
    market.close()


def _operands(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((5, 4), np.float32), rng.standard_normal((4, 3), np.float32)


def _do_job(worker: Market, job_id: int, a: np.ndarray, b: np.ndarray) -> None:
    worker.send("claimJob", job_id)
    worker.send("commitResult", job_id, worker.put_array(a @ b))
    finalize_when_due(worker, job_id)


def _submission_marker(client: JobClient) -> bytes:
    """submitJobs' selector as it appears in the hex of a raw transaction sent to POST /wait."""
    abi = next(e for e in client.market.contract.abi if e.get("name") == "submitJobs")
    return function_abi_to_4byte_selector(abi).hex().encode()


def _transfer(chain: ChainClient, to: str, value: int) -> None:
    """A plain ether transfer from `chain`'s account, mined."""
    with chain._lock:
        nonce = chain._next_nonce()
    raw = sign_dynamic_fee(chain._key, chain_id=chain.chain_id, nonce=nonce,
                           max_fee=chain._max_fee(), max_priority_fee=0, gas=21_000,
                           to=bytes.fromhex(to[2:]), value=value, data=b"")
    assert chain.wait_for_receipt(chain.send_raw(raw))["status"] == 1


def _paid(client: JobClient, before: int) -> int:
    return before - client.market.balance_of(client.address)


# -- a submission whose answer is lost ---------------------------------------------------------


def test_a_submission_whose_answers_are_lost_opens_its_job_once_and_returns_it(node, worker):
    """The node admits the submitJobs transaction and the connection is cut before its answer,
    twice (the send and the keep-alive connection's one resend): submit() used to raise
    "[stage submit] RemoteDisconnected" while the job was open and its fee in escrow, so the
    user submitted again and paid twice, the first job computed and paid for nobody. The same
    signed transaction is now sent again: the job opens once and submit() returns it."""
    a, b = _operands(1)
    proxy = FlakyProxy(node.url)
    client = JobClient(proxy.url, dev_account(3), fee_wei=FEE, timeout=30, poll_interval=0.1)
    try:
        jobs, balance = client.market.job_count(), client.market.balance_of(client.address)
        proxy.lose, proxy.lose_path = 2, "/wait"
        proxy.lose_marker = _submission_marker(client)
        (p,) = client.submit([(a, b)])
        assert proxy.lost == 2
        assert client.market.job_count() == jobs + 1  # opened once
        job = client.market.job(p.job_id)
        assert job.status == JOB_OPEN and job.submitter == client.address
        assert job.a_id == blob_id(encode_array(a)) and job.b_id == blob_id(encode_array(b))
        assert FEE <= _paid(client, balance) < 2 * FEE  # one fee, and gas
        _do_job(worker, p.job_id, a, b)
        (c,) = client.wait([p])
    finally:
        client.close()
        proxy.close()
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


def test_a_submission_whose_answers_never_come_names_its_transaction_and_pays_once(node):
    """Every answer to the submission lost (the node unreachable after admitting it): the
    client sends the same transaction a bounded number of times, pays one fee, and its error
    names the transaction and how to find and cancel the job it may have opened (it used to
    say only "RemoteDisconnected", although the job was open and its fee escrowed)."""
    a, b = _operands(2)
    proxy = FlakyProxy(node.url)
    client = JobClient(proxy.url, dev_account(4), fee_wei=FEE, timeout=30, poll_interval=0.05)
    try:
        jobs, balance = client.market.job_count(), client.market.balance_of(client.address)
        proxy.lose, proxy.lose_path = 1000, "/wait"
        proxy.lose_marker = _submission_marker(client)
        with pytest.raises(RemoteJobError) as raised:
            client.submit([(a, b)])
        proxy.lose = 0
        assert raised.value.stage == "submit"
        message = str(raised.value)
        assert "may still open the jobs" in message and "needle-net cancel" in message
        tx_hash = bytes.fromhex(message.split("transaction 0x")[1][:64])
        receipt = client.market.client.wait_for_receipt(tx_hash)
        (opened,) = client.market.events_in(receipt, "JobSubmitted")
        assert client.market.job_count() == jobs + 1  # the resends opened nothing more
        assert client.market.job(opened["jobId"]).a_id == blob_id(encode_array(a))
        assert FEE <= _paid(client, balance) < 2 * FEE
        client.market.send("cancel", opened["jobId"])  # the refund the message points to
        assert _paid(client, balance) < FEE
    finally:
        client.close()
        proxy.close()


# -- two clients with one key ------------------------------------------------------------------


def test_a_nonce_taken_by_another_client_with_the_same_key_does_not_fail_a_submission(node):
    """Two clients with one key (every `Network()` uses the first dev account by default: a
    script and `needle-net submit` at once). The other client's transaction takes the nonce
    this one has cached; submit() used to fail with "nonce too low" (or "already used by a
    pending transaction"), its operands uploaded for nothing. It is now signed again with the
    next nonce, once, and each submission opens exactly its own job."""
    key = dev_account(5)
    first = JobClient(node.url, key, fee_wei=FEE, timeout=30)
    second = JobClient(node.url, key, fee_wei=FEE, timeout=30)
    try:
        balance = first.market.balance_of(first.address)
        submitted = [first.submit([_operands(3)])[0]]  # caches its next nonce
        submitted += second.submit([_operands(4)])  # mined with that nonce
        submitted += first.submit([_operands(5)])  # "nonce too low"
        # the other client's transaction still pending when this one sends (or just mined)
        second.market.client.forget_nonce()
        posted = second.market.post_signed(
            second.market.sign_with_gas(200_000, "cancel", submitted[1].job_id))
        submitted += first.submit([_operands(6)])
        second.market.client.confirm_all([posted])
        seeds = [3, 4, 5, 6]
        assert len({p.job_id for p in submitted}) == 4
        for p, seed in zip(submitted, seeds, strict=True):
            job = first.market.job(p.job_id)
            assert job.submitter == first.address
            assert job.a_id == blob_id(encode_array(_operands(seed)[0]))
        paid = _paid(first, balance) + FEE  # the cancelled job's fee came back
        assert 4 * FEE <= paid < 5 * FEE  # four fees, and gas
    finally:
        first.close()
        second.close()


# -- a nudge the node refuses ------------------------------------------------------------------


def test_a_finalize_the_node_refuses_does_not_end_the_wait(node, worker):
    """The worker commits and does not finalise; the client steps in after a few blocks, but
    its account cannot pay the gas any more and the node refuses the finalize ("insufficient
    funds"). wait() used to end there with that raw Web3RPCError although the result was
    committed and about to be verified and paid for; it now goes on following the job and
    returns the result once the worker finalises it."""
    a, b = _operands(7)
    key = dev_account(6)
    client = JobClient(node.url, key, fee_wei=FEE, timeout=60, poll_interval=0.1)
    drain = ChainClient(node.url, key.key)
    filler = ChainClient(node.url, dev_account(7).key)
    box = {}

    def follow():
        try:
            box["result"] = client.wait([p])
        except BaseException as err:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = err

    try:
        (p,) = client.submit([(a, b)])
        worker.send("claimJob", p.job_id)
        worker.send("commitResult", p.job_id, worker.put_array(a @ b))
        # the submitter's balance spent elsewhere, down to less than a finalize's gas
        left = 10**12
        _transfer(drain, dev_account(0).address,
                  drain.balance(key.address) - 21_000 * drain._max_fee() - left)
        for _ in range(5):  # blocks pass: the client's patience with the worker runs out
            _transfer(filler, filler.address, 1)
        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        wait_for(lambda: getattr(p, "nudge_refused", "") or not thread.is_alive(), 30,
                 "the client's finalize to be refused")
        assert thread.is_alive(), f"wait() ended on a refused finalize: {box}"
        assert "insufficient funds" in p.nudge_refused
        finalize_when_due(worker, p.job_id)
        thread.join(30)
        assert not thread.is_alive() and "error" not in box, box
        assert client.market.job(p.job_id).status == JOB_DONE
    finally:
        client.close()
        drain.close()
        filler.close()
    (c,) = box["result"]
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


def test_a_job_whose_verification_passes_the_block_gas_limit_is_refused_before_submission():
    """With a node allowing blobs above 256 MiB, 15000x1 @ 1x15000 float32 passed every check
    and opened a job no worker could be paid for: its finalize needs more gas than a block."""
    from chain.params import GENESIS_GAS_LIMIT
    from node.client import validate_operands

    def precompile_gas(m, k, n):  # docs/protocol.md: 5000 + (1 + rounds) per element
        return 5000 + (1 + 8) * (m * k + k * n + m * n)

    limit = 1 << 31
    big = np.ones((15000, 1), np.float32), np.ones((1, 15000), np.float32)
    assert precompile_gas(15000, 1, 15000) > GENESIS_GAS_LIMIT
    with pytest.raises(ValueError, match="above the block gas limit"):
        validate_operands(*big, limit)
    fits = np.ones((14000, 1), np.float32), np.ones((1, 14000), np.float32)
    assert precompile_gas(14000, 1, 14000) * 64 // 63 < GENESIS_GAS_LIMIT - 10**6
    assert validate_operands(*fits, limit) == (1, 14000, 1, 14000)


def test_signing_while_the_node_is_unreachable_loses_no_nonce(node):
    """sign() took a nonce and then asked the node for the fee (its cache lasts 2 s): each
    attempt during an outage lost one nonce, and the transaction sent after it waited behind
    the gap for good (a worker's commit after an outage: never mined, the claim expired)."""
    proxy = FlakyProxy(node.url)
    market = Market(proxy.url, dev_account(12))
    try:
        market.send("register", value=ETHER)  # the nonce is cached from here on
        proxy.failed, proxy.failures = 0, 10**9
        market.client._fee = None  # as FEE_REFRESH_S after the last answer
        for _ in range(3):  # a fixed gas limit, as a worker's commit: no estimate first
            with pytest.raises(ConnectionError):
                market.send_with_gas(WITHDRAW_GAS, "requestWithdraw")
        proxy.failures = 0
        market.client.timeout = 10  # a transaction behind a gap would wait it out
        receipt = market.send_with_gas(WITHDRAW_GAS, "requestWithdraw")
        assert receipt["status"] == 1
        direct = Market(node.url, dev_account(12))
        assert direct.client.w3.eth.get_transaction_count(direct.address, "pending") == 2
    finally:
        proxy.close()
