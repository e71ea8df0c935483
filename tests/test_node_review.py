"""Review of the worker, client, compute and market paths, against a real chain node process
on 127.0.0.1 with signed transactions and numpy as the reference: jobs the chain accepts
but the worker could not compute, jobs the chain would cancel or slash whatever the worker
did (it must skip them before any transaction), a worker restarted after a crash that must
neither lose a paid job nor leave an open one behind, and a client that must refuse a job
no verifier can accept before it spends a fee."""
import json
from dataclasses import asdict

import httpx
import numpy as np
import pytest
from helpers import FlakyProxy, run_worker, stop_worker, submit_as_declared, wait_for

from chain.devnet import dev_account, dev_accounts
from node import compute
from node.client import JobClient, RemoteJobError
from node.market import JOB_CANCELLED, JOB_DONE, JOB_OPEN, Market, finalize_gas
from node.worker import FINISHED, JobRecord, Worker, WorkerConfig

pytestmark = pytest.mark.timeout(300)
FEE = 10**15
ETHER = 10**18
FP32, EXACT = 1, 0
K_FLOAT_LIMIT = 1 << 22  # the verifier's float32 bound: k < 2^22


def _claimed(market: Market) -> set[int]:
    return {e["args"]["jobId"] for e in market.contract.events.JobClaimed.get_logs(from_block=0)}


# -- compute ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.int16, np.int64])
def test_a_2d_a_with_a_batch_of_one_b_is_computed_as_numpy_broadcasts_it(dtype):
    """The chain accepts A (m, k) with B (1, k, n) for batch 1 and checks a (1, m, n) C;
    compute.matmul refused the pair, so a worker failed such a job after claiming it."""
    rng = np.random.default_rng(3)
    if dtype == np.float32:
        a, b = rng.standard_normal((6, 10), dtype), rng.standard_normal((1, 10, 4), dtype)
    else:
        info = np.iinfo(dtype)
        a = rng.integers(max(info.min, -2**40), min(info.max, 2**40), (6, 10), dtype,
                         endpoint=True)  # within the exact verifier's range
        b = rng.integers(max(info.min, -1000), min(info.max, 1000), (1, 10, 4), dtype,
                         endpoint=True)
    compute.check_operands(a, b, (1, 6, 10, 4), dtype != np.float32)
    for device in (None, compute.best_device()):
        c = compute.matmul(a, b, device)
        if dtype == np.float32:
            assert c.dtype == np.float32 and c.shape == (1, 6, 4)
            np.testing.assert_allclose(c, np.matmul(a.astype(np.float64), b), rtol=1e-5,
                                       atol=1e-5)
        else:
            assert c.dtype == np.int64
            np.testing.assert_array_equal(c, np.matmul(a.astype(np.int64), b.astype(np.int64)))


def test_operands_beyond_the_verifiers_bounds_are_refused_and_an_overflow_is_caught():
    """The chain cancels a job whose operands the verifier cannot bound and fails a C that
    holds Inf: check_operands and check_result say so before any transaction."""
    big = np.full((2, 3), 1 << 40, np.int64)
    with pytest.raises(compute.OperandError, match=r"not below \(2\^61 - 1\) / 2"):
        compute.check_operands(big, big.T.copy(), (1, 2, 3, 2), True)
    compute.check_operands(big.astype(np.int32) * 0 + 1000, big.T.astype(np.int32) * 0 + 7,
                           (1, 2, 3, 2), True)  # in range: accepted
    a = np.ones((1, K_FLOAT_LIMIT), np.float32)
    with pytest.raises(compute.OperandError, match="too large for a float32 error bound"):
        compute.check_operands(a, a.T.copy(), (1, 1, K_FLOAT_LIMIT, 1), False)
    x, y = np.full((2, 2), 1e20, np.float32), np.full((2, 2), 1e19, np.float32)
    assert compute.may_overflow(x, y, False)
    with np.errstate(over="ignore"):
        c = compute.matmul(x, y)
    assert not np.isfinite(c).all()
    with pytest.raises(compute.OperandError, match="overflows float32"):
        compute.check_result(c, False)


# -- the worker, against the chain -----------------------------------------------------------


