"""Remote matmul on loopback: local matmul time vs remote job latency (submit to verified
result), operand transfer throughput against raw loopback sockets, the fixed overhead per
job stage by stage, and small jobs per second with batching. Starts its own devnet (chain
node + worker processes) in a temporary directory.

    .venv/bin/python bench/remote_matmul.py [--sizes 256 1024 2048] [--workers 2]
        [--parts latency overhead transaction small batched] [--timeline FILE]

--timeline FILE has every process (client, chain node, workers) log monotonic timestamps
along a job's path (chain/timeline.py) and prints the merged timeline of the last lone
8x8 job of the overhead part.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from chain import timeline
from chain.blobs import blob_id, encode_array
from node.client import JobClient
from node.devnet import Devnet


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def raw_loopback_bytes_per_s(total: int = 256 << 20) -> float:
    """TCP throughput between two threads of this process: the ceiling for blob transfer."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def drain():
        conn, _ = server.accept()
        buf, received = memoryview(bytearray(1 << 20)), 0
        while received < total:
            received += conn.recv_into(buf)
        conn.close()

    thread = threading.Thread(target=drain)
    thread.start()
    chunk = b"\0" * (1 << 20)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for _ in range(total >> 20):
            conn.sendall(chunk)
        thread.join()
    server.close()
    return total / (time.perf_counter() - t0)


PARTS = ["latency", "overhead", "transaction", "small", "batched"]


def print_timeline(path: str, roles: dict[int, str]) -> None:
    """The marks of the last job (from its last "job start" on), ms from that start."""
    marks = timeline.read(path)
    first = max(i for i, (_, _, label) in enumerate(marks) if label == "job start")
    t0 = previous = marks[first][0]
    print(f"  {'ms':>7} {'+ms':>6}  process  mark")
    for ns, pid, label in marks[first:]:
        print(f"  {(ns - t0) / 1e6:7.2f} {(ns - previous) / 1e6:6.2f}  "
              f"{roles.get(pid, str(pid)):<8} {label}")
        previous = ns


# A lone job's critical path: (step, process, mark prefix(es), the step it is measured
# from). "worker" is the worker that did the job; each step is the first such mark after its
# anchor. A transaction reaches the node by eth_sendRawTransaction or POST /wait.
SENT = ("rpc in eth_sendRawTransaction", "rpc in send_and_wait")
PATH_STEPS = [
    ("submit signed", "client", "client signed submitJobs", "start"),
    ("uploaded", "client", "job uploaded", "start"),
    ("submit at node", "node", SENT, "uploaded"),
    ("submit admitted", "node", "node admitted", "submit at node"),
    ("client has send reply", "client", "client sent submitJobs", "submit admitted"),
    ("submit seal starts", "node", "node gathered", "submit admitted"),
    ("submit sealed", "node", "node sealed", "submit seal starts"),
    ("worker sees job", "worker", "worker logs", "submit sealed"),
    ("operands fetched", "worker", "worker fetched", "worker sees job"),
    ("commit signed", "worker", "client signed commitJobs", "operands fetched"),
    ("C uploaded", "worker", "worker uploaded", "operands fetched"),
    ("commit at node", "node", SENT, "C uploaded"),
    ("commit admitted", "node", "node admitted", "commit at node"),
    ("commit seal starts", "node", "node gathered", "commit admitted"),
    ("commit sealed", "node", "node sealed", "commit seal starts"),
    ("client has commit", "client", "job committed", "commit sealed"),
    ("client checked C", "client", "job fetched and checked", "client has commit"),
    ("finalize seal starts", "node", "node gathered", "commit sealed"),
    ("finalize sealed", "node", "node sealed", "finalize seal starts"),
    ("client has verdict", "client", "job paid", "finalize sealed"),
]


