"""`needle-net` review 24, against real chain node and devnet processes on 127.0.0.1:
`cancel` reopens a job whose worker missed its deadline and refunds its fee (nobody else
reopens it once the submitting client is gone); a password file that is not UTF-8, and a
done job whose result is gone from the blob store, are one error line each; `send` refuses
a contract recipient and reports a transfer that failed on chain (it said "sent"); a devnet
refuses workers' state kept on another chain instead of running workers that take no job."""

import json
import time

import numpy as np
import pytest
from helpers import keystore_options
from helpers import one_error_line as _one_error_line
from helpers import run_cli as _cli

from chain.client import ChainClient
from chain.devnet import dev_account
from node import keys
from node.client import JobClient
from node.devnet import Devnet
from node.market import JOB_CANCELLED, JOB_CLAIMED, JOB_DONE, Market

pytestmark = pytest.mark.timeout(300)
ETHER = 10**18
FEE = 10**15
# genesis-funded dev accounts (the first worker's stake is cut below the minimum)
SUBMITTER, WORKER, BYSTANDER, FETCHER, HONEST_WORKER, SENDER = 11, 12, 13, 14, 15, 16
MARKET = "0x000000000000000000000000000000000000c0DE"
ECRECOVER = "0x0000000000000000000000000000000000000001"  # a precompile: no code, needs gas


def _seal_blocks_until(market: Market, block: int) -> None:
    """Transfers of nothing to itself until the head passes `block` (the node seals a block
    for each, and none else)."""
    account, w3 = dev_account(BYSTANDER), market.w3
    while market.block_number() <= block:
        tx = {"to": account.address, "value": 0, "gas": 21_000, "chainId": w3.eth.chain_id,
              "nonce": w3.eth.get_transaction_count(account.address),
              "maxFeePerGas": w3.eth.gas_price * 2, "maxPriorityFeePerGas": 0}
        tx_hash = w3.eth.send_raw_transaction(account.sign_transaction(tx).raw_transaction)
        w3.eth.wait_for_transaction_receipt(tx_hash, timeout=60)


def _gas_of(market: Market, event: str, job_id: int) -> int:
    """What the transaction that emitted `event` for `job_id` paid for gas."""
    [log] = getattr(market.contract.events, event).get_logs(
        argument_filters={"jobId": job_id}, from_block=0)
    receipt = market.w3.eth.get_transaction_receipt(log["transactionHash"])
    return receipt["gasUsed"] * receipt["effectiveGasPrice"]


def test_cancel_reopens_a_claim_past_its_deadline_and_refunds_the_fee(node, tmp_path):
    """The worker claimed the job and vanished; the submitting client timed out. Before,
    `cancel` answered "job is claimed ... it reopens for cancelling if its worker misses
    block D" long after block D: nobody reopens it (workers do not), so the fee stayed in
    escrow for good."""
    observer = Market(node.url, dev_account(BYSTANDER))
    client = JobClient(node.url, dev_account(SUBMITTER), fee_wei=FEE, timeout_blocks=1)
    [pending] = client.submit([(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32))])
    client.close()
    worker = ChainClient(node.url, dev_account(WORKER).key)
    worker.send(worker.market.functions.register(), value=ETHER)
    worker.send(worker.market.functions.claimJob(pending.job_id))
    worker.close()
    job = observer.job(pending.job_id)
    assert job.status == JOB_CLAIMED
    _seal_blocks_until(observer, job.deadline)
    submitter = dev_account(SUBMITTER).address
    balance = observer.balance_of(submitter)

    result = _cli("cancel", pending.job_id, "--rpc-url", node.url,
                  *keystore_options(tmp_path, SUBMITTER))

    assert result.exit_code == 0, result.output
    assert observer.job(pending.job_id).status == JOB_CANCELLED
    gas = _gas_of(observer, "JobFailed", pending.job_id) + \
        _gas_of(observer, "JobCancelled", pending.job_id)
    assert observer.balance_of(submitter) == balance + FEE - gas  # the late cut: the pool's
    said = " ".join(result.output.split())
    assert f"reopened job {pending.job_id}: its worker {dev_account(WORKER).address} did not " \
           "deliver in time" in said
    assert f"cancelled job {pending.job_id}: 0.001 ETH refunded" in said
    observer.close()


