"""Data parallelism: one model replica per rank, gradients averaged by bucketed allreduce.

    model = DataParallel(MyModel())                 # rank 0's weights go to every rank
    opt = ndl.optim.SGD(model.parameters(), lr=0.1)
    x, y = model.shard(x_batch), model.shard(y_batch)
    opt.reset_grad()
    model.backward(loss_fn(model(ndl.Tensor(x)), ndl.Tensor(y)))   # backward + allreduce
    opt.step()                                      # identical update on every rank

Run under `mpiexec -n N python train.py` (or `python -m needle.parallel.launch`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import needle as ndl
from needle.nn import Module, Parameter

from .comm import Communicator


@dataclass
class Bucket:
    """Parameters whose gradients travel together in one flat buffer."""

    params: list[Parameter]
    offsets: list[int]
    size: int


def plan_buckets(params: list[Parameter], bucket_bytes: int) -> list[Bucket]:
    """Group parameters, in reverse order (the order backward finishes them), into buckets.

    A bucket closes once it holds at least `bucket_bytes` of float32 gradients.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    buckets: list[Bucket] = []
    pending: list[Parameter] = []
    for param in reversed(params):
        pending.append(param)
        if sum(_numel(p) for p in pending) * 4 >= bucket_bytes:
            buckets.append(_make_bucket(pending))
            pending = []
    if pending:
        buckets.append(_make_bucket(pending))
    return buckets


def _numel(param: Parameter) -> int:
    return math.prod(param.shape)


def _make_bucket(params: list[Parameter]) -> Bucket:
    offsets = [0]
    for p in params[:-1]:
        offsets.append(offsets[-1] + _numel(p))
    return Bucket(list(params), offsets, offsets[-1] + _numel(params[-1]))


class DataParallel(Module):
    """Wraps a module so that every rank trains the same weights on its shard of each batch."""

    def __init__(
        self,
        module: Module,
        comm: Communicator | None = None,
        bucket_mb: float = 4.0,
        check_finite: bool = True,
    ):
        """`check_finite` refuses NaN/inf gradients (see `sync_gradients`); on a GPU the check
        waits for the allreduce every step, which keeps ranks from running ahead of each other."""
        super().__init__()
        self.module = module
        self.comm = comm if comm is not None else Communicator()
        self.check_finite = check_finite
        params = module.parameters()
        self._check_same_architecture(params)
        self._buckets = plan_buckets(params, int(bucket_mb * 2**20))
        self._buffers = [self.comm.zeros(bucket.size) for bucket in self._buckets]
        self.broadcast_parameters()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def shard(self, batch: np.ndarray) -> np.ndarray:
        """This rank's rows of a global batch (contiguous blocks, sizes differ by at most one)."""
        batch = np.asarray(batch)
        if batch.ndim == 0 or batch.shape[0] < self.comm.size:
            raise ValueError(
                f"a batch of shape {batch.shape} cannot be split over {self.comm.size} ranks"
            )
        return np.array_split(batch, self.comm.size)[self.comm.rank]

    def local_fraction(self, global_batch_size: int) -> float:
        """Share of a global batch that `shard` gives this rank (the first ranks get the extras)."""
        if global_batch_size < self.comm.size:
            raise ValueError(
                f"a batch of {global_batch_size} rows cannot be split over {self.comm.size} ranks"
            )
        base, extra = divmod(global_batch_size, self.comm.size)
        return (base + (self.comm.rank < extra)) / global_batch_size

    def broadcast_parameters(self, root: int = 0) -> None:
        """Overwrite every rank's weights with root's, so replicas start identical."""
        for param in self.module.parameters():
            buf = np.ascontiguousarray(param.numpy())
            self.comm.broadcast_(buf, root=root)
            param.data = ndl.Tensor(buf, device=param.device)

    def backward(self, loss: ndl.Tensor, local_fraction: float | None = None) -> None:
        """`loss.backward()`, then `sync_gradients`; `loss` is the mean over the local shard."""
        loss.backward()
        self.sync_gradients(local_fraction)

    def sync_gradients(self, local_fraction: float | None = None) -> None:
        """Replace each gradient by the global-batch gradient.

        Each rank's gradient is of the mean loss over its shard; weighting it by the
        shard's share of the batch (1/size for equal shards) and summing over ranks
        gives the gradient of the mean loss over the whole batch.

        Buckets are packed and their Iallreduce started one after another, so
        packing bucket k+1 overlaps the transfer of bucket k; needle's autograd has
        no per-gradient hook, so transfers start after backward, not during it.
        """
        scale = 1.0 / self.comm.size if local_fraction is None else float(local_fraction)
        if not 0.0 <= scale <= 1.0:
            raise ValueError(f"local_fraction must lie in [0, 1], got {local_fraction}")
        requests = []
        for bucket, buffer in zip(self._buckets, self._buffers, strict=True):
            for param, offset in zip(bucket.params, bucket.offsets, strict=True):
                view = buffer[offset : offset + _numel(param)]
                if param.grad is None:  # unused this step: contributes nothing
                    view[...] = 0
                else:
                    self.comm.pack(param.grad.realize_cached_data(), view, scale)
            requests.append(self.comm.iallreduce_sum_(buffer))
        for request in requests:
            request.Wait()
        if self.check_finite:
            self._refuse_non_finite()
        for bucket, buffer in zip(self._buckets, self._buffers, strict=True):
            for param, offset in zip(bucket.params, bucket.offsets, strict=True):
                view = buffer[offset : offset + _numel(param)]
                grad = self.comm.unpack(view, param.shape, param.device)
                param.grad = ndl.Tensor(grad, requires_grad=False)

    def _refuse_non_finite(self) -> None:
        """Refuse summed gradients with NaN or inf before they reach any parameter.

        Every rank holds the same sums, so every rank raises together and the
        replicas stay identical (and unchanged) either way.
        """
        if all(self.comm.all_finite(buffer) for buffer in self._buffers):
            return
        index = {id(p): i for i, p in enumerate(self.module.parameters())}
        bad = [
            index[id(param)]
            for bucket, buffer in zip(self._buckets, self._buffers, strict=True)
            for param, offset in zip(bucket.params, bucket.offsets, strict=True)
            if not self.comm.all_finite(buffer[offset : offset + _numel(param)])
        ]
        raise FloatingPointError(
            f"non-finite gradients (NaN or inf on some rank) for parameters {sorted(bad)} "
            "(indices into parameters()); gradients and weights left unchanged"
        )

    def _check_same_architecture(self, params: list[Parameter]) -> None:
        """Fail on every rank, naming the difference, if the replicas' parameters differ."""
        mine = [tuple(p.shape) for p in params]
        everyone = self.comm.allgather_objects(mine)
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                raise ValueError(
                    f"rank {rank} has parameters {theirs} but rank 0 has {everyone[0]}; "
                    "every rank must build the same model"
                )
