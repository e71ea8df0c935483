"""Data parallelism: one model replica per rank, gradients averaged by bucketed allreduce.

    model = DataParallel(MyModel())                 # rank 0's weights go to every rank
    opt = ndl.optim.SGD(model.parameters(), lr=0.1)
    x, y = model.shard(x_batch), model.shard(y_batch)
    opt.reset_grad()
    loss = loss_fn(model(ndl.Tensor(x)), ndl.Tensor(y))
    model.backward(loss, model.local_fraction(len(x_batch)))  # backward + allreduce
    opt.step()                                      # identical update on every rank

`local_fraction` weights each rank's shard-mean gradient by its share of the batch; the
default, 1/N, is right only when N divides the batch, and the fractions must sum to 1 over
the ranks. A parameter that no rank used in a step keeps `grad` None, as in one process.
Run under `mpiexec -n N python train.py` (or `python -m needle.parallel.launch`).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

import needle as ndl
from needle.nn import BatchNorm1d, Module, Parameter

from .comm import Communicator
from .model_parallel import host_array


@dataclass
class Bucket:
    """Parameters whose gradients travel together in one flat buffer."""

    params: list[Parameter]
    offsets: list[int]
    size: int


_NORM_STATS = ("running_mean", "running_var")
# a rank without rows has no mean loss to take a gradient of (the losses refuse empty batches)
_NO_ROWS_HINT = ("; every rank needs a row (a data set's last batch: DataLoader(..., "
                 "drop_last=True) skips it)")
# how far the ranks' local_fraction may sum from 1, on top of the float32 rounding of that sum
# (at most size * 2**-24, which grows with the number of ranks)
_FRACTION_TOLERANCE = 1e-5


@dataclass
class _Sync:
    """One step's synchronisation in flight: how far each bucket is packed, what was started."""

    fraction: object  # this rank's local_fraction as given (1/size for None)
    scale: float  # the fraction as a float, NaN where it is refused
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


