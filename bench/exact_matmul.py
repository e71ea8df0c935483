"""A worker's exact (integer) product against numpy's integer matmul and against the float32
product of the same size, measured in the same run.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/exact_matmul.py --clock cpu
    .venv/bin/python bench/exact_matmul.py --sizes 1024 4096 --int-matmul-limit 1024
    python3 bench/exact_matmul.py --cuda --sizes 1024 4096 8192   # needle's cuda backend

`node.compute.exact_matmul` runs integer jobs through float BLAS in exact pieces (int8
operands: float32 sgemm over inner slices of 1024; int16: one float64 product; larger
entries: limbs). numpy's int64 matmul, which workers used before, has no BLAS path; it is
timed up to --int-matmul-limit, as it takes minutes beyond. With --cuda the float32 slices
run on needle's cuda device and the reference is a float32 job as a worker runs it there
(`node.compute.matmul`, host to device and back included). Every exact result is compared
with numpy's where that runs, and the 4096 int8 case with a float64 product (exact there).
"""
from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from node import compute

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def best_time(fn, operands: tuple, repeats: int, clock) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = clock()
        out = fn(*operands)
        best = min(best, clock() - start)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["int8", "int16", "int32"],
                        choices=["int8", "int16", "int32"])
    parser.add_argument("--int-matmul-limit", type=int, default=1024,
                        help="largest n for which numpy's int64 matmul is timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--cuda", action="store_true", help="run on needle's cuda device")
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    device = None
    if args.cuda:
        import needle as ndl

        device = ndl.cuda()
        if not device.enabled():
            raise SystemExit("--cuda: needle's cuda backend is not built or no GPU is present")

    def sgemm(x, y):
        return compute.matmul(x, y, device)

    def exact_matmul(x, y):
        return compute.exact_matmul(x, y, device)

    print(f"{platform.machine()} numpy {np.__version__}; {'cuda' if device else 'host BLAS'}; "
          f"clock {args.clock}, best of {args.repeats}")
    print(f"{'n':>6}  {'dtype':6} {'exact_matmul s':>14} {'sgemm s':>9} {'/ sgemm':>8} "
          f"{'int64 matmul s':>15} {'speed-up':>9}")
    rng = np.random.default_rng(0)
    for n in args.sizes:
        af = rng.standard_normal((n, n), dtype=np.float32)
        bf = rng.standard_normal((n, n), dtype=np.float32)
        reference, _ = best_time(sgemm, (af, bf), args.repeats, clock)
        for name in args.dtypes:
            info = np.iinfo(name)
            a = rng.integers(info.min, info.max, (n, n), endpoint=True).astype(name)
            b = rng.integers(info.min, info.max, (n, n), endpoint=True).astype(name)
            exact, c = best_time(exact_matmul, (a, b), args.repeats, clock)
            integer = speedup = "-"
            if n <= args.int_matmul_limit:
                seconds, ref = best_time(np.matmul, (a.astype(np.int64), b.astype(np.int64)),
                                         1, clock)
                if not np.array_equal(c, ref):
                    raise SystemExit(f"n={n} {name}: exact_matmul differs from numpy")
                integer, speedup = f"{seconds:.3f}", f"{seconds / exact:.0f}x"
            elif name == "int8" and not np.array_equal(
                    c, (a.astype(np.float64) @ b.astype(np.float64)).astype(np.int64)):
                raise SystemExit(f"n={n} int8: exact_matmul differs from float64's product")
            print(f"{n:>6}  {name:6} {exact:>14.3f} {reference:>9.3f} {exact / reference:>7.2f}x "
                  f"{integer:>15} {speedup:>9}")


if __name__ == "__main__":
    main()
