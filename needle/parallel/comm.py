"""Communication between ranks: MPI (mpi4py) for host buffers, NCCL (CuPy) for GPU buffers.

Everything here moves numpy arrays (or CuPy arrays for NCCL); the parallel
wrappers convert needle Tensors at their edges, so this file knows nothing
about autograd.
"""
from __future__ import annotations

import os
import pickle
import sys
import time
from typing import Any

import numpy as np

from needle.backend_ndarray import NDArray

SPIN_S = 0.05  # how long a wait polls without pausing
ABORT_GRACE_S = 0.5  # a dying rank waits this long before it aborts the job: its output out


class Communicator:
    """A group of ranks exchanging numpy buffers over MPI.

    Works unchanged in a plain `python` process (a singleton world of size 1),
    so code written for `mpiexec -n N` runs without the launcher too. Every wait (the
    gradient allreduce, broadcasts, object collectives, the barrier, pipeline messages)
    gives up with a TimeoutError after `timeout_s` (None: never), so a peer that exited
    or is stuck cannot hold this rank forever.
    """

    def __init__(self, mpi_comm: Any = None, timeout_s: float | None = 1800.0):
        from mpi4py import MPI  # imported here: importing needle must not start MPI

        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive or None, got {timeout_s}")
        self._mpi = MPI
        self.comm = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
        self.timeout_s = timeout_s
        if MPI.COMM_WORLD.Get_size() > 1:
            _abort_job_on_uncaught_exception(MPI)

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    def iallreduce_sum_(self, buf: np.ndarray) -> Any:
        """Start summing `buf` over all ranks in place; returns a request with `.Wait()`."""
        return self.comm.Iallreduce(self._mpi.IN_PLACE, _contiguous(buf), op=self._mpi.SUM)

    def progress(self, requests: list) -> None:
        """Let MPI move started transfers along (MPICH advances them only inside MPI calls)."""
        self._mpi.Request.Testall(requests)

    def wait_all(self, requests: list, what: str = "the gradient allreduce") -> None:
        """Wait for started transfers, at most `timeout_s`."""
        self._poll(lambda: self._mpi.Request.Testall(requests), what)

    def _poll(self, done, what: str) -> None:
        """Call `done()` until it is true; TimeoutError, naming `what`, after `timeout_s`.
        Busy for the first SPIN_S, as MPI's own Wait (MPICH moves transfers along only inside
        MPI calls: a sleep between them would slow every step's allreduce), then pausing up
        to 1 ms between calls, so a rank waiting long for a slow peer does not burn a core."""
        start = time.monotonic()
        deadline = None if self.timeout_s is None else start + self.timeout_s
        pause = 1e-5
        while not done():
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise TimeoutError(
                    f"rank {self.rank} of {self.size}: {what} did not finish within "
                    f"{self.timeout_s} s; a peer rank has exited, died or is stuck"
                )
            if now - start > SPIN_S:
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)

    def broadcast_(self, buf: np.ndarray, root: int = 0) -> None:
        """Overwrite `buf` on every rank with root's copy."""
        request = self.comm.Ibcast(_contiguous(buf), root=root)
        self.wait_all([request], f"the broadcast from rank {root}")

    def send(self, array: np.ndarray, dest: int, tag: int = 0) -> None:
        """Send an array of any shape and dtype; the receiver learns both from a header."""
        array = np.ascontiguousarray(array)
        header = self.comm.isend((array.shape, array.dtype.str), dest=dest, tag=tag)
        data = self.comm.Isend(array, dest=dest, tag=tag)
        self.wait_all([header, data], f"a message to rank {dest}")

    def recv(self, source: int, tag: int = 0) -> np.ndarray:
        """Receive what `send` sent, waiting at most `timeout_s` for it to arrive."""
        self._poll(
            lambda: self.comm.Iprobe(source=source, tag=tag), f"a message from rank {source}"
        )
        shape, dtype = self.comm.recv(source=source, tag=tag)
        array = np.empty(shape, dtype=np.dtype(dtype))
        self.wait_all([self.comm.Irecv(array, source=source, tag=tag)], f"data from rank {source}")
        return array

    def allgather_objects(self, obj: Any) -> list:
        """Every rank's picklable `obj`, in rank order (unpickled copies, as mpi4py's allgather
        gives). Non-blocking MPI under `timeout_s`: the pickles' sizes, then their bytes."""
        payload = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        sizes = np.empty(self.size, dtype=np.int64)
        request = self.comm.Iallgather(np.array([len(payload)], dtype=np.int64), sizes)
        self.wait_all([request], "the object allgather (sizes)")
        counts = [int(n) for n in sizes]
        offsets = [sum(counts[:k]) for k in range(self.size)]
        gathered = bytearray(sum(counts))
        request = self.comm.Iallgatherv(
            [payload, self._mpi.BYTE], [gathered, (counts, offsets), self._mpi.BYTE]
        )
        self.wait_all([request], "the object allgather")
        return [pickle.loads(gathered[o : o + n]) for o, n in zip(offsets, counts, strict=True)]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Root's picklable `obj` on every rank (an unpickled copy on root too, as mpi4py's
        bcast gives). Non-blocking MPI under `timeout_s`: the pickle's size, then its bytes."""
        payload = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL) if self.rank == root else b""
        size = np.array([len(payload)], dtype=np.int64)
        what = f"the object broadcast from rank {root}"
        self.wait_all([self.comm.Ibcast(size, root=root)], what + " (size)")
        data = bytearray(payload) if self.rank == root else bytearray(int(size[0]))
        self.wait_all([self.comm.Ibcast([data, self._mpi.BYTE], root=root)], what)
        return pickle.loads(data)

    # Gradient buckets live in host memory: packing copies each gradient out of its device.
    def zeros(self, n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    def pack(self, grad: NDArray, view: np.ndarray, scale: float) -> None:
        np.multiply(grad.numpy().reshape(-1), scale, out=view)

    def unpack(self, view: np.ndarray, shape: tuple[int, ...], device) -> NDArray:
        return NDArray(view.reshape(shape), device=device)

    def write(self, view: np.ndarray, values: np.ndarray) -> None:
        """Copy host float32 values into a slice of a bucket."""
        view[...] = values

    def read(self, view: np.ndarray) -> np.ndarray:
        """A slice of a bucket in host memory (here it already is)."""
        return view

    def all_finite(self, bufs: list[np.ndarray]) -> bool:
        return all(np.isfinite(buf).all() for buf in bufs)

    def barrier(self) -> None:
        """Wait until every rank got here, at most `timeout_s`."""
        self.wait_all([self.comm.Ibarrier()], "the barrier")


class NcclCommunicator:
    """Allreduce of GPU buffers with NCCL through CuPy; MPI hands out the NCCL id.

    Gradient buckets stay on the GPU: packing and unpacking are device copies into
    and out of needle's CUDA buffers, viewed by CuPy without copying, on the legacy
    default stream that needle's kernels use. NCCL runs on a stream of its own that
    does not wait for that one, so a bucket's allreduce overlaps the rest of backward;
    CUDA events order it after its packing and before the unpacking. One GPU per rank:
    start each rank with its own CUDA_VISIBLE_DEVICES (see `select_gpu_for_rank`).
    """

    def __init__(self, host: Communicator | None = None):
        import cupy
        from cupy.cuda import nccl

        self.host = host if host is not None else Communicator()
        self.cupy, self.nccl = cupy, nccl
        visible = cupy.cuda.runtime.getDeviceCount()
        if self.host.size > 1 and visible != 1:
            raise RuntimeError(
                f"rank {self.host.rank} sees {visible} GPUs; needle's CUDA backend uses the "
                "first, so pin one GPU per rank with select_gpu_for_rank() before using CUDA"
            )
        uid = nccl.get_unique_id() if self.host.rank == 0 else None
        uid = self.host.broadcast_object(uid, root=0)
        self.comm = nccl.NcclCommunicator(self.host.size, uid, self.host.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    @property
    def rank(self) -> int:
        return self.host.rank

    @property
    def size(self) -> int:
        return self.host.size

    def broadcast_(self, buf: np.ndarray, root: int = 0) -> None:
        self.host.broadcast_(buf, root)

    def allgather_objects(self, obj: Any) -> list:
        return self.host.allgather_objects(obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.host.broadcast_object(obj, root)

    def barrier(self) -> None:
        self.host.barrier()

    def iallreduce_sum_(self, buf: Any) -> Any:
        """Enqueue an in-place sum of a float32 CuPy array on NCCL's stream, after the kernels
        already enqueued on the default stream; `.Wait()` orders later default-stream kernels
        after it. The host never blocks."""
        packed = self.cupy.cuda.Event(disable_timing=True)
        packed.record(self.cupy.cuda.Stream.null)
        self.stream.wait_event(packed)
        self.comm.allReduce(
            buf.data.ptr, buf.data.ptr, buf.size, self.nccl.NCCL_FLOAT32, self.nccl.NCCL_SUM,
            self.stream.ptr,
        )
        reduced = self.cupy.cuda.Event(disable_timing=True)
        reduced.record(self.stream)
        return _StreamEvent(reduced)

    def progress(self, requests: list) -> None:
        """Nothing to do: NCCL's kernels make their own progress."""

    def wait_all(self, requests: list, what: str = "the gradient allreduce") -> None:
        """Order the default stream after the requests; the host does not block here."""
        for request in requests:
            request.Wait()

    def zeros(self, n: int) -> Any:
        return self.cupy.zeros(n, dtype=self.cupy.float32)

    def pack(self, grad: NDArray, view: Any, scale: float) -> None:
        self.cupy.multiply(self._view(grad).reshape(-1), scale, out=view)

    def unpack(self, view: Any, shape: tuple[int, ...], device) -> NDArray:
        out = NDArray.make(tuple(shape), device=device)
        self._view(out)[...] = view.reshape(shape)
        return out

    def write(self, view: Any, values: np.ndarray) -> None:
        """An asynchronous host-to-device copy on the default stream, so ordered before the
        allreduce like the packing; the host does not wait (the source is staged at once)."""
        view.set(values, stream=self.cupy.cuda.Stream.null)

    def read(self, view: Any) -> np.ndarray:
        """One blocking device-to-host copy: waits for the allreduce (see `wait_all`)."""
        return self.cupy.asnumpy(view)

    def all_finite(self, bufs: list) -> bool:
        """One read-back from the device for all buffers."""
        flags = [self.cupy.isfinite(buf).all() for buf in bufs]
        return bool(self.cupy.stack(flags).all())

    def _view(self, array: NDArray) -> Any:
        """A CuPy array over a needle CUDA array's memory (no copy)."""
        array = array.compact()
        memory = self.cupy.cuda.UnownedMemory(array.handle.ptr(), array.size * 4, array.handle)
        pointer = self.cupy.cuda.MemoryPointer(memory, array.offset * 4)
        return self.cupy.ndarray(array.shape, dtype=self.cupy.float32, memptr=pointer)


class _StreamEvent:
    """Request of work on another CUDA stream: waiting orders the default stream after it."""

    def __init__(self, event: Any):
        self.event = event

    def Wait(self) -> None:  # noqa: N802 (mpi4py's spelling)
        import cupy

        cupy.cuda.Stream.null.wait_event(self.event)


def _abort_job_on_uncaught_exception(mpi: Any) -> None:
    """Make a rank that dies of an exception abort the whole job, as `python -m mpi4py` does.

    Under a plain `mpiexec -n N python train.py` the other ranks would otherwise wait in
    their next collective forever. The traceback is printed first; installed once.
    """
    previous = sys.excepthook
    if getattr(previous, "_needle_aborts", False):
        return

    def hook(kind, value, traceback) -> None:
        previous(kind, value, traceback)
        sys.stderr.flush()
        # the launcher relays a rank's output through its own pipes, and an abort kills the
        # job at once: on a loaded machine the traceback was cut short (a CI run)
        time.sleep(ABORT_GRACE_S)
        mpi.COMM_WORLD.Abort(1)

    hook._needle_aborts = True
    sys.excepthook = hook


def select_gpu_for_rank() -> int:
    """Pin this process to one GPU (its rank on the node) before any CUDA work starts.

    Reads the launcher's environment (MPICH/Hydra or Open MPI) and narrows
    CUDA_VISIBLE_DEVICES to one GPU, so call it before the first `ndl.cuda()`;
    returns the local rank.
    """
    local_rank = int(
        os.environ.get("MPI_LOCALRANKID")
        or os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK")
        or os.environ.get("PMI_RANK")
        or 0
    )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if visible == [""]:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(local_rank)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[local_rank % len(visible)]
    return local_rank


def nccl_available() -> bool:
    """True when CuPy with NCCL and at least one GPU can be used."""
    try:
        import cupy
        from cupy.cuda import nccl  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _contiguous(buf: np.ndarray) -> np.ndarray:
    if not (isinstance(buf, np.ndarray) and buf.flags.c_contiguous):
        raise ValueError("communication buffers must be C-contiguous numpy arrays")
    return buf
