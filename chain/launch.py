"""Start and stop a chain node as a child process (tests, benchmarks, local scripts)."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

LOWEST_PICKED_PORT = 10_000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago. Where the kernel's ephemeral range
    can be read it is picked below that range: an outgoing connection's local port can then
    never take it (or port + 1, the blob listener's default) while a node restarts on it."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    for _ in range(100 if ephemeral_low - 2 > LOWEST_PICKED_PORT else 0):
        port = random.randint(LOWEST_PICKED_PORT, ephemeral_low - 2)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeProcess:
    """``python -m chain up`` on 127.0.0.1; terminate then kill on exit."""

    def __init__(self, data_dir: str | os.PathLike, block_time: float = 0.5,
                 extra_args: tuple[str, ...] = (), port: int | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.block_time = block_time
        self.extra_args = extra_args
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}-node.log"

    def start(self, timeout: float = 60.0) -> NodeProcess:
        cmd = [sys.executable, "-m", "chain", "up", "--data-dir", str(self.data_dir),
               "--port", str(self.port), "--block-time", str(self.block_time),
               *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-2000:]}")
            try:
                httpx.get(f"{self.url}/info", timeout=1).raise_for_status()
                return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"node did not answer on {self.url} within {timeout}s")

    def kill(self) -> None:
        """SIGKILL: no chance to flush anything (crash test)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> NodeProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
