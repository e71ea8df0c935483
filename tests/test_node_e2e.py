"""End to end with real processes on 127.0.0.1: a chain node, worker processes (one honest,
one cheating, one that hangs and is killed), and the job client with signed transactions.

The scenarios share one chain and run in order (the cheater's slash in the first leaves it
unable to claim in the later ones)."""

import json
import os
import threading
import time

import httpx
import numpy as np
import pytest
from helpers import wait_for
from typer.testing import CliRunner

from chain.blobhttp import BlobClient
from chain.blobs import blob_id, encode_array
from chain.devnet import dev_account
from node.cli import app
from node.client import JobClient, RemoteJobError
from node.devnet import Devnet, free_port
from node.market import Market

pytestmark = pytest.mark.timeout(240)
FEE = 10**15
CHEAT_ENV = {"NEEDLE_NET_ALLOW_CHEAT": "1"}
MARKET = "0x000000000000000000000000000000000000c0DE"
POOL = "0x0000000000000000000000000000000000000FEE"
HTTP = httpx.Client(timeout=60.0)  # generous: the shared 2-core machine is often loaded


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    devnet = Devnet(tmp_path_factory.mktemp("devnet"), block_time=0.5)
    try:
        devnet.start_chain()
        # Keys exist before any snapshot so every party is in the conservation sums.
        workers = [devnet.worker_account(i).address for i in range(3)]
        devnet.parties = [dev_account(i).address for i in range(20)] + workers + [MARKET, POOL]
        yield devnet
    finally:
        devnet.close()


@pytest.fixture(scope="module")
def observer(net):
    market = Market(net.rpc_url, dev_account(7))
    yield market
    market.close()


def _snapshot(market, net) -> tuple[int, int]:
    """(head, sum of every party's balance at that block)."""
    head = market.block_number()
    return head, sum(market.w3.eth.get_balance(a, block_identifier=head) for a in net.parties)


def _burned(market, first: int, last: int) -> int:
    total = 0
    for number in range(first, last + 1):
        block = market.w3.eth.get_block(number)
        total += block["gasUsed"] * block.get("baseFeePerGas", 0)
    return total


def _events(market, name, **filters):
    return list(getattr(market.contract.events, name).get_logs(argument_filters=filters,
                                                               from_block=0))


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join(timeout):
        thread.join(timeout)
        assert not thread.is_alive(), "client call did not finish"
        if "error" in box:
            raise box["error"]
        return box["result"]

    return join


def _operands(seed, shape_a, shape_b):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape_a).astype(np.float32),
            rng.standard_normal(shape_b).astype(np.float32))


def test_cheater_is_slashed_and_never_paid_honest_worker_is_paid(net, observer):
    h0, total0 = _snapshot(observer, net)
    cheater = net.start_worker(0, extra_args=("--corrupt-results",), env=CHEAT_ENV)
    client = JobClient(net.rpc_url, dev_account(1), fee_wei=FEE, timeout=120)
    a, b = _operands(0, (24, 16), (16, 8))
    result = _in_thread(lambda: client.matmul(a, b))
    wait_for(lambda: _events(observer, "JobFailed", worker=cheater.address), 60,
             "the cheater's result to fail verification")
    honest = net.start_worker(1)
    c = result(120)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)

    # A batch in one transaction: the slashed cheater can no longer claim; all correct.
    pairs = [_operands(s, (8 + s, 12), (12, 5 + s)) for s in range(1, 4)]
    pairs.append(_operands(9, (3, 6, 4), (3, 4, 7)))  # a batched job
    results = client.matmul_batch(pairs)
    for (x, y), z in zip(pairs, results, strict=True):
        np.testing.assert_allclose(z, np.matmul(x.astype(np.float64), y), rtol=1e-4, atol=1e-4)
    client.close()

    assert _events(observer, "JobVerified", worker=cheater.address) == []
    failed = _events(observer, "JobFailed", worker=cheater.address)
    slashed = sum(e["args"]["slashed"] for e in failed)
    assert slashed == 10**18 // 2  # 50 % of the minimum stake, once
    assert observer.stake_of(cheater.address) == 10**18 - slashed
    verified = _events(observer, "JobVerified", worker=honest.address)
    assert len(verified) == 5 and all(e["args"]["fee"] == FEE for e in verified)
    wait_for(lambda: HTTP.get(f"{honest.api_url}/status").json()["in_flight"] == 0, 30,
             "the honest worker to record its verdicts")
    status = HTTP.get(f"{honest.api_url}/status").json()
    assert status["completed"] == 5 and status["earned_wei"] == 5 * FEE
    assert HTTP.get(f"{cheater.api_url}/status").json()["failed"] == 1
    # the next block to scan is saved off the job path, also across blocks without events
    state = net.worker_dir(1) / "worker-state.json"
    later = observer.block_number() + 2
    wait_for(lambda: json.loads(state.read_text())["next_block"] > later, 30,
             "the worker to save its place in the chain")

    wait_for(lambda: all(observer.job(j).status == 4 for j in range(observer.job_count())), 10,
             "every job done")
    h1, total1 = _snapshot(observer, net)
    assert total1 - total0 == -_burned(observer, h0 + 1, h1)
    contract_holds = observer.contract.functions.totalEscrow().call() + \
        observer.contract.functions.totalStaked().call()
    assert observer.balance_of(MARKET) == contract_holds


