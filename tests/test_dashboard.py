"""The worker dashboard in headless Chromium, driven over the DevTools protocol: the page
loads, lists a finished job, and updates by itself after a new one."""

import contextlib
import json
import shutil
import subprocess
import time

import httpx
import numpy as np
import pytest
from websockets.sync.client import connect

from chain.devnet import dev_account
from node.client import JobClient
from node.devnet import Devnet

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium "
                       "(apt-get install -y chromium)"),
]
FEE = 10**15
HTTP = httpx.Client(timeout=60.0)


class Page:
    """One Chromium tab spoken to over the DevTools protocol (just navigate and evaluate)."""

    def __init__(self, profile_dir):
        self.process = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
             "--remote-debugging-port=0", f"--user-data-dir={profile_dir}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile_dir / "DevToolsActivePort"
        end = time.time() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.time() < end and self.process.poll() is None, "chromium did not start"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = HTTP.get(f"http://127.0.0.1:{port}/json/list").json()
        page = next(t for t in targets if t["type"] == "page")
        self._closing = contextlib.ExitStack()
        self.ws = self._closing.enter_context(connect(page["webSocketDebuggerUrl"], max_size=None))
        self.next_id = 0

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=30))
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message["result"]

    def evaluate(self, expression):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def close(self):
        self._closing.close()
        self.process.terminate()
        self.process.wait(10)


def _rows(page):
    return page.evaluate("JSON.stringify([...document.querySelectorAll('#jobs tbody tr')]"
                         ".map(r => [r.dataset.id, r.cells[2].textContent]))")


def _wait_for_rows(page, expected, timeout=30):
    end = time.time() + timeout
    while time.time() < end:
        rows = dict(json.loads(_rows(page) or "[]"))
        if rows == expected:
            return
        time.sleep(0.2)
    raise AssertionError(f"dashboard shows {rows}, expected {expected}")


def test_dashboard_lists_jobs_and_updates_live(tmp_path):
    with Devnet(tmp_path / "devnet", block_time=0.5) as net:
        net.start_chain()
        worker = net.start_worker()
        client = JobClient(net.rpc_url, dev_account(4), fee_wei=FEE)
        a = np.ones((4, 3), np.float32)
        client.matmul(a, a.T)
        profile = tmp_path / "chromium"
        profile.mkdir()
        page = Page(profile)
        try:
            page.call("Page.enable")
            page.call("Page.navigate", url=worker.api_url + "/")
            _wait_for_rows(page, {"0": "verified"})
            assert page.evaluate("document.getElementById('address').textContent") == \
                worker.address
            assert page.evaluate("document.querySelectorAll('#blocks tbody tr').length") > 0
            client.matmul(a.T, a)  # a second job, while the page stays open
            _wait_for_rows(page, {"0": "verified", "1": "verified"})
            earned = page.evaluate("document.getElementById('earned').textContent")
            assert int(earned) == 2 * FEE == HTTP.get(f"{worker.api_url}/status").json()[
                "earned_wei"]
        finally:
            page.close()
            client.close()