def test_fetch_of_a_result_gone_from_the_blob_store_is_one_error_line(node, tmp_path):
    """The store lost C after the chain verified it (an operator pruning blobs, a restored
    disk): before, a BlobNotFound traceback."""
    a, b = np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)
    client = JobClient(node.url, dev_account(FETCHER), fee_wei=FEE)
    [pending] = client.submit([(a, b)])
    client.close()
    worker = Market(node.url, dev_account(HONEST_WORKER))
    worker.send("register", value=ETHER)
    worker.send("claimJob", pending.job_id)
    c_id = worker.put_array(a @ b)
    worker.send("commitResult", pending.job_id, c_id)
    worker.send("finalize", pending.job_id)
    assert worker.job(pending.job_id).status == JOB_DONE
    worker.close()
    (node.data_dir / "blobs" / c_id.hex()).unlink()

    line = _one_error_line(_cli("fetch", pending.job_id, "-o", tmp_path / "c.npy",
                                "--rpc-url", node.url))
    assert line == (f"error: job {pending.job_id} is done, but the node's blob store did not "
                    f"give its result: blob 0x{c_id.hex()} not found in the blob store")
    assert list(tmp_path.iterdir()) == []


def test_send_refuses_a_contract_before_spending_anything(node, tmp_path):
    """The market takes no plain transfer: before, `send` said "sent 1 ETH" while the
    transfer reverted and only its gas was spent."""
    observer = Market(node.url, dev_account(BYSTANDER))
    sender = dev_account(SENDER).address
    balance, nonce = observer.balance_of(sender), observer.w3.eth.get_transaction_count(sender)
    line = _one_error_line(_cli("send", MARKET, "1", "--yes", "--rpc-url", node.url,
                                *keystore_options(tmp_path, SENDER)))
    assert line == (f"error: {MARKET} is a contract (the market: `needle-net stake` deposits a "
                    "stake), not an account: a plain transfer to it fails")
    assert observer.balance_of(sender) == balance
    assert observer.w3.eth.get_transaction_count(sender) == nonce
    observer.close()


def test_send_reports_a_transfer_that_failed_on_chain(node, tmp_path, monkeypatch):
    """A precompile holds no code, and a transfer's 21,000 gas cannot pay for it: the
    transfer fails in its block. Before, `send` said "sent 1 ETH" and exited 0. (`send` now
    refuses the precompiles' addresses before sending: that check is off here, to fail a
    transfer on chain.)"""
    monkeypatch.setattr("node.cli.PRECOMPILE_RANGE", 0)
    observer = Market(node.url, dev_account(BYSTANDER))
    line = _one_error_line(_cli("send", ECRECOVER, "1", "--yes", "--rpc-url", node.url,
                                *keystore_options(tmp_path, SENDER)))
    assert line.startswith("error: the transfer failed in block "), line
    assert line.endswith("nothing was sent; its gas was spent"), line
    assert observer.balance_of(ECRECOVER) == 0
    observer.close()


@pytest.mark.parametrize("command", [
    ["keys", "new", "NEW"], ["withdraw", "--keystore", "KEY", "--rpc-url", "http://127.0.0.1:1"]],
    ids=lambda c: c[0])
def test_a_password_file_that_is_not_utf8_is_one_error_line(tmp_path, command):
    """A password saved as Latin-1 (`pässwort` from an editor set to it): before, a
    UnicodeDecodeError traceback."""
    password_file = tmp_path / "password"
    password_file.write_bytes("pässwort\n".encode("latin-1"))
    keys.save_keystore(dev_account(0), tmp_path / "key.json", "pw", iterations=2048)
    paths = {"NEW": tmp_path / "new.json", "KEY": tmp_path / "key.json"}
    result = _cli(*(paths.get(a, a) for a in command), "--password-file", password_file)
    line = _one_error_line(result)
    assert line.startswith(f"error: password file {password_file} is not UTF-8 text"), line
    assert not (tmp_path / "new.json").exists()


