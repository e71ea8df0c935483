"""A multi-host network on one machine: Linux network namespaces made here act as hosts on
one virtual LAN (veth pairs into a bridge that lives in its own namespace). The chain node
runs on one, two workers on two others (started the way the compose worker service starts
them: deploy/worker-entrypoint.sh with the dev faucet), and a client on a fourth submits
with `needle-net submit`. No namespace has a default route, so a cut link really is
unreachable. Needs root and iproute2; skips otherwise."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
SUBNET = "10.77.0"
CHAIN_IP = f"{SUBNET}.1"
RPC_URL = f"http://{CHAIN_IP}:8545"
STALL_SECONDS = 8  # worker A hangs this long after fetching a job, while its link is cut
BLOCK_TIME = 0.5  # claims expire after the client's 20 blocks, >= 10 s

# Runs inside the client namespace: waits (bounded) for a condition on the market and
# prints what it saw as JSON.
PROBE = """
import json, sys, time
from chain.devnet import dev_account
from node.market import STATUS_NAMES, Market, is_transient
rpc, what, timeout, *args = sys.argv[1:]
end = time.time() + float(timeout)
market = None
while True:
    try:
        market = market or Market(rpc, dev_account(0))
        if what == "staked":
            result = all(market.worker_info(market.w3.to_checksum_address(a))[0] > 0
                         for a in args) or None
        elif what == "count":
            result = market.job_count()
        else:  # "job ID STATUS...": wait until job ID has one of the statuses
            job_id, wanted = int(args[0]), args[1:]
            job = market.job(job_id) if market.job_count() > job_id else None
            ok = job is not None and STATUS_NAMES[job.status] in wanted
            result = {"status": STATUS_NAMES[job.status], "worker": job.worker} if ok else None
        if result is not None:
            print(json.dumps(result), flush=True)
            break
    except Exception as err:
        if not is_transient(err) or time.time() > end:
            raise SystemExit(f"probe {what}: {err}")
    if time.time() > end:
        raise SystemExit(f"probe {what} {args}: not reached in {timeout}s")
    time.sleep(0.1)
