"""Remote matmuls: run selected MatMul ops as verified jobs on the needle-net network.

    network = needle.remote.Network()                 # the local dev network
    c = network.matmul(a, b)                          # numpy in, verified numpy out
    with needle.remote.offload(network, min_flops=1e6):
        loss = model(x) ...; loss.backward()          # big matmuls (forward and backward) go remote

MatMul.compute asks `active_offload()` for the current policy and calls its
`matmul(a, b)` on the NDArray operands; that returns None (compute locally) unless
the product is at least `min_flops`. Anything with a `matmul(a, b) -> np.ndarray` method can stand
in for the network (see `LocalExecutor`). This module imports `node` and `chain`
only when a `Network` is created, so needle core stays independent of them.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

DEFAULT_RPC_URL = "http://127.0.0.1:8545"
RPC_URL_ENV = "NEEDLE_NET_RPC"  # the chain node's URL where `rpc_url` is not given


class MatmulExecutor(Protocol):
    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray: ...


class LocalExecutor:
    """Runs offloaded matmuls in-process with numpy: the policy's reference executor."""

    def __init__(self) -> None:
        self.calls = 0

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        self.calls += 1
        return np.matmul(a, b)


def matmul_flops(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> int:
    """2 * batch * m * k * n for (..., m, k) @ (..., k, n) with broadcast leading dims."""
    lead = np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2]))
    batch = int(np.prod(lead)) if lead else 1
    m, k = a_shape[-2], a_shape[-1]
    return 2 * batch * m * k * b_shape[-1]


def _valid_operands(a, b) -> bool:
    """Whether NDArrays a @ b is a product the local matmul would compute."""
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2] or a.device != b.device:
        return False
    try:
        np.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2]))
    except ValueError:
        return False
    return True


