"""`needle-net` review 27, a new user's view: the demo's closing line named dashboards it had
just stopped; `scripts/demo.sh --help` installed everything before answering; a bad operand
with no chain running read "cannot reach the chain node"; `balance --keystore` asked for a
password to read an address; addresses were split over lines at 80 columns, so `jobs | grep
ADDRESS` found nothing; `chain up` showed an internal name as a default and a command
without its program; insufficient funds were in wei; `needle.train --help` showed no
defaults. Checked against a real chain node process, a devnet and the scripts as run."""

import os
import re
import shutil
import signal
import subprocess
import sys
from decimal import Decimal
from io import StringIO
from pathlib import Path

import httpx
import numpy as np
import pytest
from helpers import keystore_options, submit_as_declared
from helpers import one_error_line as _one_error_line
from helpers import run_cli as _cli
from rich.console import Console
from typer.testing import CliRunner

from chain.client import ChainClient
from chain.devnet import dev_account
from chain.launch import free_port
from node import keys
from node.cli import app
from node.client import validate_operands
from node.market import JOB_CLAIMED, Market

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parent.parent
NEEDLE_NET = Path(sys.executable).with_name("needle-net")
ETHER = 10**18
FEE = 10**15
SUBMITTER, WORKER, HOLDER, SENDER = 15, 16, 17, 18  # genesis-funded dev accounts
ADDRESS = re.compile(r"0x[0-9a-fA-F]{40}")


def _piped(*args, **kwargs) -> subprocess.CompletedProcess:
    """`needle-net` with its output in a pipe at 80 columns, as `needle-net ... | grep`."""
    return subprocess.run([str(NEEDLE_NET), *map(str, args)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "80"}, **kwargs)


def _lines_until(process: subprocess.Popen, last: str) -> list[str]:
    """The lines a started process printed, up to the one holding `last`."""
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        if last in line:
            return lines
    raise AssertionError(f"the process exited without printing {last!r}: {lines}")


# -- 2. the demo names dashboards while they are live, not once they are stopped ----------


def test_the_demo_names_no_dashboard_after_stopping_it_and_keeps_addresses_whole(tmp_path):
    """Its last line listed the workers' dashboard URLs, which were dead by the time it was
    read (the devnet stops as the demo ends). The URLs now come while they answer, before
    the jobs; at 80 columns the parties' addresses stay on one line each."""
    from node.demo import run_demo

    output = StringIO()
    run_demo(1, tmp_path / "demo", Console(file=output, width=80))
    text = output.getvalue()
    before_jobs, _, rest = text.partition("1. one verified remote matmul")
    closing = rest.rsplit("└", 1)[1]  # what follows the last table
    assert "http://" not in closing, closing
    worker_address = keys.read_keyfile(tmp_path / "demo" / "worker0" / "key.json")["address"]
    assert re.search(r"dashboard.*http://127\.0\.0\.1:\d+", before_jobs, re.S), before_jobs
    table_addresses = {a.lower() for a in ADDRESS.findall(rest)}
    assert "0x" + worker_address.removeprefix("0x").lower() in table_addresses, rest
    assert dev_account(0).address.lower() in table_addresses, rest  # the demo's client


# -- 3. scripts/demo.sh --help answers at once --------------------------------------------


