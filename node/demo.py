"""`needle-net demo`: a devnet with workers, one remote matmul, and a short training run
with offloaded matmuls; then what each party saw and earned."""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.markup import escape

from node.cli import print_table
from node.client import JobClient, RemoteJobError
from node.devnet import Devnet, DevnetError
from node.training import train_digits

ETHER = 10**18
JOB_TIMEOUT = 120.0  # seconds the demo's client waits for each job
LOG_TAIL_LINES = 10
BOOKS_TIMEOUT = 10.0  # seconds the table waits for workers to book their last verdicts


def _balances(client: JobClient, addresses: list[str]) -> dict[str, int]:
    return {a: client.market.balance_of(a) for a in addresses}


def _books(net: Devnet) -> dict[str, tuple[int, int]]:
    """(jobs verified, fees earned in wei) of each worker, as its /status counts them: over
    its data dir's whole history, so a demo on a reused `--data-dir` takes differences. A
    worker books a verdict just after the chain (and so the client) has it: its jobs in
    flight are waited for, for at most BOOKS_TIMEOUT seconds."""
    end = time.monotonic() + BOOKS_TIMEOUT
    books = {}
    for w in net.workers:
        while True:
            status = httpx.get(f"{w.api_url}/status", timeout=5).json()
            if status["in_flight"] == 0 or time.monotonic() > end:
                break
            time.sleep(0.1)
        books[w.address] = (status["completed"], status["earned_wei"])
    return books


def _interrupt(*_) -> None:
    raise KeyboardInterrupt("terminated (SIGTERM)")


def _import_up_front(console: Console) -> None:
    """Import what the demo uses later before any process starts: without scikit-learn
    (the training step's data) the demo stops here with one line, not after step 1; and
    Ctrl-C cannot land in the first import of numpy.random or scikit-learn, whose Cython
    modules' initialisation drops a KeyboardInterrupt (the demo then ran on)."""
    import numpy.random  # noqa: F401

    try:
        import sklearn.datasets  # noqa: F401
    except ImportError as err:
        console.print(f"[red]error:[/red] the demo's training step needs scikit-learn "
                      f"(pip install scikit-learn): {escape(str(err))}", soft_wrap=True)
        raise SystemExit(1) from None


def run_demo(workers: int, data_dir: Path | None, console: Console) -> None:
    """Ctrl-C or SIGTERM at any point stops the devnet's processes and removes the
    temporary data dir before the demo exits."""
    _import_up_front(console)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with tempfile.TemporaryDirectory(prefix="needle-net-demo-") as tmp:
            root = Path(data_dir) if data_dir else Path(tmp)
            console.rule("needle-net demo")
            console.print(f"starting a chain node and {workers} worker(s) in {root} ...")
            with Devnet(root, block_time=0.2) as net:
                try:
                    _show(net, workers, console)
                except KeyboardInterrupt as err:
                    console.print(f"{str(err) or 'interrupted'}; stopping the chain node and "
                                  "workers ...")
                    raise
                except (DevnetError, RemoteJobError) as err:
                    _report_failure(net, err, console)
                    raise SystemExit(1) from None
            console.print("the demo's chain node and workers are stopped; `needle-net devnet "
                          "up` runs a network that stays up, each worker's dashboard at its "
                          "API URL")
    finally:
        signal.signal(signal.SIGTERM, previous)


def _report_failure(net: Devnet, err: Exception, console: Console) -> None:
    """One error line, then the end of the log of each process that exited: the demo's
    temporary data dir, logs included, is gone once it exits (before, a process that died
    or a job nobody took ended in a traceback, and the logs that said why were deleted)."""
    console.print(f"[red]error:[/red] {escape(str(err))}", soft_wrap=True)
    for name, process, log in net.processes():
        if process.poll() is None:
            continue
        console.print(f"{name} exited with code {process.returncode}; the end of its log:")
        lines = log.read_text(errors="replace").splitlines() if log and log.exists() else []
        console.print(escape("\n".join(lines[-LOG_TAIL_LINES:])), soft_wrap=True)


def _show(net: Devnet, workers: int, console: Console) -> None:
    """The demo proper, on a devnet that is not started yet."""
    net.start(workers)
    client = JobClient(net.rpc_url, timeout=JOB_TIMEOUT, progress=True)
    parties = [client.address, *(w.address for w in net.workers)]
    before, books_before = _balances(client, parties), _books(net)
    console.print(f"chain at {net.rpc_url}; client {client.address}")
    console.print("worker dashboards, live while the demo runs: "
                  + ", ".join(w.api_url for w in net.workers))

    console.rule("1. one verified remote matmul (256 x 256, float32)")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 256)).astype(np.float32)
    b = rng.standard_normal((256, 256)).astype(np.float32)
    t0 = time.perf_counter()
    c = client.matmul(a, b)
    seconds = time.perf_counter() - t0
    error = float(np.abs(c - a.astype(np.float64) @ b).max())
    console.print(f"result {c.shape} in {seconds:.2f}s, max |C - A@B| = {error:.2e} "
                  "(verified by the chain's Freivalds check and by this client)")

    console.rule("2. training an MLP on digits: local, then with matmuls offloaded")
    local = train_digits(steps=20)
    console.print(f"local:     test accuracy {local.test_accuracy:.3f}")
    client.progress = False
    t0 = time.perf_counter()
    offloaded = train_digits(client, steps=20)
    console.print(f"offloaded: test accuracy {offloaded.test_accuracy:.3f} "
                  f"({offloaded.offloaded_matmuls} matmuls as network jobs, "
                  f"{offloaded.local_matmuls} small ones local, "
                  f"{time.perf_counter() - t0:.1f}s)")

    console.rule("3. what each party saw and earned")
    after, books = _balances(client, parties), _books(net)
    rows = [("client", client.address, "", "",
             f"{(after[client.address] - before[client.address]) / ETHER:+.6f}")]
    for w in net.workers:
        done, earned = (now - then for now, then in zip(books[w.address],
                                                        books_before[w.address], strict=True))
        rows.append((f"worker {w.index}", w.address, str(done), f"{earned / ETHER:.6f}",
                     f"{(after[w.address] - before[w.address]) / ETHER:+.6f}"))
    # the addresses under the table, each on a line of its own: in a column beside the
    # amounts, at 80 columns they squeezed them until numbers folded mid-digit
    print_table(console, ("party", "jobs verified", "fees earned (ETH)", "balance change (ETH)"),
                [(party, *amounts) for party, _, *amounts in rows], whole=("party",))
    console.print("worker balance change = fees + proof-of-useful-work block rewards - gas")
    for party, address, *_ in rows:
        console.print(f"{party + ':':10}{address}", highlight=False)
    client.close()