def test_a_devnet_whose_chain_was_removed_has_its_workers_start_afresh(tmp_path):
    """The devnet's chain dir was removed and its workers' dirs kept: before, the workers
    started, waited for the gone chain's height before taking any job, and every job timed
    out with "no worker moved the job on". The worker now sets aside the state of another
    chain (it resumes beyond the head, or names another block 1) and takes the job."""
    state = tmp_path / "worker0" / "worker-state.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"next_block": 500, "jobs": [], "waiting": [],
                                 "block_one": "ab" * 32}))
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    with Devnet(tmp_path, port=0, block_time=0.2) as net:
        net.start(1)
        client = JobClient(net.rpc_url, dev_account(0), fee_wei=10**15, timeout=60)
        try:
            np.testing.assert_allclose(client.matmul(a, a.T), a @ a.T, rtol=1e-6)
        finally:
            client.close()
    [aside] = state.parent.glob("worker-state.json.other-chain-*")
    assert json.loads(aside.read_text())["next_block"] == 500
    assert json.loads(state.read_text())["next_block"] > 0


def test_a_devnet_restarted_on_its_own_chain_keeps_its_workers(tmp_path):
    """The check above must not set aside the state of the usual restart, whose workers
    saved their place on the chain that is still there."""
    state = tmp_path / "worker0" / "worker-state.json"
    with Devnet(tmp_path, port=0, block_time=0.2) as net:
        net.start(1)
        end = time.monotonic() + 60
        while not (state.exists() and json.loads(state.read_text())["next_block"] > 0):
            assert time.monotonic() < end, "the worker never saved its place"
            time.sleep(0.2)
    saved = json.loads(state.read_text())["next_block"]
    with Devnet(tmp_path, port=0, block_time=0.2) as net:
        net.start(1)
        assert net.workers[0].process.poll() is None
    assert json.loads(state.read_text())["next_block"] >= saved


STAKER = 17  # dev account staking and withdrawing through the CLI


def test_withdraw_says_when_and_stake_says_it_cancels_the_withdrawal(node, tmp_path):
    """`withdraw` again before the cooldown sent a transaction that reverted ("withdraw
    cooldown not over": no block named, gas spent); `stake` during a pending withdrawal
    cancelled it without a word (registering does so)."""
    observer, me = Market(node.url, dev_account(BYSTANDER)), dev_account(STAKER).address
    options = ["--rpc-url", node.url, *keystore_options(tmp_path, STAKER)]
    assert _cli("stake", "1", *options).exit_code == 0
    requested = _cli("withdraw", *options)
    assert requested.exit_code == 0, requested.output
    _, available, _ = observer.worker_info(me)
    nonce = observer.w3.eth.get_transaction_count(me)
    early = _one_error_line(_cli("withdraw", *options))
    assert early == (f"error: the stake can be withdrawn in block {available} or later; the "
                     f"chain is at block {observer.block_number()}: run this again then")
    assert observer.w3.eth.get_transaction_count(me) == nonce  # nothing was sent
    topped = _cli("stake", "0.5", *options)
    assert topped.exit_code == 0, topped.output
    assert f"stake is now 1.5 ETH (the withdrawal requested for block {available} is " \
           "cancelled)" in " ".join(topped.output.split())
    assert observer.worker_info(me)[1] == 0
    assert _cli("withdraw", *options).exit_code == 0  # requested anew
    _seal_blocks_until(observer, observer.worker_info(me)[1] - 2)
    done = _cli("withdraw", *options)
    assert done.exit_code == 0 and "withdrew 1.5 ETH" in done.output, done.output
    observer.close()
