"""CLI commands against a real chain node process: `send` (signed transfer, confirmation,
refusals), `keys show` (address only, nothing secret), and `submit --deadline` with a worker
driven by hand through signed transactions, so the claim's deadline can be read on chain."""

import json
import threading

import numpy as np
import pytest
from typer.testing import CliRunner

from chain.client import ChainClient
from chain.devnet import dev_accounts
from node import keys
from node.cli import app

pytestmark = pytest.mark.timeout(120)
ETHER = 10**18
runner = CliRunner()


@pytest.fixture()
def sender_keystore(tmp_path):
    """A keystore holding dev account 9's key (funded in genesis) and its password file."""
    password = tmp_path / "pw"
    password.write_text("s3cret")
    path = tmp_path / "key.json"
    keys.save_keystore(dev_accounts(10)[9], path, "s3cret", iterations=2048)
    return path, password


def test_send_transfers_after_confirmation_and_refuses_bad_input(node, sender_keystore, tmp_path):
    path, password = sender_keystore
    to = keys.load_or_create(tmp_path / "to.json", "x", iterations=2048).address
    w3 = ChainClient(node.url).w3
    before = w3.eth.get_balance(to)
    common = ["--rpc-url", node.url, "--keystore", str(path), "--password-file", str(password)]
    declined = runner.invoke(app, ["send", to, "1.5", *common], input="n\n")
    assert declined.exit_code == 1 and "cancelled" in declined.output
    assert w3.eth.get_balance(to) == before
    sent = runner.invoke(app, ["send", to, "1.5", *common], input="y\n")
    assert sent.exit_code == 0, sent.output
    assert w3.eth.get_balance(to) - before == 3 * ETHER // 2
    block = int(sent.output.split("in block ")[1].split()[0])
    assert w3.eth.get_block(block)["transactions"]  # the transfer's block, as printed

    bad_checksum = to[:-1] + ("a" if to[-1] != "a" else "b")
    for args, message in (([bad_checksum, "1"], "not an address"),
                          (["0x1234", "1"], "not an address"),
                          ([to, "0"], "must be positive"),
                          ([to, "1000000"], "insufficient funds")):
        result = runner.invoke(app, ["send", *args, *common, "--yes"])
        assert result.exit_code == 1 and message in result.output, result.output
    assert w3.eth.get_balance(to) - before == 3 * ETHER // 2


def test_keys_show_prints_the_address_and_no_secret(sender_keystore, tmp_path):
    path, _ = sender_keystore
    account = dev_accounts(10)[9]
    result = runner.invoke(app, ["keys", "show", str(path)])
    assert result.exit_code == 0 and result.output.strip() == account.address
    assert account.key.hex().removeprefix("0x") not in result.output
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"crypto": {}}))
    result = runner.invoke(app, ["keys", "show", str(broken)])
    assert result.exit_code == 1 and "cannot read an address" in result.output


def test_submit_deadline_reaches_the_claim(node, tmp_path):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((5, 4), np.float32), rng.standard_normal((4, 3), np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    out = tmp_path / "c.npy"
    refused = runner.invoke(app, ["submit", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"),
                                  "-o", str(out), "--rpc-url", node.url, "--deadline", "0"])
    assert refused.exit_code == 1 and "--deadline must be between" in refused.output

    worker = ChainClient(node.url, dev_accounts(9)[8].key)
    worker.send(worker.market.functions.register(), value=ETHER)
    jobs_before = worker.market.functions.jobCount().call()
    box = {}
    cli = threading.Thread(target=lambda: box.update(result=runner.invoke(app, [
        "submit", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), "-o", str(out),
        "--rpc-url", node.url, "--deadline", "7", "--timeout", "60"])))
    cli.start()
    while worker.market.functions.jobCount().call() == jobs_before:
        worker.wait_for_block(worker.w3.eth.block_number + 1, 1.0)
        assert cli.is_alive(), box["result"].output
    job = jobs_before
    f = worker.market.functions
    receipt = worker.send(f.claimJob(job))
    [claimed] = worker.events(receipt, "JobClaimed")
    assert claimed["args"]["deadline"] == receipt["blockNumber"] + 7
    worker.send(f.commitResult(job, worker.put_blob(a @ b)))
    worker.send(f.finalize(job))
    cli.join(60)
    assert not cli.is_alive() and box["result"].exit_code == 0, box["result"].output
    np.testing.assert_allclose(np.load(out), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    worker.close()
