"""CPU matmul throughput: needle's C++ backend against numpy (OpenBLAS), measured in one run.

    .venv/bin/python bench/matmul_cpu.py [--sizes 256 512 1024 2048] [--repeats 7]

Each repeat times the three contenders back to back (backend module called directly on
`Array`s, `ndl.NDArray @ ndl.NDArray`, numpy's `@`) for about --min-time seconds each, pausing
between them so that the idle-spinning worker threads of one library (OpenBLAS, OpenMP) do
not steal a core from the next. Prints best and median GFLOP/s and needle/numpy ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import needle as ndl
from needle.backend_ndarray import ndarray_backend_cpu as backend

SPIN_DOWN_SECONDS = 0.3


def gflops(fn, flops: float, min_time: float) -> float:
    """GFLOP/s of fn, calling it enough times to run for at least min_time seconds."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            return flops * calls / elapsed / 1e9


def check(result: np.ndarray, x: np.ndarray, y: np.ndarray, what: str) -> None:
    """Fails loudly if result is not x @ y within float32 accumulation error."""
    exact = x.astype(np.float64) @ y.astype(np.float64)
    bound = x.shape[1] * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(y)).astype(np.float64)
    worst = float(np.max(np.abs(result - exact) - bound))
    if worst > 0:
        raise AssertionError(f"{what}: result exceeds the float32 error bound by {worst:g}")


def bench_size(n: int, repeats: int, min_time: float, rng: np.random.Generator) -> dict:
    x = rng.standard_normal((n, n), dtype=np.float32)
    y = rng.standard_normal((n, n), dtype=np.float32)
    a, b, out = backend.Array(n * n), backend.Array(n * n), backend.Array(n * n)
    backend.from_numpy(x, a)
    backend.from_numpy(y, b)
    xa, ya = ndl.NDArray(x, device=ndl.cpu()), ndl.NDArray(y, device=ndl.cpu())

    backend.matmul(a, b, out, n, n, n)
    check(backend.to_numpy(out, (n, n), (n, 1), 0), x, y, f"module n={n}")
    check((xa @ ya).numpy(), x, y, f"NDArray n={n}")

    contenders = {
        "module": lambda: backend.matmul(a, b, out, n, n, n),
        "ndarray": lambda: xa @ ya,
        "numpy": lambda: x @ y,
    }
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            time.sleep(SPIN_DOWN_SECONDS)
            rates[name].append(gflops(fn, 2.0 * n**3, min_time))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    args = parser.parse_args()

    print(
        f"nproc={os.cpu_count()} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')} "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '-')} "
        f"load average {os.getloadavg()[0]:.1f}, numpy {np.__version__}, "
        f"repeats={args.repeats}, min_time={args.min_time}s"
    )
    header = f"{'n':>5} | {'needle module':>15} | {'needle NDArray':>15} | {'numpy':>15} |"
    print(header + " module/numpy  ndarray/numpy   (GFLOP/s best / median)")
    rng = np.random.default_rng(0)
    for n in args.sizes:
        rates = bench_size(n, args.repeats, args.min_time, rng)
        best = {name: max(r) for name, r in rates.items()}
        median = {name: statistics.median(r) for name, r in rates.items()}
        cells = " | ".join(f"{best[k]:6.1f} / {median[k]:6.1f}" for k in rates)
        ratios = "  ".join(
            f"{best[k] / best['numpy']:.2f} / {median[k] / median['numpy']:.2f}"
            for k in ("module", "ndarray")
        )
        print(f"{n:>5} | {cells} | {ratios}", flush=True)


if __name__ == "__main__":
    main()