def path_medians(path: str, roles: dict[int, str], since_ns: int, skip: int = 2) -> None:
    """Median and 90th percentile over the lone jobs started from `since_ns` on (the
    overhead part's: the latency part's larger jobs are in the file too; the first `skip`
    left out) of each step of PATH_STEPS, from its anchor, and the median time from the
    job's start."""
    marks = timeline.read(path)
    starts = [i for i, (ns, pid, label) in enumerate(marks)
              if label == "job start" and roles.get(pid) == "client" and ns >= since_ns][skip:]
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in PATH_STEPS}
    for n, first in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(marks)
        job = marks[first:end]
        doer = next((pid for _, pid, label in job if label.startswith("worker fetching")), None)
        at = {"start": job[0][0]}
        for name, role, prefix, anchor in PATH_STEPS:
            if anchor not in at:
                continue
            found = next((ns for ns, pid, label in job
                          if ns >= at[anchor] and label.startswith(prefix) and
                          (pid == doer if role == "worker" else roles.get(pid) == role)), None)
            if found is not None:
                at[name] = found
                rows[name].append(((found - at[anchor]) / 1e6, (found - at["start"]) / 1e6))
    print(f"\n== the job's path, over {len(starts)} lone jobs (ms; median and p90 of each step "
          "from its anchor, median time from the job's start)")
    print(f"  {'step':<22} {'from':<20} {'median':>7} {'p90':>7} {'at':>7}")
    for name, _, _, anchor in PATH_STEPS:
        if rows[name]:
            deltas, ats = np.array(rows[name]).T
            print(f"  {name:<22} {anchor:<20} {np.median(deltas):7.2f} "
                  f"{np.percentile(deltas, 90):7.2f} {np.median(ats):7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--small-jobs", type=int, default=100)
    parser.add_argument("--block-time", type=float, default=0.5)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS)
    parser.add_argument("--timeline", help="log and print a lone job's timeline (a file)")
    args = parser.parse_args()
    if args.timeline:
        os.environ["NEEDLE_NET_TIMELINE"] = args.timeline  # the devnet's processes too
        timeline.start(args.timeline)
    rng = np.random.default_rng(0)
    raw = raw_loopback_bytes_per_s()
    with tempfile.TemporaryDirectory() as tmp, Devnet(Path(tmp), block_time=args.block_time) as net:
        net.start(args.workers)
        client = JobClient(net.rpc_url, timeout=600)
        print(f"devnet: chain + {args.workers} workers on loopback, block time "
              f"{args.block_time}s; raw loopback TCP (reference) {raw / 1e9:.2f} GB/s")

        if "latency" in args.parts:
            latency(client, rng, args.sizes, raw)
        if "overhead" in args.parts:
            overhead_start = time.monotonic_ns()  # the timeline's clock
            overhead(client, rng, {"node": net.chain.pid, "client": os.getpid(),
                                   **{f"worker{w.index}": w.process.pid for w in net.workers}})
            if args.timeline:
                roles = {os.getpid(): "client", net.chain.pid: "node",
                         **{w.process.pid: f"worker{w.index}" for w in net.workers}}
                print("\n== timeline of the last job (every process's marks)")
                print_timeline(args.timeline, roles)
                path_medians(args.timeline, roles, overhead_start)
        if "transaction" in args.parts:
            transaction(client)
        if "small" in args.parts:
            small_jobs(client, rng, args.small_jobs)
        if "batched" in args.parts:
            batched(client, rng, args.small_jobs)
        client.close()