def test_worker_computes_what_the_chain_accepts_and_skips_what_it_would_cancel_or_slash(
        node, tmp_path):
    rng = np.random.default_rng(7)
    a2, b1 = rng.standard_normal((6, 10), np.float32), rng.standard_normal((1, 10, 4),
                                                                           np.float32)
    i2 = rng.integers(-2**15, 2**15, (5, 7), np.int16)
    j1 = rng.integers(-2**15, 2**15, (1, 7, 3), np.int16)
    huge = np.full((2, 3), 1 << 40, np.int64)
    long_a = np.ones((1, K_FLOAT_LIMIT), np.float32)
    ox, oy = np.full((2, 2), 1e20, np.float32), np.full((2, 2), 1e19, np.float32)
    # a large job (claimed, not computed first) whose product overflows in one entry
    la, lb = rng.standard_normal((600, 512), np.float32), rng.standard_normal((512, 512),
                                                                                np.float32)
    la[4, :] = 1e20
    lb[:, 9] = 1e20
    good = [(a2, b1, (1, 6, 10, 4), FP32), (i2, j1, (1, 5, 7, 3), EXACT)]
    bad = [  # (the reason the worker gives, the job)
        ("is not below (2^61 - 1) / 2", (huge, huge.T.copy(), (1, 2, 3, 2), EXACT)),
        ("too large for a float32 error bound",
         (long_a, long_a.T.copy(), (1, 1, K_FLOAT_LIMIT, 1), FP32)),
        ("A @ B overflows float32", (ox, oy, (1, 2, 2, 2), FP32)),
        ("A @ B overflows float32", (la, lb, (1, 600, 512, 512), FP32)),
    ]
    account = dev_accounts(5)[4]
    worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER),
                    account)
    thread = run_worker(worker)
    submitter = Market(node.url, dev_account(1))
    try:
        ids = submit_as_declared(submitter, FEE, [*good, *(job for _, job in bad)])
        wait_for(lambda: {j["job_id"] for j in worker.job_list() if j["stage"] in FINISHED}
                 >= set(ids), 180, "the worker to finish or skip every job")
    finally:
        stop_worker(worker, thread)
    records = {j["job_id"]: j for j in worker.job_list()}

    for job_id, (x, y, _, _) in zip(ids[:len(good)], good, strict=True):
        job = submitter.job(job_id)
        assert records[job_id]["stage"] == "verified", records[job_id]
        assert job.status == JOB_DONE and job.worker == account.address
        c = submitter.get_array(job.c_id)
        assert c.shape == (1, x.shape[0], y.shape[-1])
        if x.dtype == np.float32:
            np.testing.assert_allclose(c, np.matmul(x.astype(np.float64), y), rtol=1e-5,
                                       atol=1e-5)
        else:
            np.testing.assert_array_equal(c, np.matmul(x.astype(np.int64), y.astype(np.int64)))
    claimed = _claimed(submitter)
    for job_id, (reason, _) in zip(ids[len(good):], bad, strict=True):
        assert records[job_id]["stage"] == "skipped", records[job_id]
        assert reason in records[job_id]["detail"]
        assert submitter.job(job_id).status == JOB_OPEN and job_id not in claimed
    assert submitter.stake_of(account.address) == ETHER  # nothing slashed
    submitter.close()


def _finalized(market: Market, job_id: int) -> None:
    """Finalise a committed job from the next block on (a finalize in the commit's own
    block reverts)."""
    job = market.job(job_id)
    for _ in range(20):
        try:
            market.send_with_gas(finalize_gas(job), "finalize", job_id)
            return
        except Exception:  # noqa: BLE001 - same block as the commit: wait for the next
            market.wait_for_block(market.block_number() + 1, 1.0)
    raise AssertionError(f"job {job_id} could not be finalised")


