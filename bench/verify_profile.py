"""Where the host's time goes in a GPU exact verify() at one size (int8 A, B, int32 C).

    python3 bench/verify_profile.py --n 4096

Prints verify() and gpu_exact.check() best of --repeats (wall clock, synchronised), the
steps of a repeat call one by one (best of --repeats each, perf_counter_ns), and cProfile's
top functions over --repeats calls.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import cupy
import numpy as np

from verifier import batch, gpu_exact, verify
from verifier.rng import as_seed, field_key

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    n, repeats = args.n, args.repeats
    rng = np.random.default_rng(n)
    A = cupy.asarray(rng.integers(-128, 128, (n, n), dtype=np.int8))
    B = cupy.asarray(rng.integers(-128, 128, (n, n), dtype=np.int8))
    C = (A.astype(cupy.float64) @ B.astype(cupy.float64)).astype(cupy.int32)
    assert verify(A, B, C, precision="exact", seed=SEED).passed
    known = batch._DEVICE_EXACT[batch._device_key(A, B, C, None)]
    plan, stream = known.plan, cupy.cuda.get_current_stream()
    key = field_key(SEED, n, 1)
    steps = {
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
    }
    print(f"n = {n}, grid {plan.grid} x {plan.threads} threads; best of {repeats}, us")
    for name, fn in steps.items():
        print(f"{name:28} {best_ns(fn, repeats):9.1f}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(repeats):
        verify(A, B, C, precision="exact", seed=SEED)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
