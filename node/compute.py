"""The worker's compute path: a job's matmul on the best device this machine has.

Float jobs run through needle's NDArray on `cuda`, else the C++ `cpu` backend,
else the numpy backend; integer (exact) jobs run in int64 numpy so the result
is exact. A job's operands are (batch, m, k) and (batch, k, n) or a shared
(k, n), or both 2-D when batch is 1 (docs/protocol.md).
"""

from __future__ import annotations

import os

import numpy as np

FLOAT_DTYPES = (np.float32,)
EXACT_DTYPES = (np.int8, np.int16, np.int32, np.int64)


def _needle_devices() -> list:
    try:
        import needle as ndl
    except Exception:  # noqa: BLE001 - needle core may be absent or half-built
        return []
    devices = []
    for make in ("cuda", "cpu", "cpu_numpy"):
        try:
            device = getattr(ndl, make)()
            if device.enabled():
                devices.append(device)
        except Exception:  # noqa: BLE001 - a backend module that fails to import is skipped
            continue
    return devices


def best_device():
    """The needle device float jobs run on, or None to use plain numpy.

    `NEEDLE_NET_DEVICE` (cuda, cpu, numpy) forces a choice.
    """
    wanted = os.environ.get("NEEDLE_NET_DEVICE")
    for device in _needle_devices():
        name = getattr(device, "name", "")
        if wanted is None or name == wanted or (wanted == "numpy" and "numpy" in name):
            return device
    return None


def device_name(device) -> str:
    return "numpy" if device is None else str(getattr(device, "name", device))


def _matmul_2d(a: np.ndarray, b: np.ndarray, device) -> np.ndarray:
    if device is None:
        return a @ b
    import needle as ndl

    out = ndl.NDArray(a, device=device) @ ndl.NDArray(b, device=device)
    return out.numpy()


def matmul(a: np.ndarray, b: np.ndarray, device=None) -> np.ndarray:
    """C = A @ B for a job's operands (2-D or batched 3-D with equal batch)."""
    if a.ndim not in (2, 3) or b.ndim not in (2, a.ndim):
        raise ValueError(f"operands must be 2-D, or 3-D A with 3-D or 2-D B, got {a.shape} "
                         f"and {b.shape}")
    if a.shape[-1] != b.shape[-2] or (b.ndim == 3 and a.shape[0] != b.shape[0]):
        raise ValueError(f"matmul shapes do not match: {a.shape} @ {b.shape}")
    if a.dtype.type in EXACT_DTYPES and b.dtype.type in EXACT_DTYPES:  # mixed ones too, as
        return np.matmul(a.astype(np.int64), b.astype(np.int64))  # the chain accepts them
    if a.dtype != b.dtype:
        raise ValueError(f"operand dtypes differ: {a.dtype} and {b.dtype}")
    if a.dtype.type not in FLOAT_DTYPES:
        raise ValueError(f"unsupported operand dtype {a.dtype}")
    if a.ndim == 2:
        return _matmul_2d(a, b, device).astype(np.float32, copy=False)
    bs = b if b.ndim == 3 else [b] * len(a)
    return np.stack([_matmul_2d(x, y, device) for x, y in zip(a, bs, strict=True)])


class OperandError(ValueError):
    """A job's operands do not match its declaration: the chain cancels such a job at
    finalisation (fee refunded, nobody paid), so a worker skips it instead of computing."""


def check_operands(a: np.ndarray, b: np.ndarray, dims: tuple[int, int, int, int],
                   exact: bool) -> None:
    """OperandError unless A and B are what the job declares (`dims` = batch, m, k, n;
    `exact`: precision class 0): the shapes, an integer dtype for exact jobs and float32
    for the others, finite floats. The same rules as the chain's check (docs/protocol.md)."""
    batch, m, k, n = dims
    _check_shape("A", a, [(batch, m, k)] + ([(m, k)] if batch == 1 else []))
    _check_shape("B", b, [(batch, k, n), (k, n)])
    wanted = EXACT_DTYPES if exact else FLOAT_DTYPES
    for name, array in (("A", a), ("B", b)):
        if array.dtype.type not in wanted:
            raise OperandError(f"{name} is {array.dtype}, the job's precision class needs "
                               f"{'an integer type' if exact else 'float32'}")
        if not exact and not np.isfinite(array).all():
            raise OperandError(f"{name} holds NaN or Inf")


def _check_shape(name: str, array: np.ndarray, allowed: list[tuple[int, ...]]) -> None:
    if array.shape not in allowed:
        raise OperandError(f"{name} has shape {array.shape}, the job declares "
                           f"{' or '.join(map(str, allowed))}")


def corrupt(c: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A wrong result for the test-only cheating worker: every entry perturbed."""
    noise = rng.integers(1, 4, size=c.shape).astype(c.dtype)
    return c + noise