def test_a_restarted_worker_keeps_verdicts_reached_before_the_crash_and_retakes_open_jobs(
        node, tmp_path):
    """A worker crashed after its job was verified (or failed) but before it saved the
    verdict, and after it began fetching an open job but before claiming it. Restarted,
    it must count the fee it earned and the slash it took, and do the open job, whose
    JobSubmitted lies before the block its scan resumes from."""
    rng = np.random.default_rng(11)
    pairs = [(rng.standard_normal((8, 5), np.float32), rng.standard_normal((5, 3), np.float32))
             for _ in range(3)]
    account = dev_accounts(7)[6]
    submitter, me = Market(node.url, dev_account(2)), Market(node.url, account)
    try:
        me.send("register", value=ETHER)
        paid, slashed, open_ = submit_as_declared(
            submitter, FEE, [(a, b, (1, *a.shape, b.shape[1]), FP32) for a, b in pairs])
        for job_id, wrong in ((paid, 0.0), (slashed, 1.0)):  # the first run's work
            me.send("claimJob", job_id)
            a, b = pairs[job_id - paid]
            me.send("commitResult", job_id, me.put_array(a @ b + np.float32(wrong)))
            _finalized(me, job_id)
        assert submitter.job(paid).status == JOB_DONE
        assert submitter.job(slashed).status == JOB_OPEN  # failed and reopened
        assert me.stake_of(account.address) == ETHER // 2
        state = {"next_block": me.block_number() + 1, "jobs": [
            asdict(JobRecord(paid, 1, 8, 5, 3, FEE, "committed", started=1.0)),
            asdict(JobRecord(slashed, 1, 8, 5, 3, FEE, "committed", started=2.0)),
            asdict(JobRecord(open_, 1, 8, 5, 3, FEE, "fetching", started=3.0))]}
        (tmp_path / "worker-state.json").write_text(json.dumps(state))
    finally:
        me.close()

    worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER),
                    account)
    thread = run_worker(worker)
    try:
        wait_for(lambda: submitter.job(open_).status == JOB_DONE
                 and submitter.job(slashed).status == JOB_DONE, 120,
                 "the restarted worker to do the open and the reopened job")
        wait_for(lambda: all(j["stage"] in FINISHED for j in worker.job_list()), 60,
                 "the worker to record every job")
    finally:
        stop_worker(worker, thread)
    stages = [(j["job_id"], j["stage"]) for j in reversed(worker.job_list())]
    assert stages[:2] == [(paid, "verified"), (slashed, "failed")]
    assert sorted(stages[2:]) == [(slashed, "verified"), (open_, "verified")]
    assert worker.status()["earned_wei"] == 3 * FEE
    assert worker.job_list()[-2]["detail"] == f"slashed {ETHER // 2} wei"
    for job_id in (open_, slashed):
        job = submitter.job(job_id)
        assert job.worker == account.address
        a, b = pairs[job_id - paid]
        np.testing.assert_allclose(submitter.get_array(job.c_id), a.astype(np.float64) @ b,
                                   rtol=1e-5, atol=1e-5)
    # the journal holds each finished attempt once; nothing is left in flight
    lines = (tmp_path / "worker-jobs.jsonl").read_text().splitlines()
    assert sorted((json.loads(x)["job_id"], json.loads(x)["stage"]) for x in lines) == \
        sorted(stages)
    assert json.loads((tmp_path / "worker-state.json").read_text())["jobs"] == []
    submitter.close()


# -- the client -------------------------------------------------------------------------------


def test_client_refuses_a_float_job_no_verifier_can_bound_before_spending_a_fee(node):
    """k >= 2^22 in float32: the chain cancels such a job at finalisation after a worker
    spent gas on it; the client must say so at validation, before upload or fee."""
    client = JobClient(node.url, dev_account(3), fee_wei=FEE, timeout=30)
    a = np.ones((1, K_FLOAT_LIMIT), np.float32)
    before = client.market.job_count()
    try:
        with pytest.raises(RemoteJobError, match="too large for a float32 job") as err:
            client.submit([(a, a.T.copy())])
        assert err.value.stage == "validate"
        after = client.market.job_count()
        for job_id in range(before, after):  # before the fix: refund what it opened
            if client.market.job(job_id).status == JOB_OPEN:
                client.market.send("cancel", job_id)
    finally:
        client.close()
    assert after == before
    ok = np.ones((1, K_FLOAT_LIMIT - 1), np.float32)  # one below the bound is accepted
    from node.client import validate_operands
    assert validate_operands(ok, ok.T.copy(), 1 << 30) == (1, 1, K_FLOAT_LIMIT - 1, 1)


