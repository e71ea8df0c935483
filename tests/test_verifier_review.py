"""verify() and verify_many() under bad and unusual input, against independent references
(Python integers for exact mode, float64 products for float modes)."""
import numpy as np
import pytest

from verifier import P, verify, verify_many

SEED = bytes(range(32))


def python_product(A, B) -> list[list[int]]:
    """A @ B in Python's unbounded integers."""
    A = [[int(v) for v in row] for row in np.asarray(A)]
    B = [[int(v) for v in row] for row in np.asarray(B)]
    return [[sum(a * B[l][j] for l, a in enumerate(row)) for j in range(len(B[0]))]
            for row in A]


def read_only(x):
    y = x.copy()
    y.setflags(write=False)
    return y


def unaligned(x):
    raw = np.frombuffer(b"\0" + np.ascontiguousarray(x).tobytes(), np.uint8)[1:]
    return raw.view(x.dtype).reshape(x.shape)


LAYOUTS = {
    "fortran": lambda x: np.asfortranarray(x),
    "transposed view": lambda x: x.swapaxes(-1, -2).copy().swapaxes(-1, -2),
    "negative strides": lambda x: x[..., ::-1, ::-1].copy()[..., ::-1, ::-1],
    "every other column": lambda x: np.repeat(x, 2, axis=-1)[..., ::2],
    "big-endian": lambda x: x.astype(x.dtype.newbyteorder(">")),
    "big-endian fortran": lambda x: np.asfortranarray(x.astype(x.dtype.newbyteorder(">"))),
    "read-only": read_only,
    "unaligned": unaligned,
}


def snapshot(*arrays):
    return [(x.dtype.str, x.shape, x.strides, x.flags.writeable, x.tobytes()) for x in arrays]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_exact_mode_on_unusual_layouts_matches_python_integers(layout):
    rng = np.random.default_rng(1)
    A = rng.integers(-2**15, 2**15, (2, 9, 7)).astype(np.int16)
    B = rng.integers(0, 2**32, (7, 11), dtype=np.uint64).astype(np.uint32)
    ref = [python_product(a, B) for a in A]
    C = np.array(ref, dtype=np.int64)  # entries up to 2^50: the split-halves path
    C[0, 2, 0] -= 1
    C[0, 2, 5] += 1
    C[1, 8, 10] -= 3
    wrong = sum(any(int(C[e, i, j]) != ref[e][i][j] for j in range(11))
                for e in range(2) for i in range(9))
    f = LAYOUTS[layout]
    a, b, honest, c = f(A), f(B), f(np.array(ref, dtype=np.int64)), f(C)
    before = snapshot(a, b, honest, c)
    assert verify(a, b, honest, precision="exact", seed=SEED).passed
    result = verify(a, b, c, precision="exact", seed=SEED)
    assert not result.passed and result.worst_excess == wrong == 2
    assert "first row 2 of batch element (0,)" in result.reason
    forged = f(np.array(ref, dtype=np.int64) + P * (np.arange(9)[:, None] == 5))
    result = verify(a, b, forged, precision="exact", seed=SEED)  # equal mod p: not the product
    assert not result.passed and "above the largest the product can hold" in result.reason
    assert snapshot(a, b, honest, c) == before


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float_mode_on_unusual_layouts(layout):
    rng = np.random.default_rng(2)
    A = rng.standard_normal((3, 20, 30), dtype=np.float32)
    B = rng.standard_normal((30, 25), dtype=np.float32)
    C = (A.astype(np.float64) @ B).astype(np.float32)  # correctly rounded: honest in fp32
    wrong = C.copy()
    wrong[2, 13, 7] += 100
    plain = verify(A, B, wrong, seed=SEED, rounds=4)
    assert 99 < plain.worst_excess < 100  # one entry off by 100: |(E r)_13| = 100 every round
    f = LAYOUTS[layout]
    a, b, c, w = f(A), f(B), f(C), f(wrong)
    before = snapshot(a, b, c, w)
    assert verify(a, b, c, seed=SEED, rounds=4).passed
    result = verify(a, b, w, seed=SEED, rounds=4)
    assert not result.passed and "row 13 of batch element (2,)" in result.reason
    assert result.worst_excess == pytest.approx(plain.worst_excess, rel=1e-6)
    assert snapshot(a, b, c, w) == before
    single = f(A[2]), f(B), f(C[2]), f(wrong[2])  # one matrix: the row-blocked pass
    before = snapshot(*single)
    assert verify(*single[:3], seed=SEED, rounds=4).passed
    result = verify(*single[:2], single[3], seed=SEED, rounds=4)
    assert not result.passed and result.reason.startswith("row 13 exceeds")
    assert result.worst_excess == pytest.approx(plain.worst_excess, rel=1e-6)
    assert snapshot(*single) == before


