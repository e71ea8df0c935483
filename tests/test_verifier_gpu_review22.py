"""Review 22 of the GPU verifier (verifier/gpu.py, gpu_exact.py, gpu_float.py): the defects
found by reading, and the edge cases checked by reading, run on a GPU against the host's
verdicts or Python's integers.

* gpu.signed_and_abs (exact mode's generic path: more than 4 rounds, strided or unusual
  inputs) compiled a tile of W at least 32 columns wide in static shared memory, so with more
  than 192 float64 columns (limbs * rounds: an int32 C at n = 2^15 has 8 limbs, 256 columns
  at 32 rounds) the kernel did not compile and verify() raised instead of giving a verdict.
* gpu_float's fill_signs read the sign bits of a tile's whole width, also past the last
  column of the last tile: up to a tile (512 bytes) beyond the bits' device buffer. The
  values were never used, so only compute-sanitizer sees it (run here when it is installed).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from verifier import verify

cupy = pytest.importorskip("cupy")
try:
    cupy.cuda.runtime.getDeviceCount()
except Exception as err:  # CuPy without a usable GPU
    pytest.skip(f"no CUDA GPU: {err}", allow_module_level=True)

SEED = b"review22" * 4
ROOT = Path(__file__).resolve().parents[1]
BIG = os.environ.get("NEEDLE_GPU_BIG_TESTS") == "1"


def _mod_p_reference(M, V):
    """(M @ V) mod p with Python's unbounded integers."""
    from verifier import P

    return np.array((M.astype(object) @ V.astype(object)) % P, dtype=np.uint64)


def _int8_product(rng, m, k, n):
    A = rng.integers(-128, 128, (m, k), dtype=np.int8)
    B = rng.integers(-128, 128, (k, n), dtype=np.int8)
    return A, B, (A.astype(np.int64) @ B).astype(np.int32)


def test_fused_kernel_takes_more_columns_than_its_shared_memory_holds():
    """256 float64 columns of W (a 64 KiB tile at the 32-column minimum; old code: the
    kernel did not compile): M W and |M| v exact, as int64 products."""
    from verifier.gpu import MAX_COLUMNS, signed_and_abs

    rng = np.random.default_rng(32)
    M = rng.integers(-(2**31), 2**31, (70, 300), dtype=np.int32)
    M[0] = -(2**31)
    W = rng.integers(-128, 128, (300, 2 * MAX_COLUMNS))  # sums below 2^47: exact in float64
    v = rng.integers(0, 100, 300)
    S, a = signed_and_abs(cupy.asarray(M), cupy.asarray(W.astype(np.float64)),
                          cupy.asarray(v.astype(np.float64)), np.float64)
    assert S.shape == (70, 2 * MAX_COLUMNS) and S.dtype == np.float64
    np.testing.assert_array_equal(cupy.asnumpy(S), (M.astype(np.int64) @ W).astype(np.float64))
    np.testing.assert_array_equal(cupy.asnumpy(a),
                                  (np.abs(M.astype(np.int64)) @ v).astype(np.float64))


