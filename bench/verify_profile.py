"""Where the host's time goes in a repeat GPU verify() at one size: exact mode (int8 A, B,
int32 C) or a float class (float32 A, B, C = A @ B).

    python3 bench/verify_profile.py --n 4096
    python3 bench/verify_profile.py --n 4096 --precision fp32 --rounds 1

Prints verify() and the kernel module's check() best of --repeats (wall clock,
synchronised), the steps of a repeat call one by one (best of --repeats each,
perf_counter_ns), and cProfile's top functions over --repeats calls.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

try:
    import cupy
except ImportError:  # it profiles the GPU check, on CuPy arrays
    raise SystemExit("verify_profile.py profiles the GPU check and needs CuPy, which is not "
                     "installed") from None

from verifier import batch, gpu_exact, gpu_float, verify
from verifier.rng import Signs, as_seed, field_key

SEED = b"profile" * 5


def best_ns(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        cupy.cuda.get_current_stream().synchronize()
        start = time.perf_counter_ns()
        fn()
        cupy.cuda.get_current_stream().synchronize()
        best = min(best, time.perf_counter_ns() - start)
    return best / 1e3


def exact_steps(n: int) -> tuple[dict, object]:
    rng = np.random.default_rng(n)
    A = cupy.asarray(rng.integers(-128, 128, (n, n), dtype=np.int8))
    B = cupy.asarray(rng.integers(-128, 128, (n, n), dtype=np.int8))
    C = (A.astype(cupy.float64) @ B.astype(cupy.float64)).astype(cupy.int32)
    assert verify(A, B, C, precision="exact", seed=SEED).passed
    plan = batch._DEVICE_EXACT[batch._device_key(A, B, C, None)].plan
    stream, key = cupy.cuda.get_current_stream(), field_key(SEED, n, 1)
    return {
        "verify()": lambda: verify(A, B, C, precision="exact", seed=SEED),
        "gpu_exact.check()": lambda: gpu_exact.check(plan, A, B, C, SEED),
        "  _device_key + lookup": lambda: batch._DEVICE_EXACT.get(
            batch._device_key(A, B, C, None)),
        "  as_seed": lambda: as_seed(SEED),
        "  field_key": lambda: field_key(SEED, n, 1),
        "  launch (enqueue only)": lambda: gpu_exact.launch(plan, A, B, C, key),
        "  launch + synchronize": lambda: (gpu_exact.launch(plan, A, B, C, key),
                                           stream.synchronize()),
        "  verdict.tolist()": lambda: plan.ws.host_verdict.tolist(),
    }, plan


def float_steps(n: int, precision: str, rounds: int) -> tuple[dict, object]:
    rng = np.random.default_rng(n)
    A = cupy.asarray(rng.standard_normal((n, n), dtype=np.float32))
    B = cupy.asarray(rng.standard_normal((n, n), dtype=np.float32))
    C = A @ B
    assert verify(A, B, C, precision=precision, rounds=rounds, seed=SEED).passed
    plan = batch._DEVICE_FLOAT[batch._device_key(A, B, C, rounds, precision)].plan
    stream, bits = cupy.cuda.get_current_stream(), Signs(SEED, n, rounds).bits
    return {
        "verify()": lambda: verify(A, B, C, precision=precision, rounds=rounds, seed=SEED),
        "gpu_float.check()": lambda: gpu_float.check(plan, A, B, C, bits),
        "  _device_key + lookup": lambda: batch._DEVICE_FLOAT.get(
            batch._device_key(A, B, C, rounds, precision)),
        "  as_seed": lambda: as_seed(SEED),
        "  Signs(...).bits": lambda: Signs(SEED, n, rounds).bits,
        "  launch (enqueue only)": lambda: gpu_float.launch(plan, A, B, C, bits),
        "  launch + synchronize": lambda: (gpu_float.launch(plan, A, B, C, bits),
                                           stream.synchronize()),
        "  verdict.tolist()": lambda: plan.ws.out.tolist(),
    }, plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--precision", choices=batch.PRECISIONS, default="exact")
    parser.add_argument("--rounds", type=int, default=1, help="float classes only")
    args = parser.parse_args()
    if args.precision == "exact":
        steps, plan = exact_steps(args.n)
    else:
        steps, plan = float_steps(args.n, args.precision, args.rounds)
    print(f"n = {args.n}, {args.precision}, grid {plan.grid} x {plan.threads} threads; best of "
          f"{args.repeats}, us")
    for name, fn in steps.items():
        print(f"{name:28} {best_ns(fn, args.repeats):9.1f}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.repeats):
        steps["verify()"]()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
