"""Review of the C++ CPU backend (session 25): one-row products, NDArray's sums over leading
axes, checked against float64 numpy."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import needle.backend_ndarray as nd

cpu = pytest.importorskip("needle.backend_ndarray.ndarray_backend_cpu")

from test_backend_cpu import flat, to_array  # noqa: E402 (after the skip: the module is built)

RNG = np.random.default_rng(25)


@pytest.mark.parametrize("device", ["cpu", "cpu_numpy"])
@pytest.mark.parametrize(
    "rows, cols, value", [(1 << 22, 1, 0.1), (1 << 20, 4, 1 / 3)], ids=["column", "four-columns"]
)
def test_sum_over_leading_axes_is_as_accurate_as_a_full_sum(rows, cols, value, device):
    """x.sum(axis=0) runs as ones(1, R) @ x, which the cpu module's GEMM added as R / 256
    block sums in one float32 chain: 4M rows of 0.1 summed 1.5e-4 off (x.sum() and numpy's
    pairwise sum 1.5e-7; the numpy backend's float32 matmul 2.7e-3 off at 10^7 rows), where
    the CUDA module's one-row path adds in double."""
    x = np.full((rows, cols), value, dtype=np.float32)
    got = nd.NDArray(x, device=getattr(nd, device)()).sum(axis=0).numpy()
    exact = x.astype(np.float64).sum(axis=0)
    np.testing.assert_array_less(np.abs(got - exact), 2.0**-23 * exact)


ROW_SHAPES = [
    (1, 1),
    (7, 1),
    (1, 33),
    (300, 5),
    (8, 600_001),
    (4097, 4099),
    (100_003, 64),
    (1 << 20, 3),
]


@pytest.mark.parametrize("n, p", ROW_SHAPES)
def test_one_row_products_match_float64(n, p):
    """Every one-row product (1 x n @ n x p, threaded or not, a column block cut short or not)
    within float32's final rounding of the float64 product plus a double sum's error."""
    a = RNG.standard_normal((1, n)).astype(np.float32)
    b = RNG.standard_normal((n, p)).astype(np.float32)
    out = cpu.Array(p)
    cpu.fill(out, np.nan)  # every element must be written
    cpu.matmul(to_array(a), to_array(b), out, 1, n, p)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    bound = 2.0**-24 * np.abs(exact) + (n + 1) * 2.0**-52 * (np.abs(a) @ np.abs(b))
    assert np.all(np.abs(flat(out) - exact.ravel()) <= bound.ravel())


def test_one_row_product_special_values_and_aliasing():
    """NaN and inf as numpy gives them (0 * inf is NaN), and an output that is also the input
    row still reads the whole row first. (A guard for the one-row path: passes before too.)"""
    a = np.array([[0.0, 1.0, 2.0]], dtype=np.float32)
    b = np.array([[np.inf, 1.0, 0.0], [1.0, np.nan, 1.0], [1.0, 1.0, 3e38]], dtype=np.float32)
    out = cpu.Array(3)
    cpu.matmul(to_array(a), to_array(b), out, 1, 3, 3)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(flat(out), (a @ b).ravel())
    x = np.arange(1.0, 5.0, dtype=np.float32).reshape(1, 4)
    w = np.arange(16.0, dtype=np.float32).reshape(4, 4)
    row = to_array(x)
    cpu.matmul(row, to_array(w), row, 1, 4, 4)
    np.testing.assert_array_equal(flat(row), (x @ w).ravel())


ONE_THREAD_PROBE = textwrap.dedent(
    """
    import sys
    import numpy as np
    from needle.backend_ndarray import ndarray_backend_cpu as cpu

    n, p = 1 << 20, 5
    rng = np.random.default_rng(1)
    a, b, out = cpu.Array(n), cpu.Array(n * p), cpu.Array(p)
    cpu.from_numpy(rng.standard_normal(n).astype(np.float32), a)
    cpu.from_numpy(rng.standard_normal(n * p).astype(np.float32), b)
    cpu.matmul(a, b, out, 1, n, p)
    sys.stdout.write(cpu.to_numpy(out, [p], [1], 0).tobytes().hex())
    """
)


def test_one_row_product_is_the_same_for_any_number_of_threads():
    """A threaded one-row product adds its slices in a fixed order: one thread and two give the
    same bits. (A guard for the one-row path: passes before too.)"""
    results = {
        subprocess.run(
            [sys.executable, "-c", ONE_THREAD_PROBE],
            env={**os.environ, "OMP_NUM_THREADS": threads},
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        for threads in ("1", "2")
    }
    assert len(results) == 1