def latency(client: JobClient, rng, sizes: list[int], raw: float) -> None:
    market = client.market
    print("\n== latency: local numpy matmul vs remote job (submit -> verified result)")
    print(f"{'n':>6} {'local s':>9} {'remote s':>9} {'ratio':>8} {'upload GB/s':>12} "
          f"{'download GB/s':>14} {'vs raw TCP':>11}")
    for n in sizes:
        a = rng.standard_normal((n, n)).astype(np.float32)
        b = rng.standard_normal((n, n)).astype(np.float32)
        local = best_of(lambda a=a, b=b: a @ b, 3)
        remote = best_of(lambda a=a, b=b: client.matmul(a + np.float32(rng.random()), b), 2)
        # fresh bytes each time (the store skips blobs it has); hashing on both ends counts
        blobs = [encode_array(rng.standard_normal((n, n)).astype(np.float32))
                 for _ in range(3)]
        up = min(timed(market.blobs.put, data) for data in blobs)
        ids = [blob_id(data) for data in blobs]
        down = min(timed(market.blobs.get, id_) for id_ in ids)
        size = len(blobs[0])
        print(f"{n:>6} {local:>9.4f} {remote:>9.3f} {remote / local:>8.1f} "
              f"{size / up / 1e9:>12.3f} {size / down / 1e9:>14.3f} "
              f"{size / down / raw:>11.2f}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def overhead(client: JobClient, rng, pids: dict[str, int], jobs: int = 20) -> None:
    print(f"\n== fixed overhead per job, by stage (8x8 operands; mean of {jobs} jobs, ms)")
    stages = ("uploaded", "submitted", "committed", "verified", "paid")
    spans = []
    cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
    for _ in range(jobs):
        a = rng.standard_normal((8, 8)).astype(np.float32)
        [job] = client.submit([(a, a)])
        client.wait([job])
        times = [job.times["start"], *(job.times[s] for s in stages)]
        spans.append(np.diff(times) * 1000)
    mean = np.mean(spans, axis=0)
    # the client fetches and checks C as soon as it is committed, while the chain finalises
    labels = ("upload A, B", "submit tx (until its receipt)",
              "until claimed + committed", "until verified (C fetched meanwhile)",
              "rest of C's fetch + local check")
    for label, ms in zip(labels, mean, strict=True):
        print(f"  {label:<36} {ms:8.1f}")
    print(f"  {'total':<36} {mean.sum():8.1f}")
    used = {name: (cpu_seconds(pid) - cpu[name]) / jobs * 1000 for name, pid in pids.items()}
    print("  CPU time per job (ms; the work on the path, whatever the machine's load): " +
          ", ".join(f"{name} {ms:.1f}" for name, ms in used.items()) +
          f"; all {sum(used.values()):.1f}")


def transaction(client: JobClient) -> None:
    market = client.market
    print("\n== one lifecycle transaction, step by step (register, fixed gas; mean of 10, ms)")
    chain = market.client
    steps = []
    for _ in range(10):
        t0 = time.perf_counter()
        raw = chain.sign(market.contract.functions.register(), value=10**18, gas=200_000)
        t1 = time.perf_counter()
        tx_hash = chain.send_raw(raw)
        t2 = time.perf_counter()
        chain.wait_for_receipt(tx_hash)
        steps.append([t1 - t0, t2 - t1, time.perf_counter() - t2])
    mean = np.mean(steps, axis=0) * 1000
    for label, ms in zip(("build + sign", "send (admission)",
                          "until receipt (seal, long poll, fetch)"), mean, strict=True):
        print(f"  {label:<40} {ms:8.1f}")


def small_pairs(rng, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`count` pairs of random 32x32 float32 operands."""
    return [(rng.standard_normal((32, 32)).astype(np.float32),
             rng.standard_normal((32, 32)).astype(np.float32)) for _ in range(count)]


def small_jobs(client: JobClient, rng, count: int) -> None:
    print(f"\n== {count} small jobs (32x32) submitted in one transaction")
    pairs = small_pairs(rng, count)
    t0 = time.perf_counter()
    jobs = []
    for start in range(0, len(pairs), 256):
        batch = client.submit(pairs[start:start + 256])
        client.wait(batch)
        jobs += batch
    seconds = time.perf_counter() - t0
    print(f"{count / seconds:.1f} jobs/s ({seconds:.2f}s); first / median / "
          "last job to reach each stage, from the start (s):")
    for stage in ("uploaded", "submitted", "committed", "verified", "paid"):
        at = np.percentile([j.times[stage] - t0 for j in jobs], [0, 50, 100])
        print(f"  {stage:<10} {at[0]:6.3f} {at[1]:6.3f} {at[2]:6.3f}")


def batched(client: JobClient, rng, count: int) -> None:
    print(f"\n== {count} small products (32x32) as one batched job")
    pairs = small_pairs(rng, count)
    a3 = np.stack([p[0] for p in pairs])
    b3 = np.stack([p[1] for p in pairs])
    seconds = best_of(lambda: client.matmul(a3 + np.float32(rng.random()), b3), 2)
    local = best_of(lambda: np.matmul(a3, b3), 3)
    print(f"{count / seconds:.1f} products/s ({seconds:.3f}s; local "
          f"{local * 1000:.2f} ms, ratio {seconds / local:.0f})")


if __name__ == "__main__":
    main()