def test_killed_worker_job_is_reassigned_after_deadline(net, observer):
    honest = next(w for w in net.workers if w.index == 1)
    assert net.stop_worker(honest) == 0  # graceful stop: nothing in flight
    staller = net.start_worker(2, extra_args=("--stall-after-claim", "600"), env=CHEAT_ENV)
    client = JobClient(net.rpc_url, dev_account(2), fee_wei=FEE, timeout=120, timeout_blocks=8)
    a, b = _operands(5, (10, 20), (20, 6))
    result = _in_thread(lambda: client.matmul(a, b))
    wait_for(lambda: _events(observer, "JobClaimed", worker=staller.address), 60,
             "the staller to claim")
    net.stop_worker(staller, kill=True)
    net.start_worker(1)  # restarts from its saved state
    c = result(120)
    client.close()
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    cut = _events(observer, "JobFailed", worker=staller.address)
    assert len(cut) == 1 and cut[0]["args"]["slashed"] == 10**18 // 10
    job_id = cut[0]["args"]["jobId"]
    assert observer.job(job_id).worker == honest.address
    assert _events(observer, "JobReopened", jobId=job_id)


@pytest.mark.parametrize("a,b,match", [
    (np.ones((3, 4), np.float32), np.ones((5, 2), np.float32), "shape mismatch"),
    (np.full((2, 2), np.nan, np.float32), np.ones((2, 2), np.float32), "NaN"),
    (np.ones((2, 2), np.float64), np.ones((2, 2), np.float64), "unsupported dtype"),
    (np.ones((2, 2), np.float32), np.ones((2, 2), np.int32), "dtypes differ"),
    (np.ones((64, 64), np.float32), np.ones((64, 64), np.float32), "blob limit"),
])
def test_bad_input_is_refused_before_the_chain(net, observer, a, b, match):
    client = JobClient(net.rpc_url, dev_account(3), fee_wei=FEE, max_blob_bytes=8192)
    jobs, balance = observer.job_count(), observer.balance_of(client.address)
    with pytest.raises(RemoteJobError, match=match) as err:
        client.matmul(a, b)
    assert err.value.stage == "validate"
    assert observer.job_count() == jobs and observer.balance_of(client.address) == balance
    client.close()


def test_failed_upload_sends_no_submission_and_the_next_job_runs(net, observer):
    """Small operands upload while their submission is signed: if the upload fails, the
    signed submission is dropped (its nonce too), and the next job goes through."""
    client = JobClient(net.rpc_url, dev_account(4), fee_wei=FEE, timeout=120)
    store = client.market.blobs
    jobs, nonce = observer.job_count(), observer.w3.eth.get_transaction_count(client.address)
    client.market.blobs = BlobClient(f"http://127.0.0.1:{free_port()}/blobs", 1 << 20)
    a, b = _operands(11, (6, 5), (5, 4))
    with pytest.raises(RemoteJobError, match="stage upload") as err:
        client.matmul(a, b)
    assert err.value.stage == "upload"
    assert observer.job_count() == jobs
    assert observer.w3.eth.get_transaction_count(client.address, "pending") == nonce
    client.market.blobs = store
    np.testing.assert_allclose(client.matmul(a, b), a.astype(np.float64) @ b,
                               rtol=1e-4, atol=1e-4)
    client.close()


