"""Cost of a Freivalds check against the matmul it checks, measured in the same run.

    python bench/verify.py                       # CPU (numpy), n = 512 .. 4096
    OPENBLAS_NUM_THREADS=1 python bench/verify.py --clock cpu   # on a shared, loaded machine
    python bench/verify.py --gpu --sizes 1024 2048 4096 8192   # CuPy / cuBLAS
    python bench/verify.py --tables              # false-accept rates and bound tightness

Exact mode runs with 1 round (false accept <= 1/p < 2^-60 <= 2^-40); float mode with the
default 16 rounds and with 8, 4, 2 and 1 (false accept 2^-rounds for errors above twice the
bound); for 16 and 1 also the three passes over the matrices alone on the host, which shows
how much of a check is the fixed per-call work (vectors, O(n) bound arithmetic, verdict),
and on a GPU the check's one launch (CUDA events, alone and back to back), the host's time
to derive the bits and enqueue it, and gpu_float.check() alone. The reference
is the float32 product (numpy sgemm / cuBLAS); for exact mode numpy's integer matmul is
also timed where it finishes in reasonable time. On the host the exact check runs in
verifier.exact_host (built from csrc/) and, for comparison, in numpy alone; on a GPU its
host side runs in verifier.gpu_launch (built from csrc/) and, for comparison, in Python.
The "read floor" row is one matrix-vector product over each of A, B and C: the memory
traffic that any check reading every operand once must pay. On a GPU the exact check is
also timed until verify() returns its verdict (the device synchronised after, untimed: the
row above includes the kernel's exit after its last write), and split into its one launch
(CUDA events, alone and back to back), the host's time to enqueue it (wall clock) and
gpu_exact.check() alone; verify() less check() is the Python around it. Calls under a
millisecond are timed best of at least 400 (best of 50 moved a 55 us check by 3-6 us between
rows of one run), the GPU's reference too; the last column is the ratio of the medians.

--clock cpu measures the process's CPU seconds (all threads) instead of wall time: on a
machine shared with other work, wall time mostly measures the scheduler.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from verifier import DEFAULT_ROUNDS, batch, exact, gpu_exact, verify
from verifier.arrays import products
from verifier.floating import residual_and_bound
from verifier.rng import sign_vectors

SEED = b"bench" * 7
FLOAT_ROUNDS = (DEFAULT_ROUNDS["fp32"], 8, 4, 2, 1)  # false accept 2^-rounds each


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


SHORT_CALL, SHORT_REPEATS = 1e-3, 400  # calls under a millisecond: best of at least 400
BACK_TO_BACK = 50  # GPU launches timed together


class Timing(float):
    """A best time that carries its samples' median: the best is a call's floor, the median
    what a caller usually waits."""

    def __new__(cls, samples: list[float]) -> Timing:
        timing = super().__new__(cls, min(samples))
        timing.median = float(np.median(samples))
        return timing


def best_time(fn, repeats: int, sync=lambda: None, until_return: bool = False) -> Timing:
    """Best of repeats calls, or of SHORT_REPEATS where a call takes under SHORT_CALL (the
    host's jitter is then a large part of one call), each from a synchronised device to the
    next synchronisation; with until_return, until fn returns (the synchronisation after it
    untimed: for verify(), which returns once the kernel has written the verdict, the wait
    for its verdict without the kernel's exit after that). One untimed call first: a first
    call may build a plan or compile a kernel, and would end the count at `repeats` calls
    by taking over SHORT_CALL."""
    fn()
    sync()
    samples = []
    while len(samples) < repeats or (min(samples) < SHORT_CALL and len(samples) < SHORT_REPEATS):
        sync()
        start = clock()
        fn()
        returned = clock()
        sync()
        samples.append((returned if until_return else clock()) - start)
    return Timing(samples)


def three_passes(xp, A, B, C, R) -> None:
    """The float check's reads of B, C and A (products with R and the absolute-value sums)
    without the vector derivation, the bound's O(n) arithmetic and the verdict."""
    ones = xp.ones(B.shape[1], np.float32)
    X, _ = products(xp, B, R, ones, np.float32)
    products(xp, C, R, ones, np.float32)
    products(xp, A, X, xp.ones(A.shape[1], np.float32), np.float32)


def timing_rows(n: int, xp, sync, int_matmul_limit: int,
                repeats: int) -> list[tuple[str, float, float]]:
    """(what, seconds, reference seconds) for one size."""
    rng = np.random.default_rng(n)
    A = xp.asarray(rng.standard_normal((n, n), dtype=np.float32))
    B = xp.asarray(rng.standard_normal((n, n), dtype=np.float32))
    C = A @ B
    # on a GPU the reference gets as many calls as the short checks it is compared with (best
    # of three varied by 5% between runs on one H100: 2.69-2.85 ms at n = 4096)
    sgemm = best_time(lambda: A @ B, max(2, repeats // 2) if xp is np else SHORT_REPEATS, sync)
    rows = [("float32 matmul (reference)", sgemm, sgemm)]
    ones = xp.ones(n, np.float32)
    floor = sum(best_time(lambda M=M: M @ ones, repeats, sync) for M in (A, B, C))
    rows.append(("read floor: A, B, C once (3 gemv)", floor, sgemm))
    for rounds in FLOAT_ROUNDS:
        assert verify(A, B, C, rounds=rounds, seed=SEED).passed
        seconds = best_time(lambda r=rounds, C=C: verify(A, B, C, rounds=r, seed=SEED), repeats,
                            sync)
        rows.append((f"verify fp32, {rounds} rounds", seconds, sgemm))
        if rounds in (DEFAULT_ROUNDS["fp32"], 1) and xp is np:
            R = xp.asarray(sign_vectors(SEED, n, rounds))
            seconds = best_time(lambda R=R: three_passes(xp, A, B, C, R), repeats, sync)
            rows.append(("  of which the 3 passes over B, C, A", seconds, sgemm))
        elif rounds in (DEFAULT_ROUNDS["fp32"], 1):
            rows += float_pieces(A, B, C, rounds, sgemm, repeats, sync)
    Ai = xp.asarray(rng.integers(-128, 128, (n, n), dtype=np.int8))
    Bi = xp.asarray(rng.integers(-128, 128, (n, n), dtype=np.int8))
    Ci = (Ai.astype(np.float64) @ Bi.astype(np.float64)).astype(np.int32)  # exact: < 2^53
    assert verify(Ai, Bi, Ci, precision="exact", seed=SEED).passed
    exact_seconds = best_time(lambda: verify(Ai, Bi, Ci, precision="exact", seed=SEED),
                              repeats, sync)
    rows.append(("verify exact int8->int32, 1 round", exact_seconds, sgemm))
    if xp is np and exact.exact_host is not None:
        kernel, exact.exact_host = exact.exact_host, None  # numpy's loop, as without csrc/
        try:
            seconds = best_time(lambda: verify(Ai, Bi, Ci, precision="exact", seed=SEED),
                                repeats, sync)
        finally:
            exact.exact_host = kernel
        rows.append(("  the same in numpy (no exact_host)", seconds, sgemm))
    if xp is not np and gpu_exact.gpu_launch is not None:
        seconds = without_gpu_launch(
            lambda: best_time(lambda: verify(Ai, Bi, Ci, precision="exact", seed=SEED),
                              repeats, sync))
        rows.append(("  the same, host side in Python", seconds, sgemm))
    if xp is not np:
        returned = best_time(lambda: verify(Ai, Bi, Ci, precision="exact", seed=SEED),
                             repeats, sync, until_return=True)
        rows.append(("  verify() until it returns the verdict", returned, sgemm))
        rows += exact_pieces(Ai, Bi, Ci, sgemm, repeats, sync)
    if n <= int_matmul_limit:
        int_matmul = best_time(lambda: Ai.astype(np.int64) @ Bi.astype(np.int64), 1, sync)
        rows.append(("  vs integer matmul of the same inputs", exact_seconds, int_matmul))
    return rows


def without_gpu_launch(measure):
    """measure() with the GPU exact check's host side in Python, as without csrc/ (plans
    made again on either side, since each holds its compiled launcher)."""
    module = gpu_exact.gpu_launch

    def forget_plans():
        gpu_exact.prepare.cache_clear()
        batch._DEVICE_EXACT.clear()

    gpu_exact.gpu_launch = None
    forget_plans()
    try:
        return measure()
    finally:
        gpu_exact.gpu_launch = module
        forget_plans()


def event_seconds(enqueue, repeats: int, launches: int = 1) -> float:
    """GPU seconds per launch of `launches` enqueue() calls between two CUDA events, best of
    repeats: the device's time without the host's gaps when launches > 1."""
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    best = float("inf")
    for _ in range(repeats):
        start.record()
        for _ in range(launches):
            enqueue()
        end.record()
        end.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, end) / 1e3 / launches)
    return best


def enqueue_seconds(enqueue, repeats: int, sync):
    """(host seconds for one enqueue(), not waiting for the GPU, best of repeats; the last
    call's verdict once the GPU is done)."""
    host = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        verdict = enqueue()
        host = min(host, time.perf_counter() - start)
    sync()
    return host, verdict


def float_pieces(A, B, C, rounds: int, sgemm: float, repeats: int,
                 sync) -> list[tuple[str, float, float]]:
    """The GPU float check's parts: its one launch timed by CUDA events (the bits' copy to
    the device, both barriers, the three passes, tau, the verdict's write to host memory),
    the same launch back to back (BACK_TO_BACK launches between two events: the GPU's time
    per check without the host's gaps), the host's time to derive the bits and enqueue it
    (wall clock, not waiting for the GPU), and gpu_float.check() alone."""
    from verifier import gpu_float
    from verifier.floating import bound_terms
    from verifier.rng import Signs

    n, k = B.shape[1], A.shape[1]
    plan = gpu_float.plan_for(A, B, C, rounds, bound_terms(n, k, "fp32", np.float32))
    repeats = max(repeats, SHORT_REPEATS)

    def enqueue():
        return gpu_float.launch(plan, A, B, C, Signs(SEED, n, rounds).bits)

    kernel = event_seconds(enqueue, repeats)
    back_to_back = event_seconds(enqueue, 3, BACK_TO_BACK)
    host, verdict = enqueue_seconds(enqueue, repeats, sync)
    assert verdict[0] <= 0 and verdict[2] == 0
    bits = Signs(SEED, n, rounds).bits
    check = best_time(lambda: gpu_float.check(plan, A, B, C, bits), repeats, sync)
    return [("  of which 1 launch (CUDA events)", kernel, sgemm),
            (f"  the launch, {BACK_TO_BACK} back to back, each", back_to_back, sgemm),
            ("  of which host: bits + enqueue", host, sgemm),
            ("  gpu_float.check() alone", check, sgemm)]


def exact_pieces(A, B, C, sgemm: float, repeats: int, sync) -> list[tuple[str, float, float]]:
    """The GPU exact check's parts: its one launch timed by CUDA events (vectors, both
    barriers, the three passes, the verdict's write to host memory), the same launch back
    to back (the GPU's time per check without the host's gaps), the host's time to
    derive the key and enqueue it (wall clock, not waiting for the GPU), and
    gpu_exact.check() alone (key, launch, wait, verdict; verify()'s row less this is the
    Python around it)."""
    from verifier import gpu_exact
    from verifier.rng import field_key

    n = B.shape[1]
    bounds, product_bound = (128, 2**31, 128), n * 2**14  # int8 A and B, int32 C
    plan = gpu_exact.plan_for(A, B, C, 1, bounds, product_bound)
    repeats = max(repeats, SHORT_REPEATS)

    def enqueue():
        return gpu_exact.launch(plan, A, B, C, field_key(SEED, n, 1))

    kernel = event_seconds(enqueue, repeats)
    back_to_back = event_seconds(enqueue, 3, BACK_TO_BACK)
    host, verdict = enqueue_seconds(enqueue, repeats, sync)
    assert verdict.tolist() == [0, 2**63 - 1, 0]
    check = best_time(lambda: gpu_exact.check(plan, A, B, C, SEED), repeats, sync)
    return [("  of which 1 launch (CUDA events)", kernel, sgemm),
            (f"  the launch, {BACK_TO_BACK} back to back, each", back_to_back, sgemm),
            ("  of which host: key + enqueue", host, sgemm),
            ("  gpu_exact.check() alone", check, sgemm)]


def run_timings(sizes: list[int], gpu: bool, int_matmul_limit: int, repeats: int) -> None:
    if gpu:
        try:
            import cupy as xp
        except ImportError:
            raise SystemExit("--gpu runs the check on CuPy arrays: CuPy is not installed") from None

        def sync():
            xp.cuda.Device().synchronize()
        device = xp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    else:
        loop = f"exact_host {exact.exact_host.ISA}" if exact.exact_host else "no exact_host"
        xp, device = np, f"{platform.processor() or platform.machine()} (numpy CPU, {loop})"

        def sync():
            pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"device: {device}; numpy {np.__version__}; {os.cpu_count()} CPUs, load average "
          f"{load}; OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}; "
          f"{clock.__name__}, best of {repeats} (of at least {SHORT_REPEATS} for calls under "
          f"{SHORT_CALL * 1e3:g} ms)")
    print(f"{'n':>6}  {'what':38} {'seconds':>10} {'ref s':>10} {'ratio':>8} {'medians':>8}")
    for n in sizes:
        for what, seconds, reference in timing_rows(n, xp, sync, int_matmul_limit, repeats):
            medians = (f"{100 * seconds.median / reference.median:7.2f}%"
                       if hasattr(seconds, "median") and hasattr(reference, "median") else "")
            print(f"{n:>6}  {what:38} {seconds:10.5f} {reference:10.5f} "
                  f"{100 * seconds / reference:7.2f}% {medians:>8}")


def false_accept_table(trials: int) -> None:
    """Single-round acceptance of crafted wrong results, against the theoretical bound."""
    rng = np.random.default_rng(0)
    A = rng.standard_normal((8, 12), dtype=np.float32)
    B = rng.standard_normal((12, 16), dtype=np.float32)
    C = A @ B
    _, tau = residual_and_bound(np, A, B, C, sign_vectors(SEED, 16, 1), "fp32")
    x = np.float32(100 * tau.max())

    def with_errors(entries):
        wrong = C.copy()
        for j, sign in entries:
            wrong[3, j] += sign * x
        return wrong

    cases = [
        ("fp32: e_1 - e_2 in one row", with_errors([(1, 1), (2, -1)]), 0.5, 0.5),
        ("fp32: e_1 + e_2 + e_3 + e_4", with_errors([(j, 1) for j in range(4)]), 0.5, 6 / 16),
        ("fp32: one entry", with_errors([(5, 1)]), 0.5, 0.0),
        ("fp32: whole row +x (n = 16)", with_errors([(j, 1) for j in range(16)]), 0.5,
         12870 / 65536),
    ]
    Ai = rng.integers(-128, 128, (8, 12), dtype=np.int8)
    Bi = rng.integers(-128, 128, (12, 16), dtype=np.int8)
    Ci = Ai.astype(np.int64) @ Bi
    pair = Ci.copy()
    pair[3, 1] += 1
    pair[3, 2] -= 1
    print(f"{'crafted error':32} {'trials':>7} {'accepted':>9} {'rate':>8} {'exact P':>9} "
          f"{'bound':>9}")
    for name, wrong, bound, exact_p in cases:
        accepted = sum(verify(A, B, wrong, rounds=1, seed=i.to_bytes(4, "big")).passed
                       for i in range(trials))
        print(f"{name:32} {trials:7} {accepted:9} {accepted / trials:8.4f} {exact_p:9.4f} "
              f"{bound:9.3g}")
    accepted = sum(verify(Ai, Bi, pair, precision="exact", seed=i.to_bytes(4, "big")).passed
                   for i in range(trials))
    print(f"{'exact: e_1 - e_2 in one row':32} {trials:7} {accepted:9} {accepted / trials:8.4f} "
          f"{2.0**-61:9.3g} {2.0**-61:9.3g}")


def tightness_table() -> None:
    """Bound vs the actual error of numpy's float32 product, per row, for random data."""
    print(f"{'data':9} {'n':>5} {'tau/actual min':>15} {'median':>10} "
          f"{'2tau/max|C_i|':>14} {'2tau/ulp(max|C_i|)':>19}")
    for kind in ("normal", "positive"):
        for n in (64, 256, 1024):
            rng = np.random.default_rng(n)
            make = rng.standard_normal if kind == "normal" else rng.random
            A, B = make((n, n), dtype=np.float32), make((n, n), dtype=np.float32)
            C = A @ B
            R = sign_vectors(SEED, n, 16)
            exact = A.astype(np.float64) @ B.astype(np.float64)
            actual = np.abs((C.astype(np.float64) - exact) @ R).max(axis=1)
            _, tau = residual_and_bound(np, A, B, C, R, "fp32")
            ratio = tau / np.maximum(actual, 1e-300)
            row_max = np.abs(C).max(axis=1).astype(np.float32)
            ulp = np.spacing(row_max).astype(np.float64)
            print(f"{kind:9} {n:5} {ratio.min():15.1f} {np.median(ratio):10.1f} "
                  f"{np.median(2 * tau / row_max):14.2e} {np.median(2 * tau / ulp):19.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--gpu", action="store_true", help="CuPy arrays on the GPU")
    parser.add_argument("--int-matmul-limit", type=int, default=1024,
                        help="largest n at which to time the integer matmul itself")
    parser.add_argument("--tables", action="store_true",
                        help="false-accept rates and bound tightness instead of timings")
    parser.add_argument("--trials", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7, help="best of this many runs")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or the process's CPU seconds (shared machines)")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if args.tables:
        false_accept_table(args.trials)
        print()
        tightness_table()
    else:
        run_timings(args.sizes, args.gpu, args.int_matmul_limit, args.repeats)


if __name__ == "__main__":
    main()