@pytest.mark.parametrize("failures", [2, 10**6])
def test_a_verified_result_whose_download_fails_is_fetched_again(node, tmp_path, failures):
    """The client fetches C as soon as it is committed. A failed download used to be final:
    once the chain verified the job (the fee paid), wait() raised and the result was left
    behind. Now it is fetched again each block until the deadline, and if it never arrives
    the error says how to download the paid-for result later."""
    from chain.blobhttp import BlobClient

    rng = np.random.default_rng(failures % 97)
    a, b = rng.standard_normal((24, 16), np.float32), rng.standard_normal((16, 8), np.float32)
    account = dev_accounts(7)[6]
    worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER),
                    account)
    thread = run_worker(worker)
    # the never-arriving case waits out the whole timeout: long enough for a worker to be
    # paid for this tiny job on a loaded machine, no longer
    client = JobClient(node.url, dev_account(3), timeout=12, poll_interval=0.2)
    proxy = FlakyProxy(client.market.client.info["blob_url"], failures)
    try:
        pending = client.submit([(a, b)])
        client.market.blobs = BlobClient(proxy.url, client.market.max_blob_bytes)
        if failures == 2:
            (c,) = client.wait(pending)
            np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
            assert proxy.requests == 3
        else:
            with pytest.raises(RemoteJobError, match="needle-net fetch") as raised:
                client.wait(pending)
            assert raised.value.stage == "fetch" and "503" in str(raised.value)
            assert proxy.requests > 2  # fetched again, not given up at the first failure
            assert client.market.job(pending[0].job_id).status == JOB_DONE  # paid for
    finally:
        proxy.close()
        client.close()
        stop_worker(worker, thread)


def test_a_claim_whose_earlier_send_landed_is_kept(node, tmp_path):
    """A claim sent, its answer lost to a network error and sent again: the retry reverts
    (the job is no longer open) although the first send made it this worker's. The worker
    used to drop the job, which then expired with a 10 % stake cut; it keeps it now, and
    still drops a job another worker claimed."""
    rng = np.random.default_rng(12)
    a, b = rng.standard_normal((8, 5), np.float32), rng.standard_normal((5, 3), np.float32)
    account, other = dev_accounts(9)[8], dev_accounts(10)[9]
    submitter, me, rival = (Market(node.url, k) for k in (dev_account(2), account, other))
    worker = None
    try:
        for market in (me, rival):
            market.send("register", value=ETHER)
        mine, theirs = submit_as_declared(submitter, FEE, [(a, b, (1, 8, 5, 3), FP32)] * 2)
        me.send("claimJob", mine)  # the send whose answer was lost
        rival.send("claimJob", theirs)
        worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER),
                        account)
        records = [JobRecord(job_id, 1, 8, 5, 3, FEE, "fetching") for job_id in (mine, theirs)]
        worker.jobs.extend(records)
        assert worker._try_claim(records[0], submitter.job(mine)) and \
            records[0].stage == "claimed"
        assert not worker._try_claim(records[1], submitter.job(theirs)) and \
            records[1] not in worker.jobs
        assert submitter.job(mine).worker == account.address
    finally:
        for market in (submitter, me, rival):
            market.close()
        if worker is not None:
            worker.chain.close()


def test_the_client_rides_out_a_node_that_drops_its_requests(node, tmp_path):
    """The chain node's connection cut a few times while the client follows its job (a
    restart, a proxy): the long poll is asked again and the verified result returned (the
    first cut used to escape wait() as a raw httpx error, the job neither followed nor
    cancelled)."""
    rng = np.random.default_rng(13)
    a, b = rng.standard_normal((20, 12), np.float32), rng.standard_normal((12, 6), np.float32)
    account = dev_accounts(11)[10]
    worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER),
                    account)
    thread = run_worker(worker)
    proxy = FlakyProxy(node.url)
    client = JobClient(proxy.url, dev_account(3), timeout=60, poll_interval=0.2)
    try:
        pending = client.submit([(a, b)])
        before, proxy.failures, proxy.drop = proxy.requests, 3, True
        (c,) = client.wait(pending)
        np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
        assert proxy.failed == 3 and proxy.requests > before + 3
    finally:
        client.close()
        proxy.close()
        stop_worker(worker, thread)