@dataclass
class Offload:
    """The active policy: which matmuls go to `executor`, and counts of what went where."""

    executor: MatmulExecutor
    min_flops: float = 0.0
    offloaded: int = 0
    local: int = 0
    offloaded_flops: int = 0

    def matmul(self, a, b):
        """The product of NDArrays `a @ b` from the executor, or None to compute it locally.

        Operands the local product would refuse (under 2-D, inner or batch dimensions that do
        not match, different devices) are declined uncounted, so that it raises its usual
        error rather than the executor hiding or mis-reporting it; an empty product (no
        flops) stays local whatever min_flops is, as no job can hold an empty operand."""
        if not _valid_operands(a, b):
            return None
        flops = matmul_flops(tuple(a.shape), tuple(b.shape))
        if flops == 0 or flops < self.min_flops:
            self.local += 1
            return None
        c = self.product(a.numpy(), b.numpy())
        self.offloaded += 1
        self.offloaded_flops += flops
        from needle.backend_ndarray import NDArray

        return NDArray(c, device=a.device)

    def product(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """a @ b on the executor as one job in which no operand is repeated: a leading dim
        along which only `a` varies becomes rows of A, one along which only `b` varies
        columns of B, and one along which both vary the job's batch. (Broadcasting by
        copying would upload, and pay a worker to multiply, the same matrix many times.)"""
        lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        ndim = len(lead)
        a = a.reshape((1,) * (ndim + 2 - a.ndim) + a.shape)
        b = b.reshape((1,) * (ndim + 2 - b.ndim) + b.shape)
        both = [d for d in range(ndim) if a.shape[d] > 1 and b.shape[d] > 1]
        rows = [d for d in range(ndim) if a.shape[d] > 1 and b.shape[d] == 1]
        cols = [d for d in range(ndim) if a.shape[d] == 1 and b.shape[d] > 1]
        ones = [d for d in range(ndim) if a.shape[d] == 1 and b.shape[d] == 1]
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        batch, stacked, side = (math.prod(lead[d] for d in dims) for dims in (both, rows, cols))
        a_job = a.transpose(both + rows + cols + ones + [ndim, ndim + 1])
        b_job = b.transpose(both + rows + ones + [ndim] + cols + [ndim + 1])
        a_job, b_job = a_job.reshape(batch, stacked * m, k), b_job.reshape(batch, k, side * n)
        if batch == 1:
            a_job, b_job = a_job[0], b_job[0]
        job = self.executor.matmul(np.ascontiguousarray(a_job), np.ascontiguousarray(b_job))
        out = self._checked(job, a_job.shape[:-1] + b_job.shape[-1:])
        # back from (both, rows, m, cols, n) to (lead..., m, n)
        labels = both + rows + ["m"] + cols + ["n"] + ones
        out = out.reshape([lead[d] for d in both + rows] + [m] + [lead[d] for d in cols] + [n]
                          + [1] * len(ones))
        order = [labels.index(axis) for axis in [*range(ndim), "m", "n"]]
        return np.ascontiguousarray(out.transpose(order))

    def _checked(self, c, shape: tuple[int, ...]) -> np.ndarray:
        """The executor's result as float32 of exactly `shape`: reshaping one of another
        shape but the same size (a transposed product, say) would silently scramble it."""
        c = np.asarray(c, dtype=np.float32)
        if c.shape != tuple(shape):
            raise ValueError(
                f"offload executor {type(self.executor).__name__} returned an array of shape "
                f"{c.shape} for a product of shape {tuple(shape)}"
            )
        return c


_state = threading.local()


def active_offload() -> Offload | None:
    """The innermost active `offload` policy on this thread, or None."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def offload(executor: MatmulExecutor, min_flops: float = 0.0) -> Iterator[Offload]:
    """Within this block, MatMul ops of at least `min_flops` run on `executor`."""
    if not callable(getattr(executor, "matmul", None)):  # else it fails at the first matmul
        raise TypeError(f"executor {executor!r} has no matmul(a, b) method")
    if not float(min_flops) >= 0:  # NaN would silently send every matmul remote
        raise ValueError(f"min_flops must be a non-negative number, got {min_flops}")
    policy = Offload(executor, float(min_flops))
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(policy)
    try:
        yield policy
    finally:
        stack.pop()


class Network:
    """A connection to a needle-net chain node, submitting matmuls as paid, verified jobs.

    `key` is a private key (hex or bytes) or an eth-account LocalAccount; by default the
    first development account of the local dev network. `fee_wei` is paid per job,
    `timeout` (seconds) bounds each wait, and `local_check` re-runs Freivalds' check on
    the client as well as trusting the chain's verdict. `rpc_url` defaults to
    `$NEEDLE_NET_RPC`, else the local node (as the CLI's `--rpc-url`). With no chain node
    there it raises a ConnectionError that says how to start one.
    """

    def __init__(
        self,
        rpc_url: str | None = None,
        key=None,
        *,
        fee_wei: int | None = None,
        timeout: float = 120.0,
        local_check: bool = True,
        progress: bool = False,
    ) -> None:
        from chain.client import NotAChainNode
        from node.client import JobClient
        from node.market import is_transient

        if rpc_url is None:  # as the CLI's --rpc-url: the environment, else a local node
            rpc_url = os.environ.get(RPC_URL_ENV) or DEFAULT_RPC_URL
        try:
            self.client = JobClient(
                rpc_url, key, fee_wei=fee_wei, timeout=timeout, local_check=local_check,
                progress=progress,
            )
        except NotAChainNode as err:  # a web page, a 404, another service's JSON
            raise ConnectionError(str(err)) from err
        except Exception as err:
            if not is_transient(err):
                raise
            # a bare "Connection refused" names neither the URL nor what to do about it
            raise ConnectionError(
                f"cannot reach a needle-net chain node at {rpc_url} ({type(err).__name__}: "
                f"{err}): start one with `needle-net devnet up --workers 1`, or pass the URL "
                "of a running one as Network(rpc_url)") from err

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """A @ B (2-D, or 3-D batched) as one network job; returns the verified C."""
        return self.client.matmul(a, b)

    def matmul_batch(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """Many products submitted in one transaction; returns their verified results in order."""
        return self.client.matmul_batch(pairs)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
