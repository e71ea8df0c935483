"""Review of the C++ CPU backend: defects found by fuzzing its primitives against numpy."""

import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

cpu = pytest.importorskip("needle.backend_ndarray.ndarray_backend_cpu")

from test_backend_cpu import flat, to_array  # noqa: E402 (after the skip: the module is built)

RNG = np.random.default_rng(22)




@pytest.mark.parametrize(
    "shape, strides, offset, expected",
    [
        ((8,), (-1,), 7, lambda x: x[::-1]),  # reversed
        ((4, 2), (1, 4), 0, lambda x: x.reshape(2, 4).T),  # transposed (the tiled-copy path)
        ((32, 16), (1, 32), 0, lambda x: x.reshape(16, 32).T),  # whole 16 x 16 register tiles
    ],
)
def test_compact_into_its_own_buffer_reads_before_writing(shape, strides, offset, expected):
    """compact(a, a, view) wrote elements the rest of the view had still to be read from (the
    numpy backend copies such a view correctly, and ewise_setitem already guarded against it)."""
    x = RNG.standard_normal(int(np.prod(shape))).astype(np.float32)
    a = to_array(x)
    cpu.compact(a, a, shape, strides, offset)
    np.testing.assert_array_equal(flat(a), expected(x).ravel())


def test_from_numpy_takes_any_float32_dtype_object():
    """A float32 array whose dtype is an equal object other than numpy's own (unpickled, or with
    metadata) was refused: 'expected a float32 array, got dtype float32'."""
    x = np.arange(6, dtype=np.float32)
    out = cpu.Array(6)
    for same in (pickle.loads(pickle.dumps(x)), x.astype(np.dtype("f4", metadata={"unit": "m"}))):
        cpu.fill(out, np.nan)
        cpu.from_numpy(same, out)
        np.testing.assert_array_equal(flat(out), x)
    for other in (x.astype(np.float64), x.astype(">f4")):
        with pytest.raises(ValueError, match="expected a float32 array"):
            cpu.from_numpy(other, out)


SCRATCH_PROBE = textwrap.dedent(
    """
    import resource
    from needle.backend_ndarray import ndarray_backend_cpu as cpu

    def peak_kib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    n = 1 << 22  # a dot product of two 16 MiB vectors
    a, b, out = cpu.Array(n), cpu.Array(n), cpu.Array(1)
    cpu.fill(a, 1.0)
    cpu.fill(b, 1.0)
    cpu.matmul(cpu.Array(256 * 256), cpu.Array(256 * 256), cpu.Array(256 * 256), 256, 256, 256)
    before = peak_kib()
    cpu.matmul(a, b, out, 1, n, 1)
    print(cpu.to_numpy(out, (1,), (1,), 0)[0], (peak_kib() - before) // 1024)
    """
)


def test_matmul_scratch_stays_bounded_for_a_long_k_and_a_narrow_b():
    """The GEMM packed all of K for every panel of B, padded to 16 columns: (1 x n) @ (n x 1)
    took 16 times B's size in scratch (256 MiB here; over 500 MiB for x.sum(axis=0) of a
    (10M, 2) array, which NDArray computes as ones @ x). The packed panel must stay at 8 MiB."""
    result = subprocess.run(
        [sys.executable, "-c", SCRATCH_PROBE], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    total, growth_mib = result.stdout.split()
    assert float(total) == 1 << 22
    assert int(growth_mib) < 64, f"matmul grew the peak RSS by {growth_mib} MiB"


@pytest.mark.parametrize("m, n, p", [(3, (1 << 18) + 7, 5), (13, (1 << 17) + 1, 40)])
def test_matmul_over_several_k_panels(m, n, p):
    """K longer than one packed panel (2**17 rows): panels after the first add to C."""
    x = RNG.standard_normal((m, n)).astype(np.float32)
    y = RNG.standard_normal((n, p)).astype(np.float32)
    out = cpu.Array(m * p)
    cpu.fill(out, np.nan)  # every element must be written
    cpu.matmul(to_array(x), to_array(y), out, m, n, p)
    exact = x.astype(np.float64) @ y.astype(np.float64)
    bound = 1.01 * n * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(y)).astype(np.float64)
    assert np.all(np.abs(flat(out).reshape(m, p) - exact) <= bound)
