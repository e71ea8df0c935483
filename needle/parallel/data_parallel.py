"""Data parallelism: one model replica per rank, gradients averaged by bucketed allreduce.

    model = DataParallel(MyModel())                 # rank 0's weights go to every rank
    opt = ndl.optim.SGD(model.parameters(), lr=0.1)
    x, y = model.shard(x_batch), model.shard(y_batch)
    opt.reset_grad()
    loss = loss_fn(model(ndl.Tensor(x)), ndl.Tensor(y))
    model.backward(loss, model.local_fraction(len(x_batch)))  # backward + allreduce
    opt.step()                                      # identical update on every rank

`local_fraction` weights each rank's shard-mean gradient by its share of the batch; the
default, 1/N, is right only when N divides the batch. Run under `mpiexec -n N python
train.py` (or `python -m needle.parallel.launch`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

import needle as ndl
from needle.nn import BatchNorm1d, Module, Parameter

from .comm import Communicator


@dataclass
class Bucket:
    """Parameters whose gradients travel together in one flat buffer."""

    params: list[Parameter]
    offsets: list[int]
    size: int


_NORM_STATS = ("running_mean", "running_var")


@dataclass
class _Sync:
    """One step's synchronisation in flight: how far each bucket is packed, what was started."""

    scale: float
    unpacked: list[int]  # per bucket, gradients not yet packed
    launched: int = 0  # buckets 0..launched-1 have their allreduce started
    packed: set[int] = field(default_factory=set)  # ids of parameters packed this step
    requests: list = field(default_factory=list)


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
        overlap: bool = False,
    ):
        """`check_finite` refuses NaN/inf gradients (see `sync_gradients`); on a GPU the check
        waits for the allreduce every step, which keeps ranks from running ahead of each other.
        `overlap` starts each bucket's allreduce inside `backward` as soon as its gradients are
        final, instead of after backward: worth it where the allreduce takes a real share of the
        step; on 2 NVLink GPUs it was measured slower (bench/RESULTS.md)."""
        super().__init__()
        self.module = module
        self.comm = comm if comm is not None else Communicator()
        self.check_finite = check_finite
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        params = module.parameters()
        self._check_same_architecture(params)
        # rounded up: a tiny positive size (one bucket per parameter) must not become 0 bytes
        self._buckets = plan_buckets(params, math.ceil(bucket_mb * 2**20))
        self._buffers = [self.comm.zeros(bucket.size) for bucket in self._buckets]
        self._place = {
            id(param): (k, offset)
            for k, bucket in enumerate(self._buckets)
            for param, offset in zip(bucket.params, bucket.offsets, strict=True)
        }
        # the wrapped module itself may be the BatchNorm: children() leaves it out
        self._norms = [m for m in (module, *module.children()) if isinstance(m, BatchNorm1d)]
        self._stats = self.comm.zeros(2 * sum(m.dim for m in self._norms))
        self._sync: _Sync | None = None  # set while gradients are being synchronised
        if overlap:
            for param in params:
                param.register_grad_ready_hook(self._grad_ready)
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
        """Overwrite every rank's weights and BatchNorm statistics with root's."""
        for param in self.module.parameters():
            buf = np.ascontiguousarray(param.numpy())
            self.comm.broadcast_(buf, root=root)
            param.data = ndl.Tensor(buf, device=param.device)
        for norm in self._norms:
            for name in _NORM_STATS:
                buf = np.ascontiguousarray(getattr(norm, name).numpy())
                self.comm.broadcast_(buf, root=root)
                setattr(norm, name, ndl.Tensor(buf, device=norm.weight.device, requires_grad=False))

    def backward(self, loss: ndl.Tensor, local_fraction: float | None = None) -> None:
        """`loss.backward()`, then the gradient allreduce (overlapped with backward if `overlap`);
        `loss` is the mean over the local shard. Returns with every gradient (and BatchNorm
        statistic) synchronised."""
        self._start(local_fraction)
        try:
            loss.backward()
            self._finish()
        finally:
            self._sync = None

    def sync_gradients(self, local_fraction: float | None = None) -> None:
        """Replace each gradient by the global-batch gradient, after a plain `loss.backward()`.

        Each rank's gradient is of the mean loss over its shard; weighting it by the
        shard's share of the batch (1/size for equal shards) and summing over ranks
        gives the gradient of the mean loss over the whole batch. BatchNorm running
        statistics are averaged with the same weights.
        """
        self._start(local_fraction)
        try:
            self._finish()
        finally:
            self._sync = None

    def _start(self, local_fraction: float | None) -> None:
        """Begin a step's synchronisation; BatchNorm statistics (final since forward) go first."""
        scale = 1.0 / self.comm.size if local_fraction is None else float(local_fraction)
        if not 0.0 <= scale <= 1.0:
            raise ValueError(f"local_fraction must lie in [0, 1], got {local_fraction}")
        self._sync = _Sync(scale, [len(b.params) for b in self._buckets])
        if self._norms:
            for name, norm, view in self._stat_views():
                self.comm.pack(getattr(norm, name).realize_cached_data(), view, scale)
            self._sync.requests.append(self.comm.iallreduce_sum_(self._stats))

    def _grad_ready(self, param: Parameter) -> None:
        """Grad-ready hook: pack the gradient; start every bucket that is now full, in order."""
        sync = self._sync
        if sync is None:  # a backward outside DataParallel.backward
            return
        k, offset = self._place[id(param)]
        self._pack(param, self._buffers[k][offset : offset + _numel(param)])
        sync.unpacked[k] -= 1
        while sync.launched < len(self._buckets) and sync.unpacked[sync.launched] == 0:
            sync.requests.append(self.comm.iallreduce_sum_(self._buffers[sync.launched]))
            sync.launched += 1
        self.comm.progress(sync.requests)

    def _pack(self, param: Parameter, view) -> None:
        if param.grad is None:  # unused this step: contributes nothing
            view[...] = 0
        else:
            self.comm.pack(param.grad.realize_cached_data(), view, self._sync.scale)
        self._sync.packed.add(id(param))

    def _finish(self) -> None:
        """Start the buckets backward did not fill (in order), wait for all, unpack."""
        sync = self._sync
        for k in range(sync.launched, len(self._buckets)):
            bucket, buffer = self._buckets[k], self._buffers[k]
            for param, offset in zip(bucket.params, bucket.offsets, strict=True):
                if id(param) not in sync.packed:
                    self._pack(param, buffer[offset : offset + _numel(param)])
            sync.requests.append(self.comm.iallreduce_sum_(buffer))
        self.comm.wait_all(sync.requests)
        for name, norm, view in self._stat_views():
            stat = self.comm.unpack(view, (norm.dim,), norm.weight.device)
            setattr(norm, name, ndl.Tensor(stat, requires_grad=False))
        if self.check_finite:
            self._refuse_non_finite()
        for bucket, buffer in zip(self._buckets, self._buffers, strict=True):
            for param, offset in zip(bucket.params, bucket.offsets, strict=True):
                view = buffer[offset : offset + _numel(param)]
                grad = self.comm.unpack(view, param.shape, param.device)
                param.grad = ndl.Tensor(grad, requires_grad=False)

    def _stat_views(self):
        """(attribute, BatchNorm module, its slice of the statistics buffer) for each statistic."""
        offset = 0
        for norm in self._norms:
            for name in _NORM_STATS:
                yield name, norm, self._stats[offset : offset + norm.dim]
                offset += norm.dim

    def _refuse_non_finite(self) -> None:
        """Refuse summed gradients with NaN or inf before they reach any parameter.

        Every rank holds the same sums, so every rank raises together and the
        replicas stay identical (and unchanged) either way.
        """
        if self.comm.all_finite(self._buffers):
            return
        index = {id(p): i for i, p in enumerate(self.module.parameters())}
        bad = [
            index[id(param)]
            for bucket, buffer in zip(self._buckets, self._buffers, strict=True)
            for param, offset in zip(bucket.params, bucket.offsets, strict=True)
            if not self.comm.all_finite([buffer[offset : offset + _numel(param)]])
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