def test_blob_with_wrong_hash_is_rejected_and_corruption_detected(net, observer):
    data = encode_array(np.arange(6, dtype=np.float32).reshape(2, 3))
    wrong = blob_id(data + b"x")
    url = f"{net.rpc_url}/blobs/0x{wrong.hex()}"
    assert HTTP.put(url, content=data).status_code == 400
    assert HTTP.head(url).status_code == 404
    # A blob store that serves bytes not matching the id (disk corruption, a forged store):
    id_ = observer.put_blob(data)
    stored = net.data_dir / "chain" / "blobs" / id_.hex()
    stored.write_bytes(encode_array(np.zeros((2, 3), np.float32)))
    with pytest.raises(Exception, match="different hash"):
        observer.get_blob(id_)
    assert os.path.exists(stored)


def test_graceful_stop_finishes_a_claimed_job_and_restart_resumes_one(net, observer):
    honest = next(w for w in net.workers if w.index == 1)
    assert net.stop_worker(honest) == 0
    client = JobClient(net.rpc_url, dev_account(6), fee_wei=FEE, timeout=120, timeout_blocks=500)
    stall = ("--stall-after-claim", "600")

    # SIGTERM while a claimed job is in progress: the worker finishes it, then exits cleanly.
    worker = net.start_worker(2, extra_args=stall, env=CHEAT_ENV)
    a, b = _operands(21, (9, 5), (5, 3))
    result = _in_thread(lambda: client.matmul(a, b))
    wait_for(lambda: len(_events(observer, "JobClaimed", worker=worker.address)) == 2, 60,
             "worker 2 to claim")
    assert net.stop_worker(worker) == 0
    np.testing.assert_allclose(result(60), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    first = _events(observer, "JobClaimed", worker=worker.address)[-1]["args"]["jobId"]
    assert observer.job(first).status == 4 and observer.job(first).worker == worker.address

    # SIGKILL after a claim, restart without the stall: it resumes the same job from its state.
    worker = net.start_worker(2, extra_args=stall, env=CHEAT_ENV)
    a, b = _operands(22, (6, 5), (5, 8))
    result = _in_thread(lambda: client.matmul(a, b))
    wait_for(lambda: len(_events(observer, "JobClaimed", worker=worker.address)) == 3, 60,
             "worker 2 to claim again")
    net.stop_worker(worker, kill=True)
    worker = net.start_worker(2)
    np.testing.assert_allclose(result(60), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    resumed = _events(observer, "JobClaimed", worker=worker.address)[-1]["args"]["jobId"]
    assert _events(observer, "JobReopened", jobId=resumed) == []
    assert _events(observer, "JobVerified", jobId=resumed)[0]["args"]["worker"] == worker.address
    client.close()
    assert net.stop_worker(worker) == 0
    net.start_worker(1)


def test_cli_submit_jobs_and_balance(net, observer, tmp_path):
    a, b = _operands(11, (7, 9), (9, 4))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)

    def cli(*args):
        return CliRunner().invoke(app, [*args, "--rpc-url", net.rpc_url], terminal_width=200)

    before = observer.job_count()
    done = cli("submit", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), "-o",
               str(tmp_path / "c.npy"))
    assert done.exit_code == 0, done.output
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a.astype(np.float64) @ b,
                               rtol=1e-4, atol=1e-4)
    assert observer.job_count() == before + 1
    listing = cli("jobs", "--limit", "2")
    assert listing.exit_code == 0 and "done" in listing.output
    assert f"\n│ {before} " in listing.output
    np.save(tmp_path / "bad.npy", np.ones((3, 3), np.float32))
    refused = cli("submit", str(tmp_path / "a.npy"), str(tmp_path / "bad.npy"), "-o",
                  str(tmp_path / "x.npy"))
    assert refused.exit_code == 1 and "shape mismatch" in refused.output
    assert observer.job_count() == before + 1
    honest = next(w for w in net.workers if w.index == 1)
    shown = cli("balance", honest.address)
    stake = observer.stake_of(honest.address)
    assert shown.exit_code == 0 and f"stake   {stake / 10**18:.6f} ETH" in shown.output

    # Stake and withdraw with a worker's encrypted keystore (worker 2 is stopped by now).
    key = ("--keystore", str(net.worker_dir(2) / "key.json"), "--password-file",
           str(net.password_file))
    address = net.worker_account(2).address
    stake = observer.stake_of(address)
    topped = cli("stake", "0.5", *key)
    assert topped.exit_code == 0, topped.output
    assert observer.stake_of(address) == stake + 10**18 // 2
    requested = cli("withdraw", *key)
    assert requested.exit_code == 0 and "withdrawal requested" in requested.output
    available = observer.worker_info(address)[1]
    wait_for(lambda: observer.block_number() >= available, 30, "the withdrawal cooldown")
    balance = observer.balance_of(address)
    withdrawn = cli("withdraw", *key)
    assert withdrawn.exit_code == 0 and f"withdrew {(stake + 10**18 // 2) / 10**18:g} ETH" \
        in withdrawn.output
    assert observer.stake_of(address) == 0 and observer.balance_of(address) > balance


