"""needle's CUDA matmul against cuBLAS (through PyTorch) in the same run, float32 and TF32.

    PYTHONPATH=$PWD python3 bench/matmul_cuda.py [--sizes 1024 2048 4096 8192] [--paths fp32 tf32]

Prints GFLOP/s of each and the ratio needle / cuBLAS; cuBLAS float32 runs with TF32 off, the
TF32 rows compare needle's explicit `matmul_tf32` with cuBLAS with TF32 on.
"""

import argparse
import statistics

import numpy as np

try:
    import torch
except ImportError:  # cuBLAS, the reference, is called through PyTorch
    raise SystemExit("matmul_cuda.py compares with cuBLAS through PyTorch, which is not "
                     "installed: pip install torch") from None

from needle.backend_ndarray import ndarray_backend_cuda as cuda


def time_ms(fn, reps: int, rounds: int = 7) -> float:
    """Median over rounds of the mean time of `reps` back-to-back calls, by CUDA events.

    needle's kernels run on the legacy default stream, which torch's events also use."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / reps)
    return statistics.median(samples)


def bench_shape(
    m: int, n: int, p: int, rng: np.random.Generator, paths: tuple[str, ...]
) -> list[tuple]:
    a = rng.standard_normal((m, n), dtype=np.float32)
    b = rng.standard_normal((n, p), dtype=np.float32)
    da, db, dout = cuda.Array(m * n), cuda.Array(n * p), cuda.Array(m * p)
    cuda.from_numpy(a, da)
    cuda.from_numpy(b, db)
    ta, tb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
    reference = (ta.double() @ tb.double()).cpu().numpy()
    flops = 2.0 * m * n * p
    reps = max(3, int(1e12 // flops))

    rows = []
    for label, needle_fn, tf32 in (("fp32", cuda.matmul, False), ("tf32", cuda.matmul_tf32, True)):
        if label not in paths:
            continue
        torch.backends.cuda.matmul.allow_tf32 = tf32
        cuda.fill(dout, float("nan"))
        needle_fn(da, db, dout, m, n, p)
        got = cuda.to_numpy(dout, (m, p), (p, 1), 0)
        error = np.linalg.norm(got - reference) / np.linalg.norm(reference)
        t_needle = time_ms(lambda f=needle_fn: f(da, db, dout, m, n, p), reps)
        t_cublas = time_ms(lambda: torch.matmul(ta, tb), reps)
        rows.append(
            (
                f"{m}x{n}x{p}",
                label,
                flops / t_needle / 1e6,
                flops / t_cublas / 1e6,
                t_cublas / t_needle,
                error,
            )
        )
    torch.backends.cuda.matmul.allow_tf32 = False
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--no-extra-shapes", action="store_true", help="skip the non-square shapes")
    parser.add_argument("--paths", nargs="*", choices=["fp32", "tf32"], default=["fp32", "tf32"])
    args = parser.parse_args()
    if cuda.device_count() == 0:
        raise SystemExit("no CUDA GPU")

    shapes = [(s, s, s) for s in args.sizes]
    if not args.no_extra_shapes:
        shapes += [(8192, 1024, 4096), (3001, 4097, 2999)]
    rng = np.random.default_rng(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(
        f"{'m x n x p':>18} {'path':>5} {'needle GFLOP/s':>15} {'cuBLAS GFLOP/s':>15} "
        f"{'ratio':>6} {'rel.err':>9}"
    )
    for m, n, p in shapes:
        for shape, label, g_needle, g_cublas, ratio, error in bench_shape(
            m, n, p, rng, tuple(args.paths)
        ):
            print(
                f"{shape:>18} {label:>5} {g_needle:15.0f} {g_cublas:15.0f} {ratio:6.2f} "
                f"{error:9.1e}"
            )


if __name__ == "__main__":
    main()