"""


def _sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=30).stdout


class VirtualLan:
    """Namespaces `<prefix>-<host>`, each with one veth into a bridge namespace."""

    def __init__(self, hosts: list[str]) -> None:
        self.prefix = f"nn{os.getpid() % 100000}"
        self.bridge = f"{self.prefix}-br"
        self.hosts = hosts
        self.created: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def link(self, host: str) -> str:
        """The bridge-side end of the host's cable (interface names are <= 15 chars)."""
        return f"v{self.prefix}{self.hosts.index(host)}"

    def up(self) -> dict[str, str]:
        """Create everything; returns host -> IP address."""
        for ns in [self.bridge, *map(self.ns, self.hosts)]:
            _sh("ip", "netns", "add", ns)
            self.created.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.bridge, "link", "set", "br0", "up")
        addresses = {}
        for i, host in enumerate(self.hosts):
            outside, inside = self.link(host), f"{self.link(host)}h"
            _sh("ip", "link", "add", outside, "netns", self.bridge, "type", "veth",
                "peer", "name", inside, "netns", self.ns(host))
            _sh("ip", "-n", self.bridge, "link", "set", outside, "master", "br0", "up")
            _sh("ip", "-n", self.ns(host), "link", "set", inside, "name", "eth0")
            addresses[host] = f"{SUBNET}.{i + 1}"
            _sh("ip", "-n", self.ns(host), "addr", "add", f"{addresses[host]}/24", "dev", "eth0")
            _sh("ip", "-n", self.ns(host), "link", "set", "eth0", "up")
        return addresses

    def cut(self, host: str) -> None:
        _sh("ip", "-n", self.bridge, "link", "set", self.link(host), "down")

    def down(self) -> None:
        for ns in reversed(self.created):  # deleting a namespace deletes its veth ends
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _can_make_namespaces() -> str | None:
    """Why this test cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    name = f"nnprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None if made.returncode == 0 else f"ip netns add failed: {made.stderr.strip()}"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_jobs_verify_across_hosts_and_a_cut_worker_is_replaced(tmp_path):
    reason = _can_make_namespaces()
    if reason:
        pytest.skip(reason)
    lan = VirtualLan(["chain", "worker-a", "worker-b", "client"])
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
           "NEEDLE_NET_PASSWORD": "netns-test", "NEEDLE_NET_RPC": RPC_URL,
           "NEEDLE_NET_DEV_FAUCET": "1"}
    processes: list[subprocess.Popen] = []

    def spawn(host: str, args: list[str], log: str, extra_env: dict | None = None):
        with open(tmp_path / log, "ab") as out:
            process = subprocess.Popen(
                ["ip", "netns", "exec", lan.ns(host), *args], stdout=out,
                stderr=subprocess.STDOUT, env={**env, **(extra_env or {})},
                start_new_session=True)
        processes.append(process)
        return process

    def probe(what: str, *args: str, timeout: float = 120.0):
        done = subprocess.run(
            ["ip", "netns", "exec", lan.ns("client"), sys.executable, "-c", PROBE, RPC_URL,
             what, str(timeout), *args], capture_output=True, text=True, env=env,
            timeout=timeout + 60)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def start_worker(host: str, extra: list[str], extra_env: dict | None = None):
        root = tmp_path / host
        return spawn(host, [str(ROOT / "deploy" / "worker-entrypoint.sh"), "needle-net",
                            "worker", "up", "--rpc-url", RPC_URL, "--api-port", "8600", *extra],
                     f"{host}.log", {"NEEDLE_NET_WORKER_ROOT": str(root), **(extra_env or {})})

    def key_made(host: str, worker: subprocess.Popen) -> None:
        """Wait until the worker's entrypoint has created its key (bounded)."""
        for _ in range(600):
            if (tmp_path / host / "worker0" / "key.json").exists():
                return
            assert worker.poll() is None, (tmp_path / f"{host}.log").read_text()
            time.sleep(0.2)
        log = (tmp_path / f"{host}.log").read_text()
        raise AssertionError(f"{host}: no key after 120 s\n{log}")

    def address(host: str) -> str:
        key = json.loads((tmp_path / host / "worker0" / "key.json").read_text())
        return "0x" + key["address"].lower()

    def submit(name: str, rng: np.random.Generator, shape: tuple[int, int, int]):
        m, k, n = shape
        a, b = (rng.standard_normal(s, dtype=np.float32) for s in ((m, k), (k, n)))
        np.save(tmp_path / f"{name}-a.npy", a)
        np.save(tmp_path / f"{name}-b.npy", b)
        process = spawn("client", ["needle-net", "submit", str(tmp_path / f"{name}-a.npy"),
                                   str(tmp_path / f"{name}-b.npy"), "-o",
                                   str(tmp_path / f"{name}-c.npy"), "--rpc-url", RPC_URL,
                                   "--timeout", "180"], f"{name}.log")
        return process, a.astype(np.float64) @ b

    def finished(name: str, process: subprocess.Popen, expected: np.ndarray) -> None:
        assert process.wait(240) == 0, (tmp_path / f"{name}.log").read_text()
        c = np.load(tmp_path / f"{name}-c.npy")
        np.testing.assert_allclose(c, expected, rtol=1e-4, atol=1e-4)

    try:
        addresses = lan.up()
        assert addresses["chain"] == CHAIN_IP
        spawn("chain", ["needle-net", "chain", "up", "--data-dir", str(tmp_path / "chain"),
                        "--host", CHAIN_IP, "--port", "8545", "--block-time", str(BLOCK_TIME)],
              "chain.log")
        worker_a = start_worker("worker-a", ["--stall-after-claim", str(STALL_SECONDS)],
                                {"NEEDLE_NET_ALLOW_CHEAT": "1"})
        worker_b = start_worker("worker-b", [])
        assert probe("count") == 0  # the client reaches the chain across the LAN
        for host, worker in (("worker-a", worker_a), ("worker-b", worker_b)):
            key_made(host, worker)
        probe("staked", address("worker-a"), address("worker-b"))

        # 1: a job submitted from the client host is computed on a worker host and verified
        process, expected = submit("job1", np.random.default_rng(1), (96, 64, 48))
        finished("job1", process, expected)
        assert probe("job", "0", "done")["worker"].lower() in (address("worker-a"),
                                                               address("worker-b"))

        # 2: worker A claims the next job (B is stopped), its link is cut mid-job; the
        # client reopens the expired claim and B, back on the network, finishes it
        worker_b.send_signal(signal.SIGTERM)
        assert worker_b.wait(60) == 0
        process, expected = submit("job2", np.random.default_rng(2), (128, 96, 64))
        claim = probe("job", "1", "claimed", "committed", "done")
        assert claim == {"status": "claimed", "worker": claim["worker"]}, claim
        assert claim["worker"].lower() == address("worker-a")
        lan.cut("worker-a")
        worker_b = start_worker("worker-b", [])
        finished("job2", process, expected)
        final = probe("job", "1", "done")
        assert final["worker"].lower() == address("worker-b"), final
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        lan.down()
