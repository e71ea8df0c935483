"""Data-parallel training throughput of ResNet9 on 32x32 inputs: 1 rank against 2.

    python bench/parallel.py                      # CPU: 1 vs 2 processes
    python bench/parallel.py --device cuda        # 1 vs 2 GPUs (NCCL through CuPy if present)
    python bench/parallel.py --repeats 5          # median and range of 5 rounds

Each rank count is started once with the MPI launcher next to this python
(`mpiexec -n R python bench/parallel.py --worker ...`); every rank trains on
its own batch of `--batch` synthetic images (weak scaling: 2 ranks process
twice the images per step), and rank 0 reports images per second over the
timed steps. Inside that launch each round builds a fresh model for each
setting and times it: the allreduce overlapped with backward and not
(`DataParallel(overlap=False)`), in alternating order from round to round.
A ratio is against the 1-rank run of the same setting and round of the same
invocation. On CPU each rank gets
`--threads` OpenMP threads; 1 rank with all threads is reported too, since
that is what a single process can already use.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

RESULT_TAG = "RESULT "


def worker(opts: argparse.Namespace) -> None:
    """One rank: per round and overlap setting, time `opts.steps` SGD steps after `opts.warmup`."""
    if opts.device == "cuda":
        from needle.parallel.comm import select_gpu_for_rank

        select_gpu_for_rank()  # before needle starts CUDA
    import numpy as np

    import needle as ndl
    from needle import nn
    from needle.models import ResNet9
    from needle.parallel import Communicator, DataParallel, NcclCommunicator, nccl_available

    device = ndl.cuda() if opts.device == "cuda" else ndl.cpu()
    if not device.enabled():
        raise SystemExit(f"device {opts.device} is not available here")
    host = Communicator()
    use_nccl = opts.device == "cuda" and nccl_available()
    comm = NcclCommunicator(host) if use_nccl else host
    loss_fn = nn.SoftmaxLoss()
    rng = np.random.default_rng(host.rank)
    x = ndl.Tensor(rng.standard_normal((opts.batch, 3, 32, 32), np.float32), device=device)
    y = ndl.Tensor(rng.integers(0, 10, opts.batch).astype(np.float32), device=device)

    def measure(overlap: str) -> float:
        np.random.seed(0)
        model = DataParallel(
            ResNet9(device=device), comm, bucket_mb=opts.bucket_mb,
            check_finite=not opts.skip_finite_check, overlap=overlap == "on",
        )
        opt = ndl.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step() -> float:
            opt.reset_grad()
            loss = loss_fn(model(x), y)
            model.backward(loss)
            opt.step()
            return loss.numpy().item()  # waits for the device, as a training loop that logs would

        for _ in range(opts.warmup):
            step()
        gc.collect()  # earlier rounds' models are garbage (hooks make cycles): not in the timing
        host.barrier()
        start = time.perf_counter()
        for _ in range(opts.steps):
            step()
        host.barrier()
        return time.perf_counter() - start

    overlaps = opts.overlaps.split(",")
    for round_ in range(opts.repeats):
        for overlap in overlaps if round_ % 2 == 0 else overlaps[::-1]:
            elapsed = measure(overlap)
            if host.rank == 0:
                result = {
                    "round": round_,
                    "ranks": host.size,
                    "threads": int(os.environ.get("OMP_NUM_THREADS", "0")),
                    "allreduce": "nccl" if use_nccl else "mpi",
                    "overlap": overlap,
                    "images_per_s": opts.steps * opts.batch * host.size / elapsed,
                }
                print(RESULT_TAG + json.dumps(result), flush=True)


def run(ranks: int, threads: int, overlaps: str, opts: argparse.Namespace) -> list[dict]:
    """Launch `ranks` processes that time every round; rank 0's results, one per measurement."""
    from needle.parallel import launch_command, launch_env

    args = ["--worker", "--device", opts.device, "--batch", str(opts.batch)]
    args += ["--steps", str(opts.steps), "--warmup", str(opts.warmup)]
    args += ["--bucket-mb", str(opts.bucket_mb), "--repeats", str(opts.repeats)]
    args += ["--overlaps", overlaps]
    args += ["--skip-finite-check"] if opts.skip_finite_check else []
    env = launch_env(dict(os.environ, OMP_NUM_THREADS=str(threads)))
    proc = subprocess.run(
        launch_command(ranks, os.path.abspath(__file__), args),
        env=env, capture_output=True, text=True, timeout=opts.timeout,
    )
    results = [
        json.loads(line[len(RESULT_TAG):])
        for line in proc.stdout.splitlines()
        if line.startswith(RESULT_TAG)
    ]
    if proc.returncode != 0 or not results:
        output = proc.stdout + proc.stderr
        raise SystemExit(f"{ranks}-rank run failed ({proc.returncode}):\n{output}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batch", type=int, default=None, help="images per rank per step")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per CPU rank")
    parser.add_argument("--bucket-mb", type=float, default=4.0, help="DataParallel(bucket_mb=)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every setting")
    parser.add_argument(
        "--skip-finite-check", action="store_true", help="DataParallel(check_finite=False)"
    )
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--overlaps", default="off,on", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    gpu = opts.device == "cuda"
    opts.batch = opts.batch or (128 if gpu else 16)
    opts.steps = opts.steps or (30 if gpu else 10)
    if opts.worker:
        worker(opts)
        return
    launches = [(1, opts.threads, "off,on"), (2, opts.threads, "off,on")]
    if not gpu:
        launches.append((1, 2 * opts.threads, "on"))  # one process using every core of 2 ranks
    results = [r for launch in launches for r in run(*launch, opts)]
    base = {
        (r["round"], r["overlap"]): r["images_per_s"]
        for r in results
        if (r["ranks"], r["threads"]) == (1, opts.threads)
    }
    check = "off" if opts.skip_finite_check else "on"
    print(
        f"ResNet9, 32x32, {opts.device}, batch {opts.batch}/rank, {opts.steps} timed steps, "
        f"bucket {opts.bucket_mb} MB, finite check {check}, {opts.repeats} rounds, "
        f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs"
    )
    print(
        f"{'ranks':>5} {'threads/rank':>12} {'allreduce':>9} {'overlap':>7} "
        f"{'images/s median (range)':>24} {'vs 1 rank median (range)':>26}"
    )
    settings = dict.fromkeys((r["ranks"], r["threads"], r["overlap"]) for r in results)
    for ranks, threads, overlap in settings:
        rows = [
            r for r in results
            if (r["ranks"], r["threads"], r["overlap"]) == (ranks, threads, overlap)
        ]
        speeds = [r["images_per_s"] for r in rows]
        ratios = [r["images_per_s"] / base[r["round"], r["overlap"]] for r in rows]
        print(
            f"{ranks:>5} {threads if not gpu else '-':>12} {rows[0]['allreduce']:>9} "
            f"{overlap:>7} {_spread(speeds, '.1f'):>24} "
            f"{_spread(ratios, '.2f'):>26}"
        )


def _spread(values: list[float], fmt: str) -> str:
    """Median (min-max) of a list."""
    median = statistics.median(values)
    return f"{median:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


if __name__ == "__main__":
    sys.exit(main())
