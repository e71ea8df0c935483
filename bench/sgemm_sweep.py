"""Times every tile configuration of bench/sgemm_sweep.cu against cuBLAS (TF32 off), same run.

    nvcc -O3 -arch=sm_90 -shared -Xcompiler -fPIC bench/sgemm_sweep.cu -o /tmp/sweep.so
    PYTHONPATH=$PWD python3 bench/sgemm_sweep.py /tmp/sweep.so [--sizes 1024 2048 4096 8192]

For each shape and configuration: needle GFLOP/s, cuBLAS GFLOP/s timed right after it, their
ratio, and the relative error against cuBLAS's float32 product (CUDA events, median of rounds).
"""

import argparse
import ctypes
import functools

import torch
from matmul_cuda import time_ms  # bench/ is on sys.path when this runs as a script


def variant_runner(lib: ctypes.CDLL, v: int, a, b, c):
    """A call that runs variant v for c = a @ b (contiguous float32 CUDA tensors)."""
    (m, k), n = a.shape, b.shape[1]
    pointers = [ctypes.c_void_p(t.data_ptr()) for t in (a, b, c)]

    def run() -> None:
        err = lib.sweep_run(v, *pointers, m, n, k)
        if err:
            raise RuntimeError(f"variant {v}: CUDA error {err}")

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("library", help="the shared library built from bench/sgemm_sweep.cu")
    parser.add_argument("--sizes", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--variants", type=int, nargs="*", help="indices to run (default: all)")
    args = parser.parse_args()
    lib = ctypes.CDLL(args.library)
    lib.sweep_name.restype = ctypes.c_char_p
    variants = args.variants or range(lib.sweep_count())
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    shapes = [(s, s, s) for s in args.sizes] + [
        (8192, 1024, 4096),
        (3000, 4100, 2996),
        (3001, 4097, 2999),
    ]
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda")
        b = torch.randn(k, n, device="cuda")
        c = torch.empty(m, n, device="cuda")
        reference = a @ b
        flops = 2.0 * m * n * k
        reps = max(3, int(4e11 // flops))
        print(f"\n{m} x {k} x {n}")
        for v in variants:
            run = variant_runner(lib, v, a, b, c)
            c.fill_(float("nan"))
            run()
            error = ((c - reference).norm() / reference.norm()).item()
            t_needle = time_ms(run, reps)
            t_cublas = time_ms(functools.partial(torch.matmul, a, b, out=c), reps)
            print(
                f"{v:3d} {lib.sweep_name(v).decode():58s} {flops / t_needle / 1e6:8.0f} "
                f"{flops / t_cublas / 1e6:8.0f} {t_cublas / t_needle:6.3f} {error:8.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
