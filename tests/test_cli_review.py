"""`needle-net` and `python -m chain` as a user types them, against a real chain node process
on 127.0.0.1: numbers a worker cannot run with, an unknown log level, a URL that is no chain
node and an existing output file are refused with one `error:` line (or a usage error)
before anything is created, spent or overwritten."""

import stat
import subprocess
import sys
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from helpers import one_error_line as _one_error_line
from helpers import run_cli as _cli
from helpers import submit_as_declared, wait_for

from chain.client import ChainClient
from chain.devnet import dev_account
from chain.launch import NodeProcess, free_port
from node.market import JOB_DONE, Market

pytestmark = pytest.mark.timeout(300)
ETHER = 10**18
FEE = 10**15


def _chain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chain", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("option,value,message", [
    ("--stake", "nan", "--stake must be positive"),
    ("--stake", "-1", "--stake must be positive"),
    ("--min-fee", "-0.5", "--min-fee must be zero or more"),
    ("--max-flops", "nan", "--max-flops must be a positive number of FLOPs"),
    ("--poll-interval", "0", "--poll-interval must be a positive number of seconds"),
])
def test_worker_up_refuses_bad_numbers_before_creating_a_key(node, tmp_path, monkeypatch,
                                                             option, value, message):
    monkeypatch.setenv("NEEDLE_NET_PASSWORD", "pw")
    line = _one_error_line(_cli("worker", "up", "--data-dir", tmp_path / "w", "--rpc-url",
                                node.url, "--api-port", free_port(), option, value))
    assert line.startswith(f"error: {message}")
    assert not (tmp_path / "w" / "key.json").exists()


@pytest.mark.parametrize("command", [
    ["worker", "up", "--api-port", "70000"], ["devnet", "up", "--block-time", "-1"],
    ["devnet", "up", "--workers", "-1"], ["devnet", "up", "--blob-port", "-2"],
    ["demo", "--workers", "0"],
])
def test_out_of_range_ports_and_counts_are_usage_errors(tmp_path, monkeypatch, command):
    monkeypatch.setenv("NEEDLE_NET_PASSWORD", "pw")
    result = _cli(*command, "--data-dir", tmp_path / "d")
    option = next(arg for arg in command if arg.startswith("--"))
    assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("command", [["devnet", "up"], ["worker", "up"], ["demo"]],
                         ids=" ".join)
