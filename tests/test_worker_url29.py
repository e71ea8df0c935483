"""An RPC URL's credentials stay out of what `needle-net worker up` prints (its output goes to
`docker compose logs`), from a review: the start line and the "not a chain node" error showed
user:password@ and the path's API key, where the worker's API already hid them. Real
`needle-net worker up` processes, a real chain node and a real web server on 127.0.0.1."""
import http.server
import os
import subprocess
import sys
import time

import pytest
from helpers import http_server

from chain.devnet import dev_account
from chain.launch import NodeProcess, free_port
from node import keys

pytestmark = pytest.mark.timeout(120)
SECRETS = ("hunter2", "SECRETKEY")


def _worker_up(tmp_path, url: str) -> subprocess.Popen:
    data_dir = tmp_path / "worker"
    data_dir.mkdir(exist_ok=True)
    (tmp_path / "pw").write_text("pw")
    if not (data_dir / "key.json").exists():  # a funded dev account: the start goes through
        keys.save_keystore(dev_account(13), data_dir / "key.json", "pw", iterations=2048)
    return subprocess.Popen(
        [sys.executable, "-m", "node", "worker", "up", "--rpc-url", url, "--data-dir",
         str(data_dir), "--password-file", str(tmp_path / "pw"), "--api-port",
         str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_the_start_line_leaves_the_credentials_out(tmp_path):
    with NodeProcess(tmp_path / "chain", block_time=0) as chain:
        host = chain.url.removeprefix("http://")
        worker = _worker_up(tmp_path, f"http://user:hunter2@{host}")
        try:
            line = worker.stdout.readline()
            deadline = time.monotonic() + 60
            while line and not line.startswith("worker ") and time.monotonic() < deadline:
                line = worker.stdout.readline()
        finally:
            worker.terminate()
            rest, _ = worker.communicate(timeout=60)
        assert line.startswith(f"worker {dev_account(13).address} on http://***@{host}, "
                               "API http://127.0.0.1:"), line + rest
        assert not any(secret in line + rest for secret in SECRETS), line + rest


class _NotANode(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):  # noqa: N802
        self.do_GET()

    def log_message(self, *args):
        pass


def test_a_start_error_leaves_the_credentials_out(tmp_path):
    with http_server(_NotANode) as server:
        host = f"127.0.0.1:{server.server_port}"
        worker = _worker_up(tmp_path, f"http://user:hunter2@{host}/v3/SECRETKEY")
        output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 1, output
    assert f"error: http://***@{host}/*** is not a needle-net chain node" in output, output
    assert not any(secret in output for secret in SECRETS), output
