"""The worker's compute path against numpy (float) and Python integers (exact)."""

import numpy as np
import pytest

from node import compute


@pytest.fixture(params=["best", "numpy-fallback"])
def device(request):
    return compute.best_device() if request.param == "best" else None


@pytest.mark.parametrize("shapes", [((5, 7), (7, 3)), ((3, 4, 6), (3, 6, 2)), ((3, 4, 6), (6, 2))])
def test_float_matmul_matches_numpy(device, shapes):
    rng = np.random.default_rng(0)
    a = rng.standard_normal(shapes[0]).astype(np.float32)
    b = rng.standard_normal(shapes[1]).astype(np.float32)
    c = compute.matmul(a, b, device)
    assert c.dtype == np.float32
    np.testing.assert_allclose(c, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5,
                               atol=1e-5)


def test_exact_matmul_is_exact():
    rng = np.random.default_rng(1)
    a = rng.integers(-2**31, 2**31 - 1, size=(3, 4), dtype=np.int64) // 2**12
    b = rng.integers(-2**31, 2**31 - 1, size=(4, 2), dtype=np.int64) // 2**12
    c = compute.matmul(a.astype(np.int32), b.astype(np.int32))
    expected = [[sum(int(a[i, t]) * int(b[t, j]) for t in range(4)) for j in range(2)]
                for i in range(3)]
    assert c.tolist() == expected


def test_exact_jobs_may_mix_integer_types():
    """The chain accepts an int8 A with an int16 B; the product is still exact."""
    rng = np.random.default_rng(2)
    a = rng.integers(-128, 128, size=(2, 5, 3)).astype(np.int8)
    b = rng.integers(-2**15, 2**15, size=(3, 4)).astype(np.int16)
    expected = [[[sum(int(a[z, i, t]) * int(b[t, j]) for t in range(3)) for j in range(4)]
                 for i in range(5)] for z in range(2)]
    assert compute.matmul(a, b).tolist() == expected


