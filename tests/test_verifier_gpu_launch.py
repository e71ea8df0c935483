"""verifier.gpu_launch, the GPU exact check's host side compiled (csrc/verifier_gpu_launch.cc):
its key against verifier/rng.py on any machine; on a GPU its verdicts against the Python
path's (the same plan, launched and awaited from Python), alone and from several threads."""
import ctypes.util
import os
import threading

import numpy as np
import pytest

from verifier.rng import FIELD_KEY_DOMAIN, field_key, field_label

gpu_launch = pytest.importorskip("verifier.gpu_launch", reason="csrc/ was not built")


@pytest.mark.parametrize("n, rounds", [(1, 1), (4096, 1), (12345, 4), (2**28, 64)])
def test_field_key_equals_rng(n, rounds):
    """Seeds of every length up to three SHAKE128 rates (168 bytes) and past them, so that
    the message ends in every position of its last block, and on a block's edge."""
    rng = np.random.default_rng(n)
    for length in [*range(1, 3 * 168 + 2), 2000]:
        seed = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
        assert gpu_launch.field_key(FIELD_KEY_DOMAIN, seed, field_label(n, rounds)) == \
            field_key(seed, n, rounds), length


def test_refusals():
    with pytest.raises(TypeError, match="bytes"):
        gpu_launch.field_key(FIELD_KEY_DOMAIN, "seed", field_label(1, 1))
    with pytest.raises(TypeError, match="3 arguments"):
        gpu_launch.field_key(FIELD_KEY_DOMAIN, b"seed")
    with pytest.raises(TypeError, match="7 arguments"):
        gpu_launch.check(None)
    with pytest.raises((TypeError, ValueError)):  # not a launcher's capsule
        gpu_launch.check(object(), 0, 0, 0, b"seed", 0, 1)
    with pytest.raises(OverflowError):
        gpu_launch.launcher(*([-1] * 11), b"", b"", 0)


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is here")
def test_without_a_driver_a_launcher_is_a_clear_error():
    with pytest.raises(RuntimeError, match="cannot open the CUDA driver"):
        gpu_launch.launcher(*([0] * 11), b"", b"", 0)


def _device():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # CuPy without a usable GPU
        pytest.skip(f"no CUDA GPU: {err}")
    return cupy


def _operands(cupy, m, k, n, seed):
    rng = np.random.default_rng(seed)
    A = rng.integers(-128, 128, (m, k), dtype=np.int8)
    B = rng.integers(-128, 128, (k, n), dtype=np.int8)
    C = (A.astype(np.int64) @ B.astype(np.int64)).astype(np.int32)
    wrong = C.copy()
    wrong[m // 2, n - 1] += 1
    wrong[m - 1, 0] -= 7
    return [cupy.asarray(x) for x in (A, B, C, wrong)]


@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_compiled_and_python_paths_give_the_same_verdicts(rounds):
    cupy = _device()
    from verifier import gpu_exact

    A, B, C, wrong = _operands(cupy, 96, 200, 64, rounds)
    bounds, product_bound = (128, 2**31, 128), 200 * 2**14
    compiled = gpu_exact.plan_for(A, B, C, rounds, bounds, product_bound)
    assert compiled.launcher is not None
    python = compiled._replace(launcher=None)
    for seed in [b"s", os.urandom(32), os.urandom(500)]:
        for M, expected in [(C, (0, 0)), (wrong, (2, 48))]:
            assert gpu_exact.check(compiled, A, B, M, seed) == expected
            assert gpu_exact.check(python, A, B, M, seed) == expected


def test_compiled_checks_from_threads_keep_their_own_verdicts():
    """Checks of honest and wrong results from four threads at once (the GIL released while
    one waits for its kernel): each gets its own verdict."""
    cupy = _device()
    from verifier import verify

    A, B, C, wrong = _operands(cupy, 128, 256, 96, 7)
    failures = []

    def run(index):
        with cupy.cuda.Device(0):
            for i in range(50):
                honest = (index + i) % 2 == 0
                result = verify(A, B, C if honest else wrong, precision="exact",
                                seed=bytes([index, i]))
                if result.passed != honest or (not honest and result.worst_excess != 2):
                    failures.append((index, i, result))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures and not any(t.is_alive() for t in threads)
