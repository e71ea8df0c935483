"""Times every configuration of bench/sgemm_sweep.cu against cuBLAS in the same run.

    nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -shared -Xcompiler -fPIC -o /tmp/sweep.so
         bench/sgemm_sweep.cu                                      (one command, two lines)
    PYTHONPATH=$PWD python3 bench/sgemm_sweep.py /tmp/sweep.so [--sizes 1024 ...] [--tf32]

float32 (default): for each shape and configuration, needle GFLOP/s, cuBLAS GFLOP/s (TF32 off)
timed right after it, their ratio, and the relative error against cuBLAS's float32 product.
--tf32: the Hopper TF32 configurations against cuBLAS with TF32 on: GFLOP/s of the whole
product (B's transpose included) and of the wgmma kernel alone, cuBLAS, the ratio of the whole
product to cuBLAS, and the relative error against a float64 product. CUDA events, median of
rounds.
"""

import argparse
import ctypes
import functools

import torch
from matmul_cuda import time_ms  # bench/ is on sys.path when this runs as a script


def variant_runner(lib: ctypes.CDLL, v: int, a, b, c):
    """A call that runs float32 variant v for c = a @ b (contiguous float32 CUDA tensors)."""
    (m, k), n = a.shape, b.shape[1]
    pointers = [ctypes.c_void_p(t.data_ptr()) for t in (a, b, c)]

    def run() -> None:
        err = lib.sweep_run(v, *pointers, m, n, k)
        if err:
            raise RuntimeError(f"variant {v}: CUDA error {err}")

    return run


def tf32_runner(lib: ctypes.CDLL, v: int, a, b, c, bt, transposed: bool):
    """A call that runs TF32 variant v for c = a @ b, transposing b into bt unless `transposed`."""
    (m, k), n = a.shape, b.shape[1]
    pointers = [ctypes.c_void_p(t.data_ptr()) for t in (a, b, c, bt)]

    def run() -> None:
        err = lib.tf32_run(v, *pointers, m, n, k, int(transposed))
        if err:
            raise RuntimeError(f"tf32 variant {v}: error {err}")

    return run


def sweep_fp32(lib: ctypes.CDLL, shapes, variants) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
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


def sweep_tf32(lib: ctypes.CDLL, shapes, variants) -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    print(
        f"{'':3s} {'configuration':40s} {'whole':>8s} {'kernel':>8s} {'cuBLAS':>8s} "
        f"{'ratio':>6s} {'rel.err':>8s}  (GFLOP/s)"
    )
    for m, k, n in shapes:
        if k % 4 or n % 4:
            continue  # the Hopper kernel needs 16-byte rows
        a = torch.randn(m, k, device="cuda")
        b = torch.randn(k, n, device="cuda")
        c = torch.empty(m, n, device="cuda")
        bt = torch.empty(n, k, device="cuda")
        reference = a.double() @ b.double()
        flops = 2.0 * m * n * k
        reps = max(3, int(2e12 // flops))
        print(f"\n{m} x {k} x {n}")
        for v in variants:
            whole = tf32_runner(lib, v, a, b, c, bt, transposed=False)
            kernel = tf32_runner(lib, v, a, b, c, bt, transposed=True)
            c.fill_(float("nan"))
            whole()
            error = ((c.double() - reference).norm() / reference.norm()).item()
            t_whole = time_ms(whole, reps)
            t_kernel = time_ms(kernel, reps)
            t_cublas = time_ms(functools.partial(torch.matmul, a, b, out=c), reps)
            print(
                f"{v:3d} {lib.tf32_name(v).decode():40s} {flops / t_whole / 1e6:8.0f} "
                f"{flops / t_kernel / 1e6:8.0f} {flops / t_cublas / 1e6:8.0f} "
                f"{t_cublas / t_whole:6.3f} {error:8.1e}",
                flush=True,
            )
    torch.backends.cuda.matmul.allow_tf32 = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("library", help="the shared library built from bench/sgemm_sweep.cu")
    parser.add_argument("--sizes", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--variants", type=int, nargs="*", help="indices to run (default: all)")
    parser.add_argument("--tf32", action="store_true", help="sweep the Hopper TF32 kernels")
    args = parser.parse_args()
    lib = ctypes.CDLL(args.library)
    lib.sweep_name.restype = ctypes.c_char_p
    lib.tf32_name.restype = ctypes.c_char_p
    count = lib.tf32_count() if args.tf32 else lib.sweep_count()
    variants = args.variants or range(count)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    shapes = [(s, s, s) for s in args.sizes] + [
        (8192, 1024, 4096),
        (3000, 4100, 2996),
        (3001, 4097, 2999),
    ]
    (sweep_tf32 if args.tf32 else sweep_fp32)(lib, shapes, variants)


if __name__ == "__main__":
    main()
