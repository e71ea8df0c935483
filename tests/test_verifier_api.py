"""verify()'s contract: shapes, dtypes, batches, seeds, and inputs left untouched."""
import hashlib

import numpy as np
import pytest

from verifier import DEFAULT_ROUNDS, VerifyResult, verify, verify_many
from verifier.rng import P, field_vectors, sign_vectors

SEED = bytes(range(32))


def floats(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


def shake_stream(seed, label, nbytes):
    """The documented stream, written out independently of verifier.rng."""
    return hashlib.shake_128(b"needle-net/freivalds/v2" + len(seed).to_bytes(8, "big") + seed
                             + label).digest(nbytes)


def test_sign_vectors_follow_the_documented_derivation():
    n, rounds = 37, 3
    label = b"sign:" + n.to_bytes(8, "big") + rounds.to_bytes(8, "big")
    raw = shake_stream(SEED, label, 100)
    bits = [(raw[t // 8] >> (7 - t % 8)) & 1 for t in range(n * rounds)]
    expected = np.array([[1 - 2 * bits[q * n + j] for q in range(rounds)] for j in range(n)])
    assert np.array_equal(sign_vectors(SEED, n, rounds), expected)


@pytest.mark.parametrize("seed, n, rounds", [(SEED, 11, 2), (b"s", 1, 1), (bytes(200), 50, 3)])
def test_field_vectors_follow_the_documented_derivation(seed, n, rounds):
    """Stream v3: block b = SHAKE128("needle-net/freivalds/v3/" || key || b), key =
    SHAKE128("needle-net/freivalds/v3:field-key" || len(seed) || seed || label), 32 bytes."""
    label = b"field:" + n.to_bytes(8, "big") + rounds.to_bytes(8, "big")
    key = hashlib.shake_128(b"needle-net/freivalds/v3:field-key" + len(seed).to_bytes(8, "big")
                            + seed + label).digest(32)
    raw = b"".join(hashlib.shake_128(b"needle-net/freivalds/v3/" + key + b.to_bytes(8, "big"))
                   .digest(168) for b in range(n * rounds // 21 + 1))
    words = [int.from_bytes(raw[8 * i : 8 * i + 8], "little") & P for i in range(len(raw) // 8)]
    accepted = [w for w in words if w != P][: n * rounds]
    expected = np.array([[accepted[q * n + j] for q in range(rounds)] for j in range(n)])
    assert np.array_equal(field_vectors(seed, n, rounds), expected)


def test_same_seed_same_verdict_and_numbers_different_seed_different_vectors():
    rng = np.random.default_rng(0)
    A, B = floats(rng, 30, 40), floats(rng, 40, 20)
    C = A @ B
    C[3, 3] += np.float32(0.05)  # near the bound: the exact excess depends on the vectors
    first, again = verify(A, B, C, seed=SEED), verify(A, B, C, seed=SEED)
    assert first == again
    other = verify(A, B, C, seed=SEED[::-1])
    assert other.worst_excess != first.worst_excess
    assert not np.array_equal(sign_vectors(SEED, 40, 4), sign_vectors(SEED[::-1], 40, 4))


def test_result_fields_and_default_rounds():
    rng = np.random.default_rng(1)
    A, B = floats(rng, 4, 5), floats(rng, 5, 6)
    result = verify(A, B, A @ B)
    assert isinstance(result, VerifyResult)
    assert result.passed and result.reason == "ok" and result.worst_excess <= 0
    assert result.rounds == DEFAULT_ROUNDS["fp32"]
    assert result.false_accept_bound == 2.0 ** -result.rounds
    assert verify(A, B, A @ B, rounds=3).rounds == 3


def test_batched_matmul_with_broadcasting_matches_per_element_checks():
    rng = np.random.default_rng(2)
    A = floats(rng, 2, 1, 7, 5)
    B = floats(rng, 3, 5, 4)  # broadcasts against A's (2, 1) to batch (2, 3)
    C = A @ B
    assert C.shape == (2, 3, 7, 4)
    assert verify(A, B, C, seed=SEED).passed
    C[1, 2, 6, 0] += 10.0
    result = verify(A, B, C, seed=SEED)
    assert not result.passed and "row 6 of batch element (1, 2)" in result.reason
    alone = verify(A[1, 0], B[2], C[1, 2], seed=SEED)  # same vectors for every element
    assert alone.worst_excess == pytest.approx(result.worst_excess, rel=1e-6)


def test_batches_of_large_elements_are_checked_one_by_one_with_the_same_verdicts():
    rng = np.random.default_rng(6)
    A, B = floats(rng, 3, 150, 160), floats(rng, 3, 160, 170)  # above the stacking size
    C = A @ B
    assert verify(A, B, C, seed=SEED).passed
    C[2, 149, 3] -= 1e3
    result = verify(A, B, C, seed=SEED)
    assert not result.passed and "row 149 of batch element (2,)" in result.reason
    alone = verify(A[2], B[2], C[2], seed=SEED)
    assert alone.worst_excess == pytest.approx(result.worst_excess, rel=1e-6)


def test_batched_exact_mode():
    rng = np.random.default_rng(3)
    A = rng.integers(-100, 100, (4, 6, 5)).astype(np.int8)
    B = rng.integers(-100, 100, (5, 3)).astype(np.int8)
    C = A.astype(np.int64) @ B
    assert verify(A, B, C, precision="exact").passed
    C[2, 1, 1] -= 1
    C[3, 0, 0] += 1
    result = verify(A, B, C, precision="exact")
    assert not result.passed and result.worst_excess == 2
    assert "batch element (2,)" in result.reason


def test_verify_many_gives_one_result_per_triple():
    rng = np.random.default_rng(4)
    triples = [(floats(rng, m, 3), floats(rng, 3, m)) for m in (1, 2, 9)]
    triples = [(A, B, A @ B) for A, B in triples]
    triples[1] = (triples[1][0], triples[1][1], -triples[1][2] + 1)
    results = verify_many(triples, seed=SEED)
    assert [r.passed for r in results] == [True, False, True]
    assert verify_many(triples, seed=SEED) == results
    child = shake_stream(SEED, b"child:" + (1).to_bytes(8, "big"), 32)  # the documented seed
    assert verify(*triples[1], seed=child) == results[1]


@pytest.mark.parametrize("shapes, message", [
    (((3, 4), (5, 6), (3, 6)), "inner dimensions differ"),
    (((3, 4), (4, 6), (3, 5)), "C has shape"),
    (((2, 3, 4), (3, 4, 6), (2, 3, 6)), "do not broadcast"),
    (((3,), (3, 2), (2,)), "at least 2 dimensions"),
    (((0, 4), (4, 6), (0, 6)), "between 1 and"),
])
def test_inconsistent_shapes_are_named(shapes, message):
    A, B, C = (np.ones(s, np.float32) for s in shapes)
    with pytest.raises(ValueError, match=message):
        verify(A, B, C)


def test_wrong_dtypes_precision_rounds_and_seed_are_named():
    x = np.ones((2, 2), np.float32)
    with pytest.raises(TypeError, match="C is float64"):
        verify(x, x, x.astype(np.float64))
    with pytest.raises(TypeError, match="A is int32"):
        verify(x.astype(np.int32), x, x, precision="tf32")
    with pytest.raises(ValueError, match="precision must be one of"):
        verify(x, x, x, precision="fp16")
    with pytest.raises(ValueError, match="rounds must be between"):
        verify(x, x, x, rounds=0)
    with pytest.raises(TypeError, match="rounds must be an int"):
        verify(x, x, x, rounds=2.0)
    with pytest.raises(TypeError, match="seed must be bytes"):
        verify(x, x, x, seed="abc")
    with pytest.raises(ValueError, match="seed must not be empty"):
        verify(x, x, x, seed=b"")


@pytest.mark.parametrize("precision", ["fp32", "exact"])
def test_inputs_are_never_modified(precision):
    rng = np.random.default_rng(5)
    if precision == "exact":
        A = rng.integers(-9, 9, (2, 70, 40)).astype(np.int16)
        B = rng.integers(-9, 9, (40, 90)).astype(np.int16)
        C = A.astype(np.int64) @ B
    else:
        A, B = floats(rng, 2, 70, 40), floats(rng, 40, 90)
        C = A @ B
        C[0, 0, 0] = np.nan
    before = [x.tobytes() for x in (A, B, C)]
    for x in (A, B, C):
        x.setflags(write=False)
    verify(A, B, C, precision=precision)
    verify(A.transpose(0, 2, 1).copy().transpose(0, 2, 1), B[:, ::-1][:, ::-1], C,
           precision=precision)  # strided views work too
    assert [x.tobytes() for x in (A, B, C)] == before