def test_big_endian_float32_with_nan_names_the_matrix():
    x = np.ones((3, 3), np.float32)
    c = (3 * x).astype(">f4")
    c[1, 2] = np.nan
    result = verify(x.astype(">f4"), x, c, seed=SEED)
    assert not result.passed and result.worst_excess == np.inf
    assert result.reason == "NaN or Inf in C"


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_masked_arrays_are_checked_on_their_data():
    """A mask hid NaN from the NaN test (a garbage C passed with worst_excess -inf) and huge
    entries from the magnitude bound (an honest exact product failed)."""
    rng = np.random.default_rng(3)
    A = rng.standard_normal((2, 6, 5), dtype=np.float32)
    B = rng.standard_normal((5, 4), dtype=np.float32)
    for a, where in ((A, " (batch element (0,))"), (A[1], "")):  # a stack, a single matrix
        data = a @ B
        data[..., 1, 1] = np.nan
        c = np.ma.masked_array(data, mask=np.isnan(data))
        before = snapshot(c.data, c.mask)
        result = verify(a, B, c, seed=SEED)
        assert not result.passed and result.reason == "NaN or Inf in C" + where
        assert result.worst_excess == np.inf
        assert snapshot(c.data, c.mask) == before
    Ai = rng.integers(-5, 5, (4, 3)).astype(np.int64)
    Bi = rng.integers(-5, 5, (3, 4)).astype(np.int64)
    Ai[0, 0] = 2**40
    Ci = np.array(python_product(Ai, Bi), dtype=np.int64)
    masked = np.ma.masked_array(Ai, mask=np.eye(4, 3, dtype=bool))
    assert verify(masked, Bi, Ci, precision="exact", seed=SEED).passed
    Ci[0, 1] += 1
    assert verify(masked, Bi, Ci, precision="exact", seed=SEED).worst_excess == 1
    assert masked.mask[0, 0] and masked.data[0, 0] == 2**40
    matrix = np.asmatrix(Ai)
    assert verify(matrix, np.asmatrix(Bi), np.asmatrix(Ci), precision="exact",
                  seed=SEED).worst_excess == 1


@pytest.mark.parametrize("precision, dtype", [("exact", np.int8), ("fp32", np.float32)])
@pytest.mark.parametrize("shapes", [
    ((0, 3, 3), (3, 3), (0, 3, 3)),
    ((2, 0, 3, 3), (3, 3), (2, 0, 3, 3)),
    ((0, 1, 3, 3), (2, 3, 3), (0, 2, 3, 3)),
])
def test_empty_batches_are_refused_like_empty_matrices(precision, dtype, shapes):
    """Was a numpy argmax error (float) or a vacuous pass (exact)."""
    A, B, C = (np.ones(s, dtype) for s in shapes)
    with pytest.raises(ValueError, match="batch dimensions must be at least 1"):
        verify(A, B, C, precision=precision, seed=SEED)


@pytest.mark.parametrize("shapes", [((3, 0), (0, 3), (3, 3)), ((0, 3), (3, 3), (0, 3)),
                                    ((3, 3), (3, 0), (3, 0))])
def test_empty_matrices_are_refused(shapes):
    A, B, C = (np.ones(s, np.int8) for s in shapes)
    with pytest.raises(ValueError, match="between 1 and"):
        verify(A, B, C, precision="exact")


def test_four_dimensional_operands_and_batched_b_against_numpy():
    rng = np.random.default_rng(4)
    A = rng.integers(-9, 9, (5, 3)).astype(np.int32)
    B = rng.integers(-9, 9, (2, 3, 3, 6)).astype(np.int32)  # A broadcasts over B's batch
    C = A.astype(np.int64) @ B
    assert verify(A, B, C, precision="exact", seed=SEED).passed
    C[1, 2, 4, 5] += 1
    result = verify(A, B, C, precision="exact", seed=SEED)
    assert not result.passed and "row 4 of batch element (1, 2)" in result.reason
    with pytest.raises(ValueError, match="C has shape"):
        verify(A, B, C[0], precision="exact")


REFUSED = [bool, np.float16, np.float64, np.complex64, object, "U3"]