def _extreme_ints(rng, shape, dtype, bits=None):
    """Random integers of dtype (at most `bits` wide), with the type's (or width's) extremes
    planted, so every exactness bound is met with equality somewhere."""
    info = np.iinfo(dtype)
    low, high = (info.min, info.max) if bits is None else (-(1 << bits), (1 << bits) - 1)
    x = rng.integers(low, high, size=shape, endpoint=True, dtype=np.int64)
    x.flat[rng.integers(0, x.size, size=max(1, x.size // 8))] = low
    x.flat[rng.integers(0, x.size, size=max(1, x.size // 8))] = high
    return x.astype(dtype)


@pytest.mark.parametrize("da,db,bits,m,k,n", [
    (np.int8, np.int8, None, 5, 3000, 4),     # float32 in 3 inner slices, summed in float64
    (np.int8, np.int8, None, 3, 1024, 2),     # one slice: 1024 * 128 * 128 = 2^24 exactly
    (np.int8, np.int16, None, 4, 700, 3),     # float64, one product
    (np.int16, np.int16, None, 2, 300, 5),
    (np.int32, np.int32, 22, 3, 1300, 2),     # float64 in 3 slices, summed in int64
    (np.int32, np.int32, None, 4, 50, 3),     # both 31-bit: cut into limbs
    (np.int64, np.int8, 50, 3, 40, 4),        # one side cut
    (np.int64, np.int64, None, 3, 17, 2),     # full range: numpy's product wraps mod 2^64
    (np.int16, np.int64, 62, 2, 9, 3),
])
def test_exact_matmul_equals_numpy_int64(da, db, bits, m, k, n):
    """The float-BLAS exact product against numpy's integer matmul (an independent loop,
    wrapping mod 2^64 the same way where the true product overflows int64)."""
    rng = np.random.default_rng([m, k, n])
    a, b = _extreme_ints(rng, (m, k), da, bits), _extreme_ints(rng, (k, n), db, bits)
    c = compute.exact_matmul(a, b)
    assert c.dtype == np.int64
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(c, a.astype(np.int64) @ b.astype(np.int64))


@pytest.mark.parametrize("a_shape,b_shape", [((3, 4, 1100), (1100, 2)),
                                             ((2, 3, 1100), (2, 1100, 5)),
                                             ((4, 0), (0, 3)), ((0, 5), (5, 2))])
def test_exact_matmul_batched_and_empty(device, a_shape, b_shape):
    """Through compute.matmul, so on a GPU machine the float32 slices run on needle's cuda."""
    rng = np.random.default_rng(7)
    a = _extreme_ints(rng, a_shape, np.int8) if 0 not in a_shape else np.zeros(a_shape, np.int8)
    b = _extreme_ints(rng, b_shape, np.int8) if 0 not in b_shape else np.zeros(b_shape, np.int8)
    expected = a.astype(np.int64) @ b.astype(np.int64)
    c = compute.matmul(a, b, device)
    assert c.shape == expected.shape and c.dtype == np.int64
    np.testing.assert_array_equal(c, expected)


@pytest.mark.parametrize("a_shape,b_shape,match", [
    ((2, 3), (4, 5), "shapes do not match"),
    ((2, 3, 4), (3, 4, 5), "shapes do not match"),
    ((3,), (3, 2), "2-D"),
])
def test_bad_shapes_are_rejected(a_shape, b_shape, match):
    with pytest.raises(ValueError, match=match):
        compute.matmul(np.ones(a_shape, np.float32), np.ones(b_shape, np.float32))


def test_mixed_or_unsupported_dtypes_are_rejected():
    with pytest.raises(ValueError, match="dtypes differ"):
        compute.matmul(np.ones((2, 2), np.float32), np.ones((2, 2), np.int32))
    with pytest.raises(ValueError, match="unsupported operand dtype"):
        compute.matmul(np.ones((2, 2)), np.ones((2, 2)))


def test_corrupt_changes_every_entry():
    c = np.zeros((4, 5), np.float32)
    bad = compute.corrupt(c, np.random.default_rng(0))
    assert (bad != c).all()


@pytest.mark.parametrize("a,b,dims,exact", [
    (np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), (1, 2, 3, 4), False),
    (np.ones((1, 2, 3), np.float32), np.ones((1, 3, 4), np.float32), (1, 2, 3, 4), False),
    (np.ones((5, 2, 3), np.float32), np.ones((3, 4), np.float32), (5, 2, 3, 4), False),
    (np.ones((2, 3), np.int8), np.ones((3, 4), np.int64), (1, 2, 3, 4), True),
])
def test_operands_matching_their_declaration_pass(a, b, dims, exact):
    compute.check_operands(a, b, dims, exact)


@pytest.mark.parametrize("a,b,dims,exact,match", [
    (np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), (2, 2, 3, 4), False,
     r"A has shape \(2, 3\), the job declares \(2, 2, 3\)$"),
    (np.ones((5, 2, 3), np.float32), np.ones((4, 3, 4), np.float32), (5, 2, 3, 4), False,
     r"B has shape \(4, 3, 4\), the job declares \(5, 3, 4\) or \(3, 4\)$"),
    (np.ones((2, 3), np.float32), np.full((3, 4), -np.inf, np.float32), (1, 2, 3, 4), False,
     "B holds NaN or Inf"),
    (np.ones((2, 3), np.int16), np.ones((3, 4), np.int16), (1, 2, 3, 4), False,
     "A is int16, the job's precision class needs float32"),
    (np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), (1, 2, 3, 4), True,
     "A is float32, the job's precision class needs an integer type"),
])
def test_operands_not_matching_their_declaration_are_rejected(a, b, dims, exact, match):
    with pytest.raises(compute.OperandError, match=match):
        compute.check_operands(a, b, dims, exact)


@pytest.mark.parametrize("a_shape,b_shape", [((5, 2100), (2100, 4)), ((2, 3, 2100), (2100, 4)),
                                             ((2, 3, 2100), (2, 2100, 5)), ((3, 90), (90, 2))])
def test_exact_slices_on_a_needle_device(a_shape, b_shape):
    """The device path of the float32 slices (taken on `cuda`), run here on needle's C++ cpu
    backend: operands uploaded once, each inner slice's product read back and summed."""
    ndl = pytest.importorskip("needle")
    device = ndl.cpu()
    if not device.enabled():
        pytest.skip("needle's cpu backend is not built")
    rng = np.random.default_rng(11)
    a, b = _extreme_ints(rng, a_shape, np.int8), _extreme_ints(rng, b_shape, np.int8)
    c = compute._chunked(a, b, np.float32, 128 * 128, device)
    np.testing.assert_array_equal(c, a.astype(np.int64) @ b.astype(np.int64))


@pytest.mark.parametrize("wanted", ["cpu", "numpy", "cuda", "tpu"])
def test_a_forced_device_is_that_device_or_a_start_error(wanted, monkeypatch):
    """NEEDLE_NET_DEVICE naming a device this machine lacks (cuda without a GPU) fell back
    to plain numpy without a word; now it is a ValueError naming what there is."""
    monkeypatch.setenv("NEEDLE_NET_DEVICE", wanted)
    names = [d.name for d in compute._needle_devices()]
    available = wanted in names or (wanted == "numpy" and any("numpy" in n for n in names))
    if not available and wanted != "numpy":
        with pytest.raises(ValueError, match=f"NEEDLE_NET_DEVICE={wanted}: .*no such device"):
            compute.best_device()
        return
    device = compute.best_device()
    assert device is not None and (device.name == wanted or "numpy" in device.name)
