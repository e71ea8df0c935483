"""`needle-net` review 23, against a real chain node process on 127.0.0.1 (one per module):
ETH amounts are taken exactly as typed (no float rounding, nothing below 1 wei dropped) and
shown to the wei; SIGTERM cancels `submit`'s open job as Ctrl-C does; tables show whole
addresses and exact fees at 80 columns; a node's refusal of a transfer is its message; the
blob port may not be the chain port."""

import os
import secrets
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers import keystore_options
from helpers import one_error_line as _one_error_line
from helpers import run_cli as _cli
from web3 import Web3

from chain.client import ChainClient
from chain.devnet import dev_account
from chain.launch import free_port
from node import keys
from node.client import JobClient
from node.devnet import Devnet, DevnetError
from node.market import JOB_CANCELLED, JOB_CLAIMED, Market

pytestmark = pytest.mark.timeout(300)
ETHER = 10**18
SENDER, WORKER, SUBMITTER = 15, 16, 17  # genesis-funded dev accounts


def _process(*args) -> list[str]:
    """The command line of `needle-net ARGS` as its own process."""
    return [sys.executable, "-m", "node", *map(str, args)]


def _table_rows(output: str) -> list[list[str]]:
    """The body rows of a table as rich prints it, a cell wrapped over several lines joined
    again (a row starts where its first cell has text)."""
    rows: list[list[str]] = []
    for line in output.splitlines():
        if line.startswith("│"):
            cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
            if cells[0] or not rows:
                rows.append(cells)
            else:
                rows[-1] = [a + b for a, b in zip(rows[-1], cells, strict=True)]
    return rows


@pytest.fixture(scope="module")
def observer(node):
    market = Market(node.url, dev_account(7))
    yield market
    market.close()


# -- amounts exactly as typed ------------------------------------------------------------


@pytest.mark.parametrize("typed,wei,shown", [
    ("1.1", 1_100_000_000_000_000_000, "1.1"),  # as a float: 1.100000000000000128 ETH went
    ("2.000000000000000001", 2 * ETHER + 1, "2.000000000000000001"),  # float: 1 wei dropped
    ("3e-18", 3, "0.000000000000000003"),
])
def test_send_transfers_exactly_the_amount_typed(node, observer, tmp_path, typed, wei, shown):
    to = dev_account(0).address[:2] + secrets.token_hex(20)  # a fresh, empty account
    result = _cli("send", to, typed, "--yes", "--rpc-url", node.url,
                  *keystore_options(tmp_path, SENDER))
    assert result.exit_code == 0, result.output
    assert observer.balance_of(to) == wei
    said = " ".join(result.output.split())  # as the console wrapped it
    assert f"sent {shown} ETH to {Web3.to_checksum_address(to)} in block " in said


@pytest.mark.parametrize("command", [
    ["send", dev_account(1).address, "1.0000000000000000001", "--yes"],
    ["stake", "1.00000000000000000001"],
    ["submit", "A", "B", "-o", "OUT", "--fee", "0.0010000000000000001", "--timeout", "1"],
], ids=lambda c: c[0])
def test_amounts_below_one_wei_are_refused_before_anything_is_spent(node, observer, tmp_path,
                                                                    command):
    np.save(tmp_path / "a.npy", np.ones((2, 2), np.float32))
    paths = {"A": tmp_path / "a.npy", "B": tmp_path / "a.npy", "OUT": tmp_path / "c.npy"}
    address = dev_account(SENDER).address
    balance, nonce = observer.balance_of(address), observer.w3.eth.get_transaction_count(address)
    line = _one_error_line(_cli(*(paths.get(a, a) for a in command), "--rpc-url", node.url,
                                *keystore_options(tmp_path, SENDER)))
    assert "has digits below 1 wei (1e-18 ETH)" in line
    assert observer.balance_of(address) == balance
    assert observer.w3.eth.get_transaction_count(address) == nonce
    assert not (tmp_path / "c.npy").exists()