@pytest.mark.parametrize("precision, good, dtype", [
    *(("fp32", np.float32, d) for d in [*REFUSED, np.int32, np.uint64, "<f8", ">f8"]),
    *(("exact", np.int32, d) for d in [*REFUSED, np.float32, np.uint64, ">u8"]),
])
@pytest.mark.parametrize("where", range(3))
def test_refused_dtypes_name_the_matrix(precision, good, dtype, where):
    """'>u8' passed the uint64 refusal (dtype equality depends on the byte order)."""
    arrays = [np.ones((2, 2), good) for _ in range(3)]
    arrays[where] = np.ones((2, 2), dtype)
    with pytest.raises(TypeError, match=f"{'ABC'[where]} is "):
        verify(*arrays, precision=precision, seed=SEED)


@pytest.mark.parametrize("value", [None, "abc", {}, [[1, 2], [3]], [[2**70]]])
def test_non_numeric_operands_are_named(value):
    x = np.ones((1, 1), np.int32)
    with pytest.raises(TypeError, match="B is not"):
        verify(x, value, x, precision="exact")


@pytest.mark.parametrize("precision", [np.array(["fp32"]), ["fp32"], None, b"fp32", "FP32"])
def test_precision_that_names_no_class_is_refused(precision):
    x = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match="precision must be one of"):
        verify(x, x, 2 * x, precision=precision)
    with pytest.raises(ValueError, match="precision must be one of"):
        verify_many([], precision=precision)


@pytest.mark.parametrize("rounds, error", [(0, ValueError), (-1, ValueError), (65, ValueError),
                                           (10**30, ValueError), (2.0, TypeError),
                                           (True, TypeError), ("3", TypeError),
                                           (np.float32(2), TypeError)])
def test_bad_rounds_are_named(rounds, error):
    x = np.ones((2, 2), np.float32)
    with pytest.raises(error, match="rounds must be"):
        verify(x, x, 2 * x, rounds=rounds)
    with pytest.raises(error, match="rounds must be"):
        verify_many([], rounds=rounds)


def test_verify_many_names_the_triple_at_fault():
    x = np.ones((2, 2), np.float32)
    with pytest.raises(TypeError, match=r"triple 0 must be \(A, B, C\)"):
        verify_many([(x, x)])
    with pytest.raises(TypeError, match=r"triple 1 must be \(A, B, C\)"):
        verify_many([(x, x, 2 * x), None])
    with pytest.raises(ValueError, match="triple 1: C has shape"):
        verify_many([(x, x, 2 * x), (x, x, x[:1])])
    with pytest.raises(TypeError, match="triple 0: exact mode takes integer"):
        verify_many([(x, x, x)], precision="exact")


@pytest.mark.parametrize("rounds", [1, 3, 64])
def test_result_fields_are_consistent(rounds):
    rng = np.random.default_rng(5)
    A = rng.integers(-3, 3, (6, 8)).astype(np.float32)  # small integers: every sum is exact
    B = rng.integers(-3, 3, (8, 5)).astype(np.float32)
    C = A @ B
    honest = verify(A, B, C, rounds=rounds, seed=SEED)
    assert honest.passed and honest.worst_excess <= 0 and honest.reason == "ok"
    assert honest.rounds == rounds and honest.false_accept_bound == 2.0**-rounds
    C[2, 1] += 50
    wrong = verify(A, B, C, rounds=rounds, seed=SEED)
    assert not wrong.passed and 49.9 < wrong.worst_excess < 50  # 50 - tau_2, tau_2 > 0
    assert wrong.reason.startswith("row 2 exceeds") and wrong.rounds == rounds
    Ai, Bi = A.astype(np.int8), B.astype(np.int8)
    exact = verify(Ai, Bi, (A @ B).astype(np.int32), precision="exact", rounds=rounds, seed=SEED)
    assert exact.passed and exact.worst_excess == 0 and exact.rounds == rounds
    if rounds < 64:
        assert exact.false_accept_bound == pytest.approx(1 / P**rounds, rel=1e-12)
    assert 0 < exact.false_accept_bound < 2.0**-60


class FakeDeviceArray:
    """Claims to live on a GPU (what module_of looks at)."""

    __cuda_array_interface__ = {"shape": (2, 2), "typestr": "<f4", "data": (0, False),
                                "version": 3}


def test_device_arrays_without_cupy_or_mixed_with_host_arrays_are_named():
    x = np.ones((2, 2), np.float32)
    with pytest.raises(TypeError, match="all be on the host or all on the GPU"):
        verify(x, FakeDeviceArray(), x)
    try:
        import cupy  # noqa: F401
    except ImportError:
        device = FakeDeviceArray()
        with pytest.raises(ImportError, match="needs CuPy, which is not installed"):
            verify(device, device, device)
