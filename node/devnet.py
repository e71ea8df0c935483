"""A local development network as real processes: one chain node and N worker nodes.

Each worker gets its own data directory with an encrypted keystore (created on first
start), is funded from the dev faucet account, and stakes on start. Used by
`needle-net devnet up`, `needle-net demo`, the end-to-end tests and the benchmark.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import httpx
from eth_account.signers.local import LocalAccount
from web3 import Web3

from chain.dirlock import DirUnusable, claim_data_dir
from chain.launch import free_port
from node.keys import load_or_create, read_password

FAUCET_INDEX = 19  # the last dev account funds workers; clients default to account 0
WORKER_FUNDING_WEI = 5 * 10**18
# Dev keystores sit next to their password file, so a slow KDF would protect nothing.
DEV_KDF_ITERATIONS = 2**12
START_TIMEOUT = 90.0
LOCK_FILE = "devnet.lock"
TCP_LISTEN = "0A"  # a socket's state in /proc/net/tcp


class DevnetError(RuntimeError):
    """The devnet cannot run: a port or its data dir is taken, or one of its processes
    exited. Its message is one line, meant to be shown as it is."""


def wait_until(check, timeout: float, what: str, process: subprocess.Popen | None = None,
               log: Path | None = None) -> None:
    """Poll `check()` until it is true; fail early if `process` died, late on timeout. Both
    are DevnetErrors naming `log`, where the process said why: the CLI shows them as one
    line (a TimeoutError read "cannot reach the chain node" there, for a worker too)."""
    where = _log_note(log)
    end = time.time() + timeout
    while time.time() < end:
        if process is not None and process.poll() is not None:
            raise DevnetError(f"{what}: process exited with code {process.returncode}{where}")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise DevnetError(f"{what}: not ready after {timeout:.0f}s{where}")


@dataclass
class WorkerProcess:
    index: int
    account: LocalAccount
    data_dir: Path
    api_url: str
    admin_token: str
    process: subprocess.Popen
    args: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.account.address


class Devnet:
    """Start with `Devnet(data_dir).start(workers=2)`; stop with `close()` (or use `with`)."""

    def __init__(self, data_dir: Path, *, port: int | None = None, block_time: float = 0.2,
                 log_to_files: bool = True, blob_port: int | None = None,
                 worker_api_port: int | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.blob_port = blob_port  # None: chain up's default (port + 1, else any free one)
        self.worker_api_port = worker_api_port  # worker i's API on this + i; None: any free
        if blob_port and blob_port == self.port:  # else the chain node exits, "in use"
            raise DevnetError(f"the blob port must differ from the chain port {self.port}")
        _require_free(self.port, "chain")
        if blob_port:
            _require_free(blob_port, "blob")
        self.password_file = self.data_dir / "password"
        self.chain: subprocess.Popen | None = None
        self.workers: list[WorkerProcess] = []
        self._lock: TextIO | None = None
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._lock = _lock(self.data_dir)
            if not self.password_file.exists():
                _write_private(self.password_file, secrets.token_hex(16))
        except OSError as err:  # read-only, a file on the path, no space, ...
            self.close()
            raise DevnetError(f"cannot use data dir {self.data_dir}: "
                              f"{err.strerror or err}") from None
        self.rpc_url = f"http://127.0.0.1:{self.port}"
        self.block_time = block_time
        self.log_to_files = log_to_files

    def __enter__(self) -> Devnet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def log(self, log_name: str) -> Path | None:
        """Where a process's output goes (None: to this process's own)."""
        return self.data_dir / log_name if self.log_to_files else None

    def _spawn(self, args: list[str], log_name: str, env: dict | None = None) -> subprocess.Popen:
        log = self.log(log_name)
        out = open(log, "ab") if log is not None else None  # noqa: SIM115
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "node", *args], stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})}, start_new_session=True,
                preexec_fn=_terminate_with_parent,
            )
        finally:  # the child has its own copy: keeping ours leaked one per process started
            if out is not None:
                out.close()

    def start(self, workers: int = 1) -> Devnet:
        for index in range(workers if self.worker_api_port else 0):  # a port taken is
            self._worker_api_port(index)  # named before anything starts
        self.start_chain()
        for _ in range(workers):
            self.start_worker()
        return self

    def start_chain(self) -> None:
        """Start the chain node (again, after it stopped: it resumes from its data dir)."""
        _require_stopped(self.chain, "the chain node")
        self.chain = self._spawn(
            ["chain", "up", "--data-dir", str(self.data_dir / "chain"), "--host", "127.0.0.1",
             "--port", str(self.port), "--block-time", str(self.block_time),
             *(["--blob-port", str(self.blob_port)] if self.blob_port is not None else [])],
            "chain.log")
        wait_until(lambda: httpx.get(f"{self.rpc_url}/info", timeout=2).status_code == 200
                   and _listens(self.chain.pid, self.port), START_TIMEOUT, "chain node",
                   self.chain, self.log("chain.log"))

    def worker_dir(self, index: int) -> Path:
        return self.data_dir / f"worker{index}"

    def worker_account(self, index: int) -> LocalAccount:
        """Worker `index`'s key (its keystore is created here if it does not exist yet), with
        the password read as the worker reads it: a password file ending in a newline
        (`echo pw > password`) made a keystore its worker could not open."""
        return load_or_create(self.worker_dir(index) / "key.json",
                              read_password(self.password_file), DEV_KDF_ITERATIONS)

    def start_worker(self, index: int | None = None, *, extra_args: tuple[str, ...] = (),
                     env: dict | None = None, wait: bool = True) -> WorkerProcess:
        """Start worker `index` (by default the next index not in use); reuses its keystore
        if it exists."""
        if index is None:
            index = max((w.index for w in self.workers), default=-1) + 1
        for running in self.workers:
            if running.index == index:
                _require_stopped(running.process, f"worker {index}")
        data_dir = self.worker_dir(index)
        account = self.worker_account(index)
        self._fund(account.address)
        api_port = self._worker_api_port(index)
        token = secrets.token_hex(16)
        _write_private(data_dir / "admin-token", token)
        args = ["worker", "up", "--rpc-url", self.rpc_url, "--data-dir", str(data_dir),
                "--password-file", str(self.password_file), "--api-port", str(api_port),
                "--admin-token-file", str(data_dir / "admin-token"),
                *extra_args]
        process = self._spawn(args, f"worker{index}.log", env)
        worker = WorkerProcess(index, account, data_dir, f"http://127.0.0.1:{api_port}", token,
                               process, args)
        self.workers = [w for w in self.workers if w.index != index] + [worker]
        if wait:
            wait_until(lambda: httpx.get(f"{worker.api_url}/status", timeout=2).json()
                       ["stake_wei"] > 0 and _listens(process.pid, api_port), START_TIMEOUT,
                       f"worker {index}", process, self.log(f"worker{index}.log"))
        return worker

    def _worker_api_port(self, index: int) -> int:
        """Worker `index`'s API port: worker_api_port + index, checked free, else any."""
        if not self.worker_api_port:
            return free_port()
        port = self.worker_api_port + index
        chain_ports = (self.port, self.port + 1 if self.blob_port is None else self.blob_port)
        if port > 65535 or port in chain_ports:
            raise DevnetError(f"worker {index}'s API port {port} (the worker API port "
                              f"{self.worker_api_port} + {index}) is "
                              + ("past 65535" if port > 65535 else "one of the chain's ports"))
        _require_free(port, f"worker {index} API")
        return port

    def _fund(self, address: str) -> None:
        """Top the address up to WORKER_FUNDING_WEI from the faucet dev account."""
        from chain.devnet import dev_account

        w3 = Web3(Web3.HTTPProvider(self.rpc_url))
        missing = WORKER_FUNDING_WEI - w3.eth.get_balance(address)
        if missing <= 0:
            return
        faucet = dev_account(FAUCET_INDEX)
        tx = {"to": address, "value": missing, "gas": 21000, "chainId": w3.eth.chain_id,
              "nonce": w3.eth.get_transaction_count(faucet.address, "pending"),
              "maxFeePerGas": w3.eth.gas_price * 2, "maxPriorityFeePerGas": 0}
        tx_hash = w3.eth.send_raw_transaction(faucet.sign_transaction(tx).raw_transaction)
        w3.eth.wait_for_transaction_receipt(tx_hash, timeout=30, poll_latency=0.05)

    def stop_worker(self, worker: WorkerProcess, *, kill: bool = False,
                    timeout: float = 30.0) -> int:
        """SIGTERM (graceful: finishes jobs in flight) or SIGKILL; returns the exit code."""
        return _stop(worker.process, signal.SIGKILL if kill else signal.SIGTERM, timeout)

    def processes(self) -> list[tuple[str, subprocess.Popen, Path | None]]:
        """(name, process, log) of every process started: the chain node, then the workers."""
        chain = [("chain node", self.chain, self.log("chain.log"))] if self.chain else []
        return [*chain, *((f"worker {w.index}", w.process, self.log(f"worker{w.index}.log"))
                          for w in self.workers)]

    def watch(self, interval: float = 0.5) -> None:
        """Block while the chain and every worker run, then raise DevnetError naming the
        first process that exited: a devnet that lost one is broken, and says so."""
        processes = self.processes()
        while True:
            for name, process, log in processes:
                if process.poll() is not None:
                    raise DevnetError(f"{name} exited with code {process.returncode}"
                                      f"{_log_note(log)}; devnet stopped")
            time.sleep(interval)

    def close(self) -> None:
        for worker in self.workers:
            _stop(worker.process, signal.SIGTERM, 15.0)
        if self.chain is not None:
            _stop(self.chain, signal.SIGTERM, 15.0)
        if self._lock is not None:
            self._lock.close()  # releases the data dir
            self._lock = None