@pytest.mark.parametrize("typed,message", [
    ("1e999999999", "amount is more ETH than the chain can hold"),
    ("1e-999999999", "amount has digits below 1 wei"),
    ("nan", "amount must be positive"),
])
def test_extreme_exponents_are_refused_at_once(typed, message):
    """Checked from the exponent alone: the digits of 10**999999999 are never expanded."""
    line = _one_error_line(_cli("send", dev_account(1).address, typed, "--yes", "--rpc-url",
                                f"http://127.0.0.1:{free_port()}"))
    assert message in line


def test_the_confirmation_shows_the_exact_amount(node, observer, tmp_path):
    address = dev_account(SENDER).address
    nonce = observer.w3.eth.get_transaction_count(address)
    result = _cli("send", dev_account(1).address, "1234567.5", "--rpc-url", node.url,
                  *keystore_options(tmp_path, SENDER), input="n\n")
    assert f"send 1234567.5 ETH from {address} to {dev_account(1).address}?" in result.output
    assert "1.23457e+06" not in result.output
    assert _one_error_line(result) == "error: cancelled"
    assert observer.w3.eth.get_transaction_count(address) == nonce


def test_a_transfer_the_node_refuses_is_its_message_not_a_json_rpc_dict(node, tmp_path):
    line = _one_error_line(_cli("send", dev_account(1).address, "1000000", "--yes",
                                "--rpc-url", node.url, *keystore_options(tmp_path, SENDER)))
    assert line.startswith("error: transfer refused: insufficient funds: balance "), line
    assert "{" not in line


def test_balance_shows_every_wei(node, observer):
    """Printed with six decimals, 1 ETH and 7 wei read `1.000000`, and 7 wei `0.000000`."""
    to = Web3.to_checksum_address("0x" + secrets.token_hex(20))
    sender, w3 = dev_account(SENDER), observer.w3
    tx = {"to": to, "value": ETHER + 7, "gas": 21_000, "chainId": w3.eth.chain_id,
          "nonce": w3.eth.get_transaction_count(sender.address, "pending"),
          "maxFeePerGas": w3.eth.gas_price * 2, "maxPriorityFeePerGas": 0}
    tx_hash = w3.eth.send_raw_transaction(sender.sign_transaction(tx).raw_transaction)
    assert w3.eth.wait_for_transaction_receipt(tx_hash, timeout=60)["status"] == 1
    result = _cli("balance", to, "--rpc-url", node.url)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [to, "  balance 1.000000000000000007 ETH",
                                          "  stake   0.000000 ETH (active claims 0)"]


# -- SIGTERM ------------------------------------------------------------------------------


