"""Guards around the worker and the devnet, against real processes on 127.0.0.1: a devnet
refuses ports and a data dir another one holds, and says when one of its processes exits;
a worker skips jobs whose operands do not match their declaration before any transaction;
a worker that cannot start says why in one line."""
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from helpers import submit_as_declared, wait_for
from typer.testing import CliRunner
from web3 import Web3

from chain.devnet import dev_account, dev_accounts
from chain.launch import NodeProcess
from node.cli import app
from node.devnet import Devnet, DevnetError, free_port
from node.market import JOB_DONE, JOB_OPEN, Market
from node.worker import FINISHED, Worker, WorkerConfig, WorkerStartError, admin_token

pytestmark = pytest.mark.timeout(240)
FEE = 10**15
ETHER = 10**18


# -- the devnet ----------------------------------------------------------------------------


def test_a_second_devnet_on_a_running_ones_ports_or_data_dir_is_refused(tmp_path):
    data_dir, port, blob_port = tmp_path / "devnet", free_port(), free_port()
    with Devnet(data_dir, port=port, blob_port=blob_port) as net:
        net.start(workers=1)
        worker = net.workers[0]
        token_file = worker.data_dir / "admin-token"
        token = token_file.read_text()

        # what the reviewer ran: the same data dir and ports, through the CLI
        second = subprocess.run(
            [sys.executable, "-m", "node", "devnet", "up", "--workers", "1", "--data-dir",
             str(data_dir), "--port", str(port), "--blob-port", str(blob_port)],
            capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        assert f"chain port {port} is in use" in second.stdout + second.stderr
        assert token_file.read_text() == token
        assert not (data_dir / "worker1").exists()

        with pytest.raises(DevnetError, match="in use by another devnet"):
            Devnet(data_dir)  # other ports, same data dir
        with pytest.raises(DevnetError, match=f"blob port {blob_port} is in use"):
            Devnet(tmp_path / "other", blob_port=blob_port)
        assert not (tmp_path / "other").exists()

        # the running worker still takes the token in its file; once it exits, watch says so
        stop = httpx.post(f"{worker.api_url}/admin/stop", timeout=30,
                          headers={"Authorization": f"Bearer {token}"})
        assert stop.status_code == 200
        with pytest.raises(DevnetError, match=r"worker 0 exited with code 0 \(log: "):
            net.watch(interval=0.1)
    Devnet(data_dir).close()  # the data dir is free again


def test_chain_readiness_needs_an_answer_from_the_devnets_own_node(tmp_path):
    """Another node takes the port between the devnet's check and its start: its answers
    on the port must not pass for the devnet's chain, whose own node cannot bind there."""
    port = free_port()
    net = Devnet(tmp_path / "devnet", port=port)
    with NodeProcess(tmp_path / "other", block_time=0, port=port):
        with pytest.raises(DevnetError, match="chain node: process exited"):
            net.start_chain()
        net.close()


# -- jobs with operands that do not match their declaration ----------------------------------


def test_worker_skips_jobs_whose_operands_do_not_match_before_any_transaction(
        node, tmp_path, caplog):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((8, 16), np.float32), rng.standard_normal((16, 4), np.float32)
    big_a = rng.standard_normal((600, 512), np.float32)  # 2*600*512*512 FLOPs: claimed first
    big_b = rng.standard_normal((512, 512), np.float32)
    nan_a, big_nan_a = np.full_like(a, np.nan), big_a.copy()
    big_nan_a[3, 5] = np.inf
    fp32, exact = 1, 0
    good = [(a, b, (1, 8, 16, 4), fp32), (big_a, big_b, (1, 600, 512, 512), fp32)]
    bad = [  # (the reason the worker gives, the job)
        ("A has shape (8, 16), the job declares (1, 100, 16) or (100, 16)",
         (a, b, (1, 100, 16, 4), fp32)),
        ("A holds NaN or Inf", (nan_a, b, (1, 8, 16, 4), fp32)),
        ("A is int32, the job's precision class needs float32",
         (a.astype(np.int32), b.astype(np.int32), (1, 8, 16, 4), fp32)),
        ("A is float32, the job's precision class needs an integer type",
         (a, b, (1, 8, 16, 4), exact)),
        ("A holds NaN or Inf", (big_nan_a, big_b, (1, 600, 512, 512), fp32)),  # claimed path
    ]
    worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=ETHER),
                    dev_accounts(4)[3])
    thread = threading.Thread(target=worker.run, daemon=True)
    caplog.set_level(logging.WARNING, logger="needle.worker")
    thread.start()
    submitter = Market(node.url, dev_account(1))
    try:
        ids = submit_as_declared(submitter, FEE, [*good, *(job for _, job in bad)])
        wait_for(lambda: {j["job_id"] for j in worker.job_list() if j["stage"] in FINISHED}
                 >= set(ids), 120, "the worker to finish or skip every job")
    finally:
        worker.request_stop()
        thread.join(60)
    records = {j["job_id"]: j for j in worker.job_list()}

    for job_id, (x, y, _, _) in zip(ids[:len(good)], good, strict=True):
        job = submitter.job(job_id)
        assert records[job_id]["stage"] == "verified" and job.status == JOB_DONE
        np.testing.assert_allclose(submitter.get_array(job.c_id), x.astype(np.float64) @ y,
                                   rtol=1e-4, atol=1e-3)
    claimed = {e["args"]["jobId"] for e in
               submitter.contract.events.JobClaimed.get_logs(from_block=0)}
    for job_id, (reason, _) in zip(ids[len(good):], bad, strict=True):
        assert records[job_id]["stage"] == "skipped"
        assert records[job_id]["detail"] == f"operands do not match the job: {reason}"
        assert f"job {job_id} skipped: {reason}" in caplog.text
        assert submitter.job(job_id).status == JOB_OPEN and job_id not in claimed
    submitter.close()
    worker.chain.close()