def test_worker_rides_out_a_chain_restart(net, observer):
    worker = next(w for w in net.workers if w.index == 1)
    assert net.chain.poll() is None
    net.chain.terminate()
    net.chain.wait(30)
    time.sleep(2)  # the worker's polls fail meanwhile (connection refused) and are retried
    net.start_chain()  # same data dir and port: the chain resumes from its last block
    client = JobClient(net.rpc_url, dev_account(8), fee_wei=FEE, timeout=120)
    a, b = _operands(31, (5, 7), (7, 6))
    np.testing.assert_allclose(client.matmul(a, b), a.astype(np.float64) @ b, rtol=1e-4,
                               atol=1e-4)
    client.close()
    assert worker.process.poll() is None
    errors = [line for line in HTTP.get(f"{worker.api_url}/metrics").text.splitlines()
              if line.startswith("needle_chain_errors_total ")]
    assert float(errors[0].split()[1]) > 0


def test_worker_api_metrics_and_admin_actions(net, observer):
    worker = next(w for w in net.workers if w.index == 1)
    api = worker.api_url
    assert HTTP.get(f"{api}/health").json() == {"ok": True}
    # The client has its result once the job is verified on chain; the worker records the
    # verdict a moment later.
    wait_for(lambda: HTTP.get(f"{api}/status").json()["in_flight"] == 0, 30, "worker idle")
    status = HTTP.get(f"{api}/status").json()
    jobs = HTTP.get(f"{api}/jobs").json()
    verified = [j for j in jobs if j["stage"] == "verified"]
    assert status["address"] == worker.address and status["completed"] == len(verified) == 9
    assert status["stake_wei"] == observer.stake_of(worker.address)
    metrics = HTTP.get(f"{api}/metrics").text
    assert 'needle_jobs_total{outcome="verified"} 2.0' in metrics  # since its last restart
    since_restart = verified[:2]  # newest first
    flops = sum(2.0 * j["batch"] * j["m"] * j["k"] * j["n"] for j in since_restart)
    assert f"needle_flops_total {flops}" in metrics

    def observed(stage: str) -> float:  # a batch of small jobs times its stages too
        prefix = f'needle_stage_seconds_count{{stage="{stage}"}} '
        return sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith(prefix))

    assert observed("fetch") >= 2 and observed("compute") >= 2, metrics
    assert min(observed(s) for s in ("upload", "commit", "finalize")) >= 1, metrics
    assert "/admin/withdraw" in HTTP.get(f"{api}/openapi.json").json()["paths"]
    blocks = HTTP.get(f"{api}/blocks?count=3").json()
    assert [b["number"] for b in blocks] == sorted((b["number"] for b in blocks), reverse=True)

    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert HTTP.post(f"{api}/admin/stop", headers=headers).status_code == 403
        assert HTTP.post(f"{api}/admin/withdraw", headers=headers).status_code == 403
    assert worker.process.poll() is None and observer.worker_info(worker.address)[1] == 0

    admin = {"Authorization": f"Bearer {worker.admin_token}"}
    requested = HTTP.post(f"{api}/admin/withdraw", headers=admin).json()
    assert requested["requested"] and observer.worker_info(worker.address)[1] == \
        requested["available_block"]
    stake = observer.stake_of(worker.address)
    wait_for(lambda: observer.block_number() >= requested["available_block"], 30, "cooldown")
    balance = observer.balance_of(worker.address)
    assert HTTP.post(f"{api}/admin/withdraw", headers=admin).json() == {"withdrawn_wei": stake}
    assert observer.stake_of(worker.address) == 0
    assert balance < observer.balance_of(worker.address) <= balance + stake
    assert HTTP.post(f"{api}/admin/stop", headers=admin).json() == {"stopping": True}
    assert worker.process.wait(30) == 0
