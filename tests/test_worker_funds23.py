"""A worker whose address cannot pay its stake yet: `worker up` exited with an error, and
under a service manager (the compose file's restart policy) that was a tight restart loop
(20 restarts in 30 s under podman). With --wait-for-funds it waits for the ETH, then stakes.
A real chain node process, a real worker, a real transfer."""
import threading

import pytest
from eth_account import Account
from helpers import run_worker, stop_worker, wait_for

import node.worker as worker_module
from chain.client import ChainClient
from chain.devnet import dev_account
from node.market import Market
from node.worker import FundsNeeded, Worker, WorkerConfig

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