def test_generic_exact_path_with_many_limb_columns_equals_the_host():
    """32 rounds (above gpu_exact.MAX_ROUNDS: the generic path) with an int32 C at
    n = 2^15: C's 8-bit digits, 8 per round, make 256 columns (old code: a CUDA compile
    error out of verify()). Honest passes; wrong rows are counted and located as on the
    host."""
    from verifier import exact, gpu_exact

    rng = np.random.default_rng(33)
    m, k, n, rounds = 3, 4, 1 << 15, 32
    A, B, C = _int8_product(rng, m, k, n)
    dA, dB = cupy.asarray(A), cupy.asarray(B)
    assert not gpu_exact.supported(dA, dB, cupy.asarray(C), rounds, (128, 2**31, 128))
    assert -(-61 // exact.digit_width(2**31, n, 1 << 53)) * rounds > 192
    assert verify(dA, dB, cupy.asarray(C), precision="exact", rounds=rounds, seed=SEED).passed
    C[2, n - 1] += 1
    C[1, 0] -= 3
    on_gpu = verify(dA, dB, cupy.asarray(C), precision="exact", rounds=rounds, seed=SEED)
    on_host = verify(A, B, C, precision="exact", rounds=rounds, seed=SEED)
    assert not on_gpu.passed and on_gpu == on_host
    assert on_gpu.worst_excess == 2 and "first row 1" in on_gpu.reason


# the shapes of the in-process and the sanitized exact checks (the same kernels): every
# dimension 1; k = 17 (wide, single loads) and n = 20 (dp4a words, then 16-byte int32 rows);
# 33 rows (a tensor-core group of 16 and a tail) of k = 4 (one dp4a word) and n = 16 (mma)
EXACT_SHAPES = [(1, 1, 1), (2, 17, 20), (33, 4, 16)]


@pytest.mark.parametrize("m, k, n", EXACT_SHAPES)
def test_exact_tiny_and_odd_shapes_equal_the_host(m, k, n):
    """Checked by reading (no defect found): tails of every inner loop when m, k or n is 1,
    not a multiple of 4 or smaller than a tile; honest passes, a wrong last entry is found."""
    A, B, C = _int8_product(np.random.default_rng(m * k * n), m, k, n)
    assert verify(*(cupy.asarray(M) for M in (A, B, C)), precision="exact", seed=SEED).passed
    C[m - 1, n - 1] += 1
    on_gpu = verify(*(cupy.asarray(M) for M in (A, B, C)), precision="exact", seed=SEED)
    assert on_gpu == verify(A, B, C, precision="exact", seed=SEED)
    assert not on_gpu.passed and on_gpu.worst_excess == 1 and f"row {m - 1}" in on_gpu.reason


@pytest.mark.parametrize("rounds", [1, 3])
def test_tensor_core_residues_at_the_int8_extremes(rounds):
    """Checked by reading (no defect found): int8 rows of MMA_MAX_COLS entries at -128 and
    127 against words whose byte limbs are 255 (P - 1) take the tensor cores (16-byte aligned
    rows, 19 rows: a group of 16 and a tail); residues equal Python's."""
    from verifier import P, gpu_exact

    cols = gpu_exact.MMA_MAX_COLS
    rng = np.random.default_rng(rounds)
    M = rng.integers(-128, 128, (19, cols), dtype=np.int8)
    M[0], M[1], M[18] = -128, 127, -128
    M[2, ::2], M[2, 1::2] = -128, 127
    words = rng.integers(0, 2**64, (rounds, cols), dtype=np.uint64, endpoint=False)
    words[0] = P - 1
    dM = cupy.asarray(M)
    assert gpu_exact.bytes_path(dM)
    out = cupy.empty((19, rounds), np.uint64)
    flags = cupy.zeros(3, np.int64)
    gpu_exact.residues(dM, cupy.asarray(words), 1, cols, rounds, 128, None, out, flags)
    np.testing.assert_array_equal(cupy.asnumpy(out),
                                  _mod_p_reference(M, (words & np.uint64(P)).T))
    assert int(flags[2]) == 0


def _sanitizer():
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    homes = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""),
             *sorted(str(p) for p in Path("/usr/local").glob("cuda*"))]
    for home in homes:
        path = Path(home, "bin", "compute-sanitizer") if home else None
        if path is not None and path.is_file():
            return str(path)
    return None