def test_sigterm_cancels_the_open_job_and_refunds_its_fee(node, observer, tmp_path):
    np.save(tmp_path / "a.npy", np.ones((3, 2), np.float32))
    np.save(tmp_path / "b.npy", np.ones((2, 4), np.float32))
    submitter = dev_account(SUBMITTER).address
    jobs, balance = observer.job_count(), observer.balance_of(submitter)
    cli = subprocess.Popen(
        _process("submit", tmp_path / "a.npy", tmp_path / "b.npy", "-o", tmp_path / "c.npy",
                 "--timeout", "300", "--rpc-url", node.url, *keystore_options(tmp_path, SUBMITTER)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(600):  # the job is open: at most 60 s
            if observer.job_count() > jobs or cli.poll() is not None:
                break
            observer.wait_for_block(observer.block_number() + 1, 0.1)
        assert observer.job_count() == jobs + 1, "the CLI did not submit"
        cli.send_signal(signal.SIGTERM)
        output, _ = cli.communicate(timeout=60)
    finally:
        cli.kill()
    assert cli.returncode == 128 + signal.SIGTERM, output
    assert f"error: interrupted: job {jobs} cancelled, its 0.001 ETH fee refunded" in output
    assert "Traceback" not in output and not (tmp_path / "c.npy").exists()
    assert observer.job(jobs).status == JOB_CANCELLED
    gas = 0
    for event in ("JobSubmitted", "JobCancelled"):
        [log] = getattr(observer.contract.events, event).get_logs(
            argument_filters={"jobId": jobs}, from_block=0)
        receipt = observer.w3.eth.get_transaction_receipt(log["transactionHash"])
        gas += receipt["gasUsed"] * receipt["effectiveGasPrice"]
    assert observer.balance_of(submitter) == balance - gas  # the fee came back


# -- tables at 80 columns -----------------------------------------------------------------


def test_jobs_at_80_columns_shows_the_whole_worker_address_and_the_exact_fee(node, observer):
    fee = 1_234_567_891_234_567  # 0.001234567891234567 ETH
    client = JobClient(node.url, dev_account(SUBMITTER), fee_wei=fee)
    [pending] = client.submit([(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32))])
    client.close()
    worker = ChainClient(node.url, dev_account(WORKER).key)
    worker.send(worker.market.functions.register(), value=ETHER)
    worker.send(worker.market.functions.claimJob(pending.job_id))
    worker.close()
    assert observer.job(pending.job_id).status == JOB_CLAIMED

    listed = subprocess.run(_process("jobs", "--limit", "1", "--rpc-url", node.url),
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "COLUMNS": "80"})
    assert listed.returncode == 0, listed.stderr
    assert max(map(len, listed.stdout.splitlines())) <= 80
    [row] = _table_rows(listed.stdout)
    assert row == [str(pending.job_id), "claimed", "1×2×3×2", "fp32", "0.001234567891234567",
                   dev_account(WORKER).address], listed.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGINT to a process group")
def test_devnet_up_at_80_columns_shows_whole_worker_addresses(tmp_path):
    data_dir = tmp_path / "devnet"
    up = subprocess.Popen(_process("devnet", "up", "--workers", "1", "--port", "0",
                                   "--data-dir", data_dir),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "COLUMNS": "80"})
    lines = []
    try:
        for line in up.stdout:  # ends when the devnet is up (or the process exited)
            lines.append(line)
            if "Ctrl-C to stop" in line:
                break
        up.send_signal(signal.SIGTERM)  # stops the devnet like Ctrl-C, reported as a signal
        rest, _ = up.communicate(timeout=120)
    finally:
        up.kill()
    output = "".join(lines) + rest
    assert "Ctrl-C to stop" in output, output
    assert up.returncode == 128 + signal.SIGTERM, output  # was 0, as if it had finished
    address = keys.read_keyfile(data_dir / "worker0" / "key.json")["address"]
    rows = {row[0]: row for row in _table_rows(output)}
    assert rows["worker 0"][1] == Web3.to_checksum_address(address), output


# -- the blob port ------------------------------------------------------------------------


def test_a_blob_port_equal_to_the_chain_port_is_refused_before_anything_is_made(tmp_path):
    port = free_port()
    with pytest.raises(DevnetError, match=f"blob port must differ from the chain port {port}"):
        Devnet(tmp_path / "devnet", port=port, blob_port=port)
    assert not (tmp_path / "devnet").exists()
    chain = subprocess.run([sys.executable, "-m", "chain", "up", "--data-dir",
                            str(tmp_path / "chain"), "--port", str(port), "--blob-port",
                            str(port)], capture_output=True, text=True, timeout=120)
    assert chain.returncode == 1
    assert chain.stderr.strip() == f"error: --blob-port must differ from --port ({port})"
    assert not (tmp_path / "chain").exists()


def test_jobs_shows_no_worker_for_an_open_job(node):
    client = JobClient(node.url, dev_account(SUBMITTER))
    [pending] = client.submit([(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32))])
    client.close()
    listed = subprocess.run(_process("jobs", "--limit", "1", "--rpc-url", node.url),
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    [row] = _table_rows(listed.stdout)
    assert row[:2] == [str(pending.job_id), "open"] and row[-1] == "-", listed.stdout
