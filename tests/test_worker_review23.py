"""Worker review: an address that cannot pay its stake yet (`worker up` exited, and under a
service manager that was a tight restart loop: 20 restarts in 30 s under podman; with
--wait-for-funds it waits for the ETH, then stakes), and a claim whose deadline passes
before C is ready (the commit was sent anyway: it reverted, and its calldata named C's blob
for anyone, the submitter included, to fetch before cancelling). A real chain node process,
a real worker, real transactions."""
import threading

import numpy as np
import pytest
from eth_account import Account
from helpers import one_block, run_worker, stop_worker, submit_as_declared, wait_for

import node.worker as worker_module
from chain.client import ChainClient
from chain.devnet import dev_account
from node.market import JOB_CLAIMED, JOB_OPEN, Market
from node.worker import CHEAT_ENV, FundsNeeded, Worker, WorkerConfig

pytestmark = pytest.mark.timeout(120)
ETHER = 10**18


def test_an_unfunded_worker_waits_for_its_funds_then_stakes(node, tmp_path, monkeypatch):
    monkeypatch.setattr(worker_module, "FUNDS_POLL_SECONDS", 0.1)
    account = Account.create()
    config = WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER)
    with pytest.raises(FundsNeeded, match=f"{account.address} needs funds"):
        Worker(config, account)  # without the option: the one-line error, as before
    made: list = []
    waiting = WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER,
                           poll_interval=0.2, wait_for_funds=True)
    starting = threading.Thread(target=lambda: made.append(Worker(waiting, account)),
                                daemon=True)
    starting.start()
    starting.join(1.0)
    assert starting.is_alive() and not made  # waiting, not failed
    funder = ChainClient(node.url, dev_account(16).key)
    funder.wait_for_receipt(funder.w3.eth.send_raw_transaction(
        dev_account(16).sign_transaction({
            "to": account.address, "value": 2 * ETHER, "gas": 21_000, "chainId": funder.chain_id,
            "nonce": funder.w3.eth.get_transaction_count(dev_account(16).address),
            "maxFeePerGas": 10 * funder.w3.eth.gas_price, "maxPriorityFeePerGas": 0,
        }).raw_transaction))
    starting.join(30)
    assert made, "the worker did not start once funded"
    thread = run_worker(made[0])
    try:
        market = Market(node.url, dev_account(0))
        wait_for(lambda: market.stake_of(account.address) == ETHER, 30, "the worker's stake")
    finally:
        stop_worker(made[0], thread)
        funder.close()


def test_a_result_ready_after_the_claims_deadline_is_not_committed(node, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv(CHEAT_ENV, "1")  # stall_after_claim: the deadline passes meanwhile
    account, submitter = dev_account(17), Market(node.url, dev_account(18))
    worker_market = Market(node.url, account)
    worker_market.send("register", value=ETHER)
    config = WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER,
                          poll_interval=0.2, stall_after_claim=4.0)
    worker = Worker(config, account)
    thread = run_worker(worker)
    try:
        a, b = np.ones((4, 3), np.float32), np.ones((3, 2), np.float32)
        (job_id,) = submit_as_declared(submitter, 10**15, [(a, b, (1, 4, 3, 2), 1)])
        wait_for(lambda: submitter.job(job_id).status == JOB_CLAIMED, 10, "the claim")
        claimed_nonce = worker_market.client.w3.eth.get_transaction_count(account.address)
        deadline = submitter.job(job_id).deadline
        while submitter.block_number() < deadline:  # blocks go by while the worker stalls
            one_block(submitter)
        wait_for(lambda: worker.job_list()[0]["stage"] == "expired", 20, "the job expired")
        assert "not committed" in worker.job_list()[0]["detail"]
        assert worker_market.client.w3.eth.get_transaction_count(account.address) == \
            claimed_nonce  # no commitResult was sent
        submitter.send("reopenExpired", job_id)
        assert submitter.job(job_id).status == JOB_OPEN
    finally:
        stop_worker(worker, thread)