def _bare_path(tmp_path) -> str:
    """A PATH with only what the script itself needs: no compiler and no python3, so the
    install (which needs both) fails at once if it runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "cat"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


def _demo_sh(tmp_path, venv: Path, *args) -> subprocess.CompletedProcess:
    env = {"PATH": _bare_path(tmp_path), "NEEDLE_VENV": str(venv), "HOME": str(tmp_path)}
    return subprocess.run([shutil.which("bash"), str(ROOT / "scripts" / "demo.sh"), *args],
                          capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_demo_sh_help_without_an_install_prints_the_options_and_installs_nothing(tmp_path,
                                                                                flag):
    """It sourced install.sh first (pip installs, a C++ build) and showed the help only
    after: here it stopped on the missing compiler without any help."""
    venv = tmp_path / "venv"
    result = _demo_sh(tmp_path, venv, "--workers", "3", flag)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "needle-net demo" in result.stdout and not venv.exists()
    assert _options(result.stdout) == _options(_cli("demo", "--help").output)


def test_demo_sh_help_with_an_install_is_needle_net_demos_own_help(tmp_path):
    result = _demo_sh(tmp_path, NEEDLE_NET.parent.parent, "--help")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Run a devnet, a verified job and training" in result.stdout, result.stdout


def _options(help_text: str) -> set[str]:
    return set(re.findall(r"--[a-z][a-z-]+", help_text)) - {"--help"}


# -- 4. operands are checked before the chain is asked -------------------------------------


@pytest.mark.parametrize("a,b", [
    (np.ones((2, 2)), np.ones((2, 2))),  # float64
    (np.ones((2, 3), np.float32), np.ones((2, 3), np.float32)),
    (np.full((2, 2), np.nan, np.float32), np.ones((2, 2), np.float32)),
    (np.ones(3, np.float32), np.ones(3, np.float32)),
    (np.ones((2, 2), np.int32), np.ones((2, 2), np.float32)),
], ids=["float64", "shapes", "nan", "1-D", "dtypes"])
def test_a_bad_operand_is_named_with_no_chain_running_and_no_password(tmp_path, monkeypatch,
                                                                       a, b):
    """Without a chain, each said "cannot reach the chain node" (and with a keystore and
    no password, "no keystore password"): the operands were checked only once the node had
    answered."""
    monkeypatch.delenv(keys.PASSWORD_ENV, raising=False)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    with pytest.raises(ValueError) as reference:
        validate_operands(a, b, 1 << 30)
    options = keystore_options(tmp_path, SUBMITTER)[:2]  # a keystore, no password
    line = _one_error_line(_cli("submit", tmp_path / "a.npy", tmp_path / "b.npy", "-o",
                                tmp_path / "c.npy", "--rpc-url",
                                f"http://127.0.0.1:{free_port()}", *options))
    assert line == f"error: [stage validate] pair 0: {reference.value}"


def test_big_endian_operands_pass_the_early_check(tmp_path):
    """A .npy written on a big-endian machine loads as >f4: valid, so the next step (the
    node, not running here) is reached."""
    a = np.ones((2, 2), ">f4")
    np.save(tmp_path / "a.npy", a)
    line = _one_error_line(_cli("submit", tmp_path / "a.npy", tmp_path / "a.npy", "-o",
                                tmp_path / "c.npy", "--rpc-url",
                                f"http://127.0.0.1:{free_port()}"))
    assert "cannot reach the chain node" in line, line


# -- 5. balance reads a keystore's address without its password ----------------------------


def test_balance_of_a_keystore_needs_no_password(node, tmp_path, monkeypatch):
    monkeypatch.delenv(keys.PASSWORD_ENV, raising=False)
    keystore = keystore_options(tmp_path, HOLDER)[1]
    result = _cli("balance", "--keystore", keystore, "--rpc-url", node.url)
    assert result.exit_code == 0, result.output
    address = dev_account(HOLDER).address
    observer = Market(node.url, dev_account(0))
    wei = observer.balance_of(address)
    observer.close()
    assert result.output.splitlines()[:2] == [address,
                                              f"  balance {Decimal(wei) / ETHER:.6f} ETH"]


def test_balance_of_a_keystore_without_an_address_is_one_error_line(tmp_path, monkeypatch):
    monkeypatch.delenv(keys.PASSWORD_ENV, raising=False)
    keystore = tmp_path / "key.json"
    keystore.write_text('{"version": 3, "crypto": {}}')
    line = _one_error_line(_cli("balance", "--keystore", keystore))
    assert "it has no \"address\" field" in line, line


# -- 6. addresses stay on one line at 80 columns -----------------------------------------


def test_jobs_piped_at_80_columns_has_each_worker_address_on_one_line(node):
    """`needle-net jobs | grep ADDRESS` found nothing: the column folded the address."""
    market = Market(node.url, dev_account(SUBMITTER))
    worker = ChainClient(node.url, dev_account(WORKER).key)
    a = np.ones((2, 2), np.float32)
    try:
        worker.send(worker.market.functions.register(), value=ETHER)
        [job_id] = submit_as_declared(market, FEE, [(a, a, (1, 2, 2, 2), 1)])
        worker.send(worker.market.functions.claimJob(job_id))
        assert market.job(job_id).status == JOB_CLAIMED
    finally:
        worker.close()
        market.close()
    result = _piped("jobs", "--rpc-url", node.url)
    assert result.returncode == 0, result.stderr
    [row] = [line for line in result.stdout.splitlines() if dev_account(WORKER).address in line]
    assert row.split()[1] == str(job_id), row


def test_devnet_up_piped_at_80_columns_has_addresses_and_urls_on_one_line(tmp_path):
    port, blob_port = free_port(), free_port()
    with subprocess.Popen(
            [str(NEEDLE_NET), "devnet", "up", "--workers", "1", "--data-dir", str(tmp_path),
             "--port", str(port), "--blob-port", str(blob_port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "COLUMNS": "80"}) as devnet:
        try:
            lines = _lines_until(devnet, "logs in ")  # the line after the table
            address = keys.read_keyfile(tmp_path / "worker0" / "key.json")["address"]
            [row] = [line for line in lines if line.lower().count(address.lower()) == 1]
            assert "worker 0" in row, lines
            api_url = re.search(r"http://\S+", row)[0]  # cut short, another port or none
            status = httpx.get(f"{api_url}/status", timeout=10).json()
            assert status["address"].lower().endswith(address.lower()), row
        finally:
            devnet.send_signal(signal.SIGINT)
            devnet.communicate(timeout=60)
    assert any(f"http://127.0.0.1:{port} " in line for line in lines), lines


# -- 7. chain up: its help's defaults and its banner --------------------------------------


def test_chain_up_help_shows_the_max_connections_default_as_a_number():
    result = CliRunner().invoke(app, ["chain", "up", "--help"], terminal_width=200,
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    option = result.output.split("--max-connections", 1)[1].split("--log-level", 1)[0]
    assert "[default: 1024]" in option and "UVICORN" not in result.output, result.output


def test_chain_up_banner_names_a_command_that_runs(tmp_path):
    """It said "see `chain accounts --keys`", which no shell runs."""
    with subprocess.Popen(
            [str(NEEDLE_NET), "chain", "up", "--data-dir", str(tmp_path), "--port",
             str(free_port()), "--blob-port", str(free_port())],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as chain:
        try:
            lines = _lines_until(chain, "JSON-RPC")
        finally:
            chain.send_signal(signal.SIGTERM)
            chain.communicate(timeout=60)
    [line] = [line for line in lines if "accounts --keys" in line]
    command = re.search(r"`([^`]*)`", line)[1]
    accounts = subprocess.run([str(NEEDLE_NET), *command.split()[1:]], capture_output=True,
                              text=True, timeout=60)
    assert command.startswith("needle-net ") and accounts.returncode == 0, (line, accounts)
    assert dev_account(0).key.hex() in accounts.stdout


# -- 9. insufficient funds in ETH ---------------------------------------------------------


def _ether(text: str) -> int:
    """Wei of an amount the CLI printed in ETH (exact digits)."""
    return int(Decimal(text) * ETHER)


def test_a_refused_transfer_says_its_amounts_in_ether(node, tmp_path):
    """It said "balance 9994976999979456137055 ... < cost 1000000000000600000004200000"."""
    observer = Market(node.url, dev_account(0))
    balance = observer.balance_of(dev_account(SENDER).address)
    observer.close()
    line = _one_error_line(_cli("send", dev_account(1).address, "1000000", "--yes",
                                "--rpc-url", node.url, *keystore_options(tmp_path, SENDER)))
    found = re.fullmatch(r"error: transfer refused: insufficient funds: balance (\S+) ETH "
                         r"\(with (\S+) ETH committed to pending transactions\) < cost (\S+) "
                         r"ETH", line)
    assert found, line
    assert _ether(found[1]) == balance and _ether(found[2]) == 0
    assert 10**6 * ETHER < _ether(found[3]) < (10**6 + 1) * ETHER  # the value and its gas


def test_a_refused_submission_says_its_amounts_in_ether(node, tmp_path):
    np.save(tmp_path / "a.npy", np.ones((2, 2), np.float32))
    line = _one_error_line(_cli("submit", tmp_path / "a.npy", tmp_path / "a.npy", "-o",
                                tmp_path / "c.npy", "--fee", "1e9", "--rpc-url", node.url,
                                *keystore_options(tmp_path, SENDER)))
    found = re.search(r"insufficient funds: balance (\S+) ETH .* < cost (\S+) ETH", line)
    assert found, line
    assert 10**9 * ETHER < _ether(found[2]) < (10**9 + 1) * ETHER


# -- 10. needle.train --help ---------------------------------------------------------------


def test_train_help_says_what_it_does_and_shows_the_defaults(capsys):
    from needle.train import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    options = {entry.split()[0]: " ".join(entry.split())  # each option's help on one line
               for entry in re.split(r"\n  (?=-)", text)[1:]}
    for option, default in (("--epochs", 5), ("--optimizer", "adam"), ("--lr", 0.001),
                            ("--batch-size", 64), ("--device", "cpu"), ("--seed", 0)):
        assert options[option].endswith(f"(default: {default})"), options[option]
    assert "(default: None)" not in text and "default" not in options["--clip"]
    description = " ".join(text.split("\n\n")[1].split())
    assert description.startswith("Train a model on local data. Classification"), description
