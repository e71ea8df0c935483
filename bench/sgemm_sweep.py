"""Times every configuration of bench/sgemm_sweep.cu against cuBLAS in the same run.

    nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -shared -Xcompiler -fPIC -o /tmp/sweep.so
         bench/sgemm_sweep.cu                                      (one command, two lines)
    PYTHONPATH=$PWD python3 bench/sgemm_sweep.py /tmp/sweep.so [--sizes 1024 ...] [--tf32]

float32 (default): for each shape and configuration, needle GFLOP/s, cuBLAS GFLOP/s (TF32 off)
timed right after it, their ratio, and the relative error against cuBLAS's float32 product.
--tf32: the Hopper TF32 configurations against cuBLAS with TF32 on: TFLOP/s of the whole
product (B's transpose included), of the same with A copied to padded rows, of the wgmma kernel
alone, and of cuBLAS; the ratio of the whole product to cuBLAS, and the relative error against
a float64 product. CUDA events, median of
rounds.
"""

import argparse
import ctypes
import functools

try:
    import torch
except ImportError:  # cuBLAS, the reference, is called through PyTorch
    raise SystemExit("sgemm_sweep.py compares with cuBLAS through PyTorch, which is not "
                     "installed: pip install torch") from None
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


def tf32_runner(lib: ctypes.CDLL, v: int, a, b, c, scratch, pad_a: bool, prepared: bool):
    """A call that runs TF32 variant v for c = a @ b; `scratch` = (bt, padded) receive B^T and,
    with `pad_a`, A's padded copy, unless `prepared`."""
    (m, k), n = a.shape, b.shape[1]
    pointers = [ctypes.c_void_p(t.data_ptr()) for t in (a, b, c, *scratch)]

    def run() -> None:
        err = lib.tf32_run(v, *pointers, m, n, k, int(pad_a), int(prepared))
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
    """Each variant as `matmul_tf32` runs it (A padded only where K % 4 != 0), the same with A
    always padded to 128-byte rows, and the product alone."""
    torch.backends.cuda.matmul.allow_tf32 = True
    print(
        f"{'':3s} {'configuration':38s} {'whole':>7s} {'pad A':>7s} {'kernel':>7s} "
        f"{'cuBLAS':>7s} {'ratio':>6s} {'rel.err':>8s}  (TFLOP/s; ratio: whole / cuBLAS)"
    )
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda")
        b = torch.randn(k, n, device="cuda")
        c = torch.empty(m, n, device="cuda")
        ld = (k + 31) // 32 * 32
        scratch = (torch.empty(n, ld, device="cuda"), torch.empty(m, ld, device="cuda"))
        reference = a.double() @ b.double()
        flops = 2.0 * m * n * k
        reps = max(3, int(2e12 // flops))
        print(f"\n{m} x {k} x {n}")
        for v in variants:
            needs_pad = k % 4 != 0
            whole = tf32_runner(lib, v, a, b, c, scratch, needs_pad, prepared=False)
            c.fill_(float("nan"))
            whole()
            error = ((c.double() - reference).norm() / reference.norm()).item()
            t_whole = time_ms(whole, reps)
            t_padded = time_ms(tf32_runner(lib, v, a, b, c, scratch, True, prepared=False), reps)
            t_kernel = time_ms(tf32_runner(lib, v, a, b, c, scratch, needs_pad, True), reps)
            t_cublas = time_ms(functools.partial(torch.matmul, a, b, out=c), reps)
            rates = " ".join(
                f"{flops / t / 1e9:7.1f}" for t in (t_whole, t_padded, t_kernel, t_cublas)
            )
            print(
                f"{v:3d} {lib.tf32_name(v).decode():38s} {rates} {t_cublas / t_whole:6.3f} "
                f"{error:8.1e}",
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
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU")
    try:
        lib = ctypes.CDLL(args.library)
    except OSError as err:
        raise SystemExit(f"{err} (build it from bench/sgemm_sweep.cu: the command is at the "
                         "top of bench/sgemm_sweep.py)") from None
    lib.sweep_name.restype = ctypes.c_char_p
    lib.tf32_name.restype = ctypes.c_char_p
    count = lib.tf32_count() if args.tf32 else lib.sweep_count()
    variants = args.variants or range(count)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    shapes = [(s, s, s) for s in args.sizes] + [
        (8192, 1024, 4096),
        (3000, 4100, 2996),
        (3000, 4096, 2996),
        (3001, 4097, 2999),
    ]
    (sweep_tf32 if args.tf32 else sweep_fp32)(lib, shapes, variants)


if __name__ == "__main__":
    main()