def _require_free(port: int, what: str) -> None:
    """DevnetError if something listens on `port` (bound as the node binds, SO_REUSEADDR:
    a port left in TIME_WAIT is free): the node would fail to start there, while the
    readiness check might take the answer of whatever holds it for its own."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as err:
            raise DevnetError(f"{what} port {port} is in use ({err.strerror}): is another "
                              "devnet or chain node running there?") from None


def _require_stopped(process: subprocess.Popen | None, what: str) -> None:
    """DevnetError if `process` still runs: a second one on its data dir would share its key
    (or fail on its lock), and the devnet, which keeps one process per role, would no
    longer stop the first one on close."""
    if process is not None and process.poll() is None:
        raise DevnetError(f"{what} is running (pid {process.pid}): stop it before starting "
                          "it again")


def _log_note(log: Path | None) -> str:
    return f" (log: {log})" if log is not None else ""


def _write_private(path: Path, text: str) -> None:
    """Write a secret (the keystores' password, an admin token) readable by its owner only,
    from its first byte: with the usual umask, write_text left the admin token readable by
    every local user, who could stop the worker or have it withdraw its stake."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # a file that existed keeps its mode through O_CREAT
        f.write(text)


def _lock(data_dir: Path) -> TextIO:
    """The data dir's lock, held while the devnet runs: a second devnet there would start
    workers with the same keys and overwrite their admin tokens."""
    try:
        return claim_data_dir(data_dir, LOCK_FILE, "devnet")
    except DirUnusable as exc:
        raise DevnetError(str(exc)) from exc.__cause__


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds the socket listening on TCP `port`, from Linux's /proc
    (elsewhere: assumed, the ports were found free before the start). So an answer on the
    port is known to come from the process the devnet started, not from another."""
    if not os.path.exists("/proc/net/tcp"):
        return True
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for fields in (line.split() for line in Path(table).read_text().splitlines()[1:]):
                if fields[3] == TCP_LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    listening.add(f"socket:[{fields[9]}]")
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in listening:
                    return True
    return False


def _terminate_with_parent() -> None:
    """In the child (Linux): get SIGTERM when the devnet's process dies, even by SIGKILL,
    so no chain or worker outlives it."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _stop(process: subprocess.Popen, sig: int, timeout: float) -> int:
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