def _is_number(value: object) -> bool:
    """A real number (numpy's included); a bool, a string or a tensor is a caller's mistake."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


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
        # rounded up: a tiny positive size (one bucket per parameter) must not become 0 bytes
        bucket_bytes = math.ceil(bucket_mb * 2**20)
        self._check_same_layout(params, bucket_bytes, overlap)
        self._buckets = plan_buckets(params, bucket_bytes)
        # A bucket's buffer: its gradients, then a tail summed by the same allreduce: per
        # parameter 1 if this rank had a gradient for it (the sum counts the ranks that had
        # one), then this rank's local_fraction (the sum must be 1; bucket 0's is checked).
        self._buffers = [self.comm.zeros(b.size + len(b.params) + 1) for b in self._buckets]
        self._tails = [np.zeros(len(b.params) + 1, np.float32) for b in self._buckets]
        self._place = {
            id(param): (k, j, offset)
            for k, bucket in enumerate(self._buckets)
            for j, (param, offset) in enumerate(zip(bucket.params, bucket.offsets, strict=True))
        }
        self._stats = self.comm.zeros(2 * sum(m.dim for m in self._norms))
        self._sync: _Sync | None = None  # set while gradients are being synchronised
        if overlap:
            for param in params:
                param.register_grad_ready_hook(self._grad_ready)
        self.broadcast_parameters()

    @property
    def _norms(self) -> list[BatchNorm1d]:
        """The wrapped module's BatchNorm layers (it may be one itself: children() leaves it out).
        Found on each use, not kept in an attribute: Module's walk over attributes would put
        each of them into state_dict() a second time, under a name the bare model lacks."""
        return [m for m in (self.module, *self.module.children()) if isinstance(m, BatchNorm1d)]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def shard(self, batch: np.ndarray | ndl.Tensor) -> np.ndarray:
        """This rank's rows of a global batch (contiguous blocks, sizes differ by at most one),
        given as numpy or as a Tensor (a DataLoader's batch)."""
        batch = host_array(batch)
        if batch.ndim == 0 or batch.shape[0] < self.comm.size:
            raise ValueError(
                f"a batch of shape {batch.shape} cannot be split over {self.comm.size} ranks"
                f"{_NO_ROWS_HINT}"
            )
        return np.array_split(batch, self.comm.size)[self.comm.rank]

    def local_fraction(self, global_batch_size: int) -> float:
        """Share of a global batch that `shard` gives this rank (the first ranks get the extras)."""
        if global_batch_size < self.comm.size:
            raise ValueError(
                f"a batch of {global_batch_size} rows cannot be split over {self.comm.size} "
                f"ranks{_NO_ROWS_HINT}"
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
        statistic) synchronised; a parameter that no rank used keeps `grad` None."""
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
        gives the gradient of the mean loss over the whole batch; the weights must sum
        to 1 (ValueError on every rank otherwise). A rank without a gradient for a
        parameter adds zeros; if no rank had one, `grad` stays None. BatchNorm running
        statistics are averaged with the same weights.
        """
        self._start(local_fraction)
        try:
            self._finish()
        finally:
            self._sync = None

    def _start(self, local_fraction: float | None) -> None:
        """Begin a step's synchronisation; BatchNorm statistics (final since forward) go first.

        A bad `local_fraction` (not a number, or outside [0, 1]) is not refused here but after
        the allreduce: it travels as NaN and makes the summed fraction NaN, so that every rank
        raises and none is left waiting in the collective."""
        fraction = 1.0 / self.comm.size if local_fraction is None else local_fraction
        scale = float(fraction) if _is_number(fraction) and 0.0 <= fraction <= 1.0 else math.nan
        self._sync = _Sync(fraction, scale, [len(b.params) for b in self._buckets])
        for tail in self._tails:
            tail[-1] = scale
        if self._norms:
            for name, norm, view in self._stat_views():
                self.comm.pack(getattr(norm, name).realize_cached_data(), view, scale)
            self._sync.requests.append(self.comm.iallreduce_sum_(self._stats))

    def _grad_ready(self, param: Parameter) -> None:
        """Grad-ready hook: pack the gradient; start every bucket that is now full, in order."""
        sync = self._sync
        if sync is None:  # a backward outside DataParallel.backward
            return
        self._pack(param)
        sync.unpacked[self._place[id(param)][0]] -= 1
        while sync.launched < len(self._buckets) and sync.unpacked[sync.launched] == 0:
            self._launch(sync.launched)
        self.comm.progress(sync.requests)

    def _pack(self, param: Parameter) -> None:
        k, j, offset = self._place[id(param)]
        view = self._buffers[k][offset : offset + _numel(param)]
        if param.grad is None:  # unused on this rank this step: contributes zeros
            view[...] = 0
        else:
            self.comm.pack(param.grad.realize_cached_data(), view, self._sync.scale)
        self._tails[k][j] = param.grad is not None
        self._sync.packed.add(id(param))

    def _launch(self, k: int) -> None:
        """Start bucket k's allreduce, its tail (counts and fraction) copied in behind the
        gradients; buckets must start in order, the same on every rank."""
        bucket, buffer = self._buckets[k], self._buffers[k]
        self.comm.write(buffer[bucket.size :], self._tails[k])
        self._sync.requests.append(self.comm.iallreduce_sum_(buffer))
        self._sync.launched += 1

    def _finish(self) -> None:
        """Start the buckets backward did not fill (in order), wait for all, check the summed
        fractions, unpack; a parameter that no rank had a gradient for keeps `grad` None."""
        sync = self._sync
        for k in range(sync.launched, len(self._buckets)):
            for param in self._buckets[k].params:
                if id(param) not in sync.packed:
                    self._pack(param)
            self._launch(k)
        self.comm.wait_all(sync.requests)
        counts = self._reduced_counts()
        for name, norm, view in self._stat_views():
            stat = self.comm.unpack(view, (norm.dim,), norm.weight.device)
            setattr(norm, name, ndl.Tensor(stat, requires_grad=False))
        if self.check_finite:
            self._refuse_non_finite()
        for k, (bucket, buffer) in enumerate(zip(self._buckets, self._buffers, strict=True)):
            for j, (param, offset) in enumerate(zip(bucket.params, bucket.offsets, strict=True)):
                if counts[k][j] == 0:  # no rank used it: optimisers skip it, as in one process
                    param.grad = None
                    continue
                view = buffer[offset : offset + _numel(param)]
                grad = self.comm.unpack(view, param.shape, param.device)
                param.grad = ndl.Tensor(grad, requires_grad=False)

    def _reduced_counts(self) -> list[np.ndarray]:
        """Per bucket, how many ranks had a gradient for each parameter; refuses fractions
        that do not sum to 1 first. A GPU buffer is read back (waiting for its allreduce) only
        where needed: bucket 0 for the fraction, and buckets where this rank lacked a gradient
        (elsewhere every count is at least this rank's own 1)."""
        counts = [
            self.comm.read(buffer[bucket.size :]) if k == 0 or not tail[:-1].all() else tail
            for k, (bucket, buffer, tail) in enumerate(
                zip(self._buckets, self._buffers, self._tails, strict=True)
            )
        ]
        if counts:
            self._check_fractions(float(counts[0][-1]))
        return counts

    def _check_fractions(self, total: float) -> None:
        """Refuse fractions outside [0, 1] or not summing to 1 (they would rescale the gradient
        silently). Every rank holds the same sum, so every rank raises, before anything
        (gradients, BatchNorm statistics) is replaced."""
        fraction, size = self._sync.fraction, self.comm.size
        if not _is_number(fraction):
            raise ValueError(
                f"local_fraction must be a number in [0, 1], got {type(fraction).__name__} "
                f"{fraction!r}; no gradient was synchronised"
            )
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"local_fraction must lie in [0, 1], got {fraction}")
        if math.isnan(total):  # what a rank whose fraction is refused adds
            raise ValueError(
                f"local_fraction lies outside [0, 1] on another of the {size} ranks; "
                "no gradient was synchronised"
            )
        if not abs(total - 1.0) <= _FRACTION_TOLERANCE + size * 2.0**-24:
            raise ValueError(
                f"local_fraction summed over the {size} ranks is {total:.7g}, not 1; pass each "
                "rank its share of the global batch (model.local_fraction(batch size)); "
                "no gradient was synchronised"
            )

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

    def _check_same_layout(self, params: list[Parameter], bucket_bytes: int,
                           overlap: bool) -> None:
        """Fail on every rank, naming the difference, if the replicas differ in what shapes
        their collectives: the parameters, the gradient buckets, the batch norms' statistics,
        the order of the allreduces. Collectives that do not match are undefined in MPI: a
        false error or a timeout steps later, not this."""
        mine = {"parameters": [tuple(p.shape) for p in params], "bucket bytes": bucket_bytes,
                "overlap": overlap, "BatchNorm channels": [m.dim for m in self._norms]}
        everyone = self.comm.allgather_objects(mine)
        for rank, theirs in enumerate(everyone):
            for what, value in theirs.items():
                if value != everyone[0][what]:
                    raise ValueError(
                        f"rank {rank} has {what} {value} but rank 0 has {everyone[0][what]}; "
                        "every rank must build the same model with the same DataParallel "
                        "options")