def test_a_job_cancelled_elsewhere_cancels_the_rest_of_its_batch(node):
    """One job of a batch cancelled by its submitter from another process: wait() says so,
    and the batch's other open job is cancelled for its fee too instead of left behind
    unfollowed (no worker runs here, so both stay open until then)."""
    rng = np.random.default_rng(14)
    pairs = [(rng.standard_normal((4, 3), np.float32), rng.standard_normal((3, 2), np.float32))
             for _ in range(2)]
    key = dev_account(4)
    client = JobClient(node.url, key, fee_wei=FEE, timeout=60, poll_interval=0.2)
    elsewhere = Market(node.url, key)
    try:
        first, second = client.submit(pairs)
        elsewhere.send("cancel", first.job_id)
        with pytest.raises(RemoteJobError, match="cancelled by its submitter") as raised:
            client.wait([first, second])
        assert raised.value.job_id == first.job_id
        assert f"job {second.job_id} cancelled" in str(raised.value)
        assert client.market.job(second.job_id).status == JOB_CANCELLED
    finally:
        elsewhere.close()
        client.close()


def test_a_resent_transaction_whose_answer_was_lost_is_confirmed_once(node):
    """A signed transaction sent, the node's answer lost after it admitted it, and sent
    again (as the worker's retries resend its pre-signed finalizeJobs): the node refuses the
    second send as already known, or its nonce as used, and that refusal used to fail the
    caller (a worker then recorded verified, paid jobs as "error"). The same transaction is
    now recognised by its hash and its receipt returned; it ran once."""
    account = dev_accounts(12)[11]
    proxy = FlakyProxy(node.url)
    market = Market(proxy.url, account)
    try:
        signed = market.sign_with_gas(300_000, "register", value=ETHER)
        proxy.lose, proxy.lose_path = 1, "/wait"
        try:
            receipt = market.send_signed(signed)
        except (ConnectionError, OSError, httpx.TransportError):  # the answer lost
            receipt = market.send_signed(signed)
        assert proxy.lost == 1
        assert receipt["status"] == 1
        assert market.stake_of(account.address) == ETHER  # registered once
        again = market.sign_with_gas(300_000, "register", value=ETHER)
        proxy.lose = 0
        market.send_signed(again)  # a new transaction still goes through as usual
        assert market.stake_of(account.address) == 2 * ETHER
    finally:
        market.close()
        proxy.close()


def test_open_jobs_seen_before_a_restart_are_taken_after_it(node, tmp_path):
    """A job seen open but not taken yet (the worker busy, or a peer's turn) when the worker
    stopped: its JobSubmitted lies before the block the restarted scan resumes from, so it
    used to be forgotten. The state file now keeps such jobs, and the restarted worker does
    them (checking with the chain that they are still open)."""
    rng = np.random.default_rng(15)
    a, b = rng.standard_normal((6, 5), np.float32), rng.standard_normal((5, 4), np.float32)
    account = dev_accounts(13)[12]
    submitter = Market(node.url, dev_account(2))
    config = WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER)
    worker = Worker(config, account)
    try:
        (job_id,) = submit_as_declared(submitter, FEE, [(a, b, (1, 6, 5, 4), FP32)])
        next_block = worker._next_block = submitter.block_number() + 1  # past its block
        worker._candidates[job_id] = None  # seen, not taken
        worker._save_state()
    finally:
        worker.close()  # the data dir free for the restart
    saved = json.loads((tmp_path / "worker-state.json").read_text())
    assert saved["waiting"] == [job_id] and saved["next_block"] == next_block

    worker = Worker(config, account)
    thread = run_worker(worker)
    try:
        wait_for(lambda: submitter.job(job_id).status == JOB_DONE, 60,
                 "the restarted worker to do the job it had seen")
    finally:
        stop_worker(worker, thread)
    job = submitter.job(job_id)
    assert job.worker == account.address
    np.testing.assert_allclose(submitter.get_array(job.c_id), a.astype(np.float64) @ b,
                               rtol=1e-5, atol=1e-5)
    submitter.close()