# -- start-up errors -----------------------------------------------------------------------


def test_worker_gives_up_on_an_unreachable_node_after_retrying(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    config = WorkerConfig(rpc_url=url, data_dir=tmp_path, stake_wei=ETHER, connect_timeout=1.0)
    with pytest.raises(WorkerStartError, match=f"no chain node answers at {url} "
                                               r"\(retried for 1s\)"):
        Worker(config, dev_account(5))


def _worker_up(node, tmp_path, *args: str):
    return CliRunner().invoke(
        app, ["worker", "up", "--rpc-url", node.url, "--data-dir", str(tmp_path / "worker"),
              "--api-port", str(free_port()), *args],
        env={"NEEDLE_NET_PASSWORD": "pw"}, terminal_width=200)


def test_worker_up_says_what_its_unfunded_key_needs(node, tmp_path):
    result = _worker_up(node, tmp_path)
    assert result.exit_code == 1, result.output
    address = Web3.to_checksum_address(
        json.loads((tmp_path / "worker" / "key.json").read_text())["address"])
    assert f"error: worker address {address} needs funds: its balance is 0 ETH, staking " \
           "needs 1 ETH plus up to" in " ".join(result.output.split())
    market = Market(node.url, dev_account(0))
    assert market.balance_of(address) == 0 and market.stake_of(address) == 0
    market.close()


def test_worker_up_refuses_a_stake_below_the_market_minimum(node, tmp_path):
    result = _worker_up(node, tmp_path, "--stake", "0.5")
    assert result.exit_code == 1, result.output
    assert "error: a stake of 0.5 ETH is below the market's minimum stake of 1 ETH" in \
        " ".join(result.output.split())


def test_admin_token_file_errors_are_start_errors(tmp_path, monkeypatch):
    with pytest.raises(WorkerStartError, match="cannot read the admin token file .*nosuch: "
                                               "No such file or directory"):
        admin_token(tmp_path / "nosuch")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(WorkerStartError, match="is empty"):
        admin_token(tmp_path / "empty")
    (tmp_path / "token").write_text("s3cret\n")
    assert admin_token(tmp_path / "token") == "s3cret"
    monkeypatch.setenv("NEEDLE_NET_ADMIN_TOKEN", "from-env")
    assert admin_token(None) == "from-env"
    # as the file is: `export NEEDLE_NET_ADMIN_TOKEN=$(cat token)` keeps no newline, but an
    # env file may; with it no request could match. Empty (compose's unset) stays closed.
    monkeypatch.setenv("NEEDLE_NET_ADMIN_TOKEN", "from-env\n")
    assert admin_token(None) == "from-env"
    monkeypatch.setenv("NEEDLE_NET_ADMIN_TOKEN", " ")
    assert admin_token(None) is None


def test_an_api_port_in_use_is_a_start_error(node, tmp_path):
    """Not a worker that runs on without its API (uvicorn would only log the failed bind)."""
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        config = WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=10**18,
                              api_port=port)
        with pytest.raises(WorkerStartError, match=f"cannot serve the API on 127.0.0.1:{port}"):
            Worker(config, dev_account(7))


def test_a_printed_worker_config_holds_no_admin_token(tmp_path):
    """A config logged or shown in a traceback's locals must not give the token away."""
    config = WorkerConfig(rpc_url="http://127.0.0.1:1", data_dir=tmp_path, stake_wei=1,
                          admin_token="s3cret")
    assert "s3cret" not in repr(config) and config.admin_token == "s3cret"


def _connections_to(port: int) -> int:
    """This process's established TCP connections to 127.0.0.1:port (/proc: Linux)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote_port, state, inode = int(fields[2].split(":")[1], 16), fields[3], fields[9]
            count += remote_port == port and state == "01" and inode in inodes
    return count


def test_a_failed_start_closes_its_chain_connections(node, tmp_path):
    """A start that fails after the chain was reached (here the API's port is taken) closed
    only the data dir's lock: the chain client's keep-alive connections stayed open for as
    long as the error (and its traceback) was kept, as by a caller that retries."""
    port = int(node.url.rsplit(":", 1)[1])
    before = _connections_to(port)
    with socket.create_server(("127.0.0.1", 0)) as busy:
        config = WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=10**18,
                              api_port=busy.getsockname()[1])
        with pytest.raises(WorkerStartError, match="cannot serve the API") as failed:
            Worker(config, dev_account(7))
    assert failed.value.__traceback__ is not None  # the frames, the worker's among them, kept
    assert _connections_to(port) <= before