def test_a_data_dir_that_is_a_file_is_one_error_line(tmp_path, monkeypatch, command):
    monkeypatch.setenv("NEEDLE_NET_PASSWORD", "pw")
    (tmp_path / "state").write_text("not a directory")
    line = _one_error_line(_cli(*command, "--data-dir", tmp_path / "state"))
    assert line == f"error: --data-dir {tmp_path / 'state'} is not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_chain_up_log_level_is_checked_first_and_case_insensitive(tmp_path):
    refused = _chain("up", "--log-level", "verbose", "--port", "0", "--data-dir",
                     str(tmp_path / "bad"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "Invalid value for '--log-level'" in refused.stderr
    assert not (tmp_path / "bad").exists()
    for level in ("INFO", "trace"):  # trace: uvicorn's own level, unknown to logging
        with NodeProcess(tmp_path / level, block_time=0,
                         extra_args=("--log-level", level)) as proc:
            assert httpx.get(f"{proc.url}/info").json()["chain_id"] > 0


def test_chain_info_answers_one_line_for_what_is_not_a_chain_node(node):
    blob_listener = urlsplit(httpx.get(f"{node.url}/info").json()["blob_url"])
    for url, message in [
        (f"http://127.0.0.1:{free_port()}", "error: cannot reach the chain node at "),
        ("notaurl", "error: not a chain node URL"),
        (f"http://127.0.0.1:{blob_listener.port}",
         f"http://127.0.0.1:{blob_listener.port} is not a needle-net chain node: its /info "
         "answered HTTP 404"),
    ]:
        result = _chain("info", "--url", url)
        lines = result.stderr.splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr
        assert lines[0].startswith("error: ") and message in lines[0], lines[0]
    shown = _chain("info", "--url", node.url)
    assert shown.returncode == 0, shown.stderr
    assert '"chain_id"' in shown.stdout and '"abi"' not in shown.stdout


def test_submit_refuses_an_existing_output_before_spending(node, tmp_path):
    np.save(tmp_path / "a.npy", np.ones((2, 2), np.float32))
    out = tmp_path / "c.npy"
    out.write_bytes(b"earlier result")
    observer = Market(node.url, dev_account(5))
    try:
        jobs, nonce = observer.job_count(), observer.w3.eth.get_transaction_count(
            dev_account(0).address)
        line = _one_error_line(_cli("submit", tmp_path / "a.npy", tmp_path / "a.npy", "-o", out,
                                    "--rpc-url", node.url))
        assert line == f"error: output {out} exists; pass --force to overwrite it"
        assert observer.job_count() == jobs
        assert observer.w3.eth.get_transaction_count(dev_account(0).address) == nonce
    finally:
        observer.close()
    assert out.read_bytes() == b"earlier result"


def test_fetch_overwrites_an_existing_output_only_when_forced(node, tmp_path):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4), np.float32), rng.standard_normal((4, 2), np.float32)
    market = Market(node.url, dev_account(6))
    worker = ChainClient(node.url, dev_account(7).key)
    try:
        worker.send(worker.market.functions.register(), value=ETHER)
        [job_id] = submit_as_declared(market, FEE, [(a, b, (1, 3, 4, 2), 1)])
        f = worker.market.functions
        worker.send(f.claimJob(job_id))
        worker.send(f.commitResult(job_id, worker.put_blob(a @ b)))
        worker.send(f.finalize(job_id))
        assert market.job(job_id).status == JOB_DONE
    finally:
        worker.close()
        market.close()
    out = tmp_path / "c.npy"
    out.write_bytes(b"earlier result")
    out.chmod(0o640)  # a replaced file keeps its permissions (the default would be 0o644)
    line = _one_error_line(_cli("fetch", job_id, "-o", out, "--rpc-url", node.url))
    assert line == f"error: output {out} exists; pass --force to overwrite it"
    assert out.read_bytes() == b"earlier result"
    forced = _cli("fetch", job_id, "-o", out, "--force", "--rpc-url", node.url)
    assert forced.exit_code == 0, forced.output
    np.testing.assert_allclose(np.load(out), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npy"]  # no temporary left


def test_worker_api_answers_a_revert_and_a_lost_chain_node_without_a_500(tmp_path):
    """A withdrawal asked for again after the stake is out reverts on chain ("no stake"):
    409 with that reason; with the chain node gone, /blocks is 503. Before: both 500."""
    from node.devnet import Devnet

    with Devnet(tmp_path, block_time=0.2) as net:
        net.start(1)
        [worker] = net.workers
        admin = {"Authorization": f"Bearer {worker.admin_token}"}
        requested = httpx.post(f"{worker.api_url}/admin/withdraw", headers=admin,
                               timeout=30).json()
        observer = Market(net.rpc_url, dev_account(5))
        try:
            wait_for(lambda: observer.block_number() >= requested["available_block"], 30,
                     "the withdrawal cooldown")
        finally:
            observer.close()
        withdrawn = httpx.post(f"{worker.api_url}/admin/withdraw", headers=admin, timeout=30)
        assert "withdrawn_wei" in withdrawn.json(), withdrawn.text
        again = httpx.post(f"{worker.api_url}/admin/withdraw", headers=admin, timeout=30)
        assert again.status_code == 409, again.text
        assert again.json() == {"detail": "the chain refused: no stake"}
        net.chain.terminate()
        net.chain.wait(30)
        blocks = httpx.get(f"{worker.api_url}/blocks", timeout=60)
        assert blocks.status_code == 503, blocks.text
        assert blocks.json() == {"detail": "the chain node cannot be reached; try again"}