SANITIZED = r"""
import numpy as np
import cupy
cupy.cuda.set_allocator(None)  # one cudaMalloc per array: memcheck knows where each one ends
from verifier import verify
rng = np.random.default_rng(0)
# float: the last tile of the sign bits narrower than a tile (old code read past the bits)
for m, k, n, rounds in [(1, 1, 1, 1), (3, 5, 17, 16), (2, 8, 4097, 1)]:
    A = rng.integers(-8, 9, (m, k)).astype(np.float32)
    B = rng.integers(-8, 9, (k, n)).astype(np.float32)
    C = (A.astype(np.int64) @ B.astype(np.int64)).astype(np.float32)
    dA, dB, dC = (cupy.asarray(M) for M in (A, B, C))
    assert verify(dA, dB, dC, rounds=rounds, seed=b"sanitized").passed
    dC[m - 1, n - 1] += 1e5  # far above the bound (~200 for n = 4097 here)
    assert not verify(dA, dB, dC, rounds=rounds, seed=b"sanitized").passed
    print("float", m, k, n, rounds, "done", flush=True)
for m, k, n in SHAPES:
    A = rng.integers(-128, 128, (m, k), dtype=np.int8)
    B = rng.integers(-128, 128, (k, n), dtype=np.int8)
    C = (A.astype(np.int64) @ B).astype(np.int32)
    dA, dB, dC = (cupy.asarray(M) for M in (A, B, C))
    assert verify(dA, dB, dC, precision="exact", seed=b"sanitized").passed
    dC[m - 1, n - 1] += 1
    assert verify(dA, dB, dC, precision="exact", seed=b"sanitized").worst_excess == 1
    print("exact", m, k, n, "done", flush=True)
"""


def test_no_out_of_bounds_accesses_under_compute_sanitizer():
    """memcheck over float checks whose last tile of signs is narrower than a tile (old
    code: fill_signs read up to a tile past the bits' buffer) and over tiny exact checks."""
    sanitizer = _sanitizer()
    if sanitizer is None:
        pytest.skip("compute-sanitizer not found")
    script = f"SHAPES = {EXACT_SHAPES!r}\n" + SANITIZED
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    try:
        done = subprocess.run([sanitizer, "--tool", "memcheck", "--report-api-errors", "no",
                               "--error-exitcode", "97", "--print-limit", "10",
                               sys.executable, "-c", script],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"compute-sanitizer timed out: {err.stdout}\n{err.stderr}")
    output = done.stdout + done.stderr
    if "too many resources" in output or "TOO_LARGE" in output:  # instrumented registers
        pytest.skip("the instrumented cooperative kernels do not fit: " + output[-2000:])
    assert done.returncode == 0 and "ERROR SUMMARY: 0 errors" in output, output[-6000:]
    assert output.count(" done") == 3 + len(EXACT_SHAPES), output[-6000:]


@pytest.mark.skipif(not BIG, reason="set NEEDLE_GPU_BIG_TESTS=1 (about 11 GiB of GPU memory)")
@pytest.mark.parametrize("precision", ["exact", "fp32"])
def test_more_than_2_to_the_31_entries_of_c(precision):
    """Checked by reading (no defect found): C of m n > 2^31 entries (offsets past 2^33
    bytes): every index is 64-bit, so an honest C passes and wrong entries in the last rows
    are found."""
    m, k, n = (1 << 19) + 3, 16, 4096
    assert m * n > 2**31
    rng = np.random.default_rng(34)
    low, high = (-128, 128) if precision == "exact" else (-8, 9)
    dtype = np.int8 if precision == "exact" else np.float32
    dA = cupy.asarray(rng.integers(low, high, (m, k)).astype(dtype))
    dB = cupy.asarray(rng.integers(low, high, (k, n)).astype(dtype))
    dC = cupy.empty((m, n), np.int32 if precision == "exact" else np.float32)
    Bf = dB.astype(np.float32)
    step = 1 << 16
    for i in range(0, m, step):  # integer sums below 2^24: exact in float32 (tf32 too)
        dC[i : i + step] = (dA[i : i + step].astype(np.float32) @ Bf).astype(dC.dtype)
    assert verify(dA, dB, dC, precision=precision, seed=SEED).passed
    dC[m - 2, 5] -= 7 if precision == "exact" else 2e4  # float: the worst row
    dC[m - 1, n - 1] += 1 if precision == "exact" else 1e4
    result = verify(dA, dB, dC, precision=precision, seed=SEED)
    assert not result.passed and f"row {m - 2}" in result.reason
    if precision == "exact":
        assert result.worst_excess == 2
