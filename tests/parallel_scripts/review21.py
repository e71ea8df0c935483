"""Run under mpiexec: the review-21 cases of needle.parallel (see tests/test_parallel_review21.py).

    objects OUT   (3 ranks) object allgather/broadcast and the barrier; then rank 0 leaves and
                  ranks 1 and 2 must get a TimeoutError from each, not wait forever
    unused OUT    (2 ranks) a branch only rank 0 uses and one no rank uses, three sync modes
    fraction OUT  (2 ranks) local_fraction values that do not sum to 1, or lie out of range
"""
import json
import pickle
import sys

import numpy as np

import needle as ndl
from needle import nn
from needle.parallel import Communicator, DataParallel

CPU = ndl.cpu()
IN, OUT, BATCH = 4, 3, 5
# (mode, bucket_mb): one bucket, or one per parameter; overlap on, off, and on with a plain
# loss.backward() then sync_gradients()
SYNC_MODES = [("off", 4.0), ("on", 4.0), ("plain", 4.0), ("off", 1e-6), ("on", 1e-6)]


def object_of(rank: int):
    """Objects of very different pickled sizes: None, empty bytes, about 400 KB."""
    return [None, b"", {"big": np.arange(50_000, dtype=np.float64), "text": "é" * 999,
                        "tuple": (1, 2.5, None)}][rank]


def batches(steps: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(21)
    return [rng.standard_normal((BATCH, IN)).astype(np.float32) for _ in range(steps)]


class Branchy(nn.Module):
    """`body` always; `branch` where forward is told to; `never` is never called."""

    def __init__(self, seed: int, device=CPU):
        super().__init__()
        np.random.seed(seed)
        self.never = nn.Linear(IN, OUT, device=device)
        self.body = nn.Linear(IN, OUT, device=device)
        self.branch = nn.Linear(IN, OUT, device=device)

    def forward(self, x, use_branch: bool):
        out = self.body(x)
        return out + self.branch(x) if use_branch else out


def square_loss(out: ndl.Tensor) -> ndl.Tensor:
    """Mean over rows of the squared norm of a row."""
    return ndl.ops.summation(out * out) / out.shape[0]


def objects(comm: Communicator, out: str) -> None:
    rank = comm.rank
    live = Communicator(comm.comm.Split(int(rank == 0), rank))  # ranks 1 and 2, once 0 left
    gathered = comm.allgather_objects(object_of(rank))
    sent = [comm.broadcast_object(object_of(root) if rank == root else "not root's", root)
            for root in range(comm.size)]
    comm.barrier()
    with open(f"{out}/objects{rank}.pkl", "wb") as f:
        pickle.dump({"gathered": gathered, "broadcast": sent,
                     "mpi4py_gathered": comm.comm.allgather(object_of(rank)),
                     "mpi4py_broadcast": [comm.comm.bcast(object_of(root), root)
                                          for root in range(comm.size)]}, f)
    comm.barrier()
    if rank == 0:
        sys.exit(0)  # leaves: the others' next collectives can never complete
    comm.timeout_s = 1.0
    errors = {}
    for name, op in [("allgather", lambda: comm.allgather_objects(rank)),
                     ("broadcast", lambda: comm.broadcast_object(None, root=0)),
                     ("barrier", comm.barrier)]:
        try:
            op()
            errors[name] = "returned"
        except TimeoutError as e:
            errors[name] = str(e)
    with open(f"{out}/left{rank}.json", "w") as f:
        json.dump(errors, f)
    live.barrier()  # both files are written before the job is torn down
    if rank == 1:
        comm.comm.Abort(0)  # the pending collectives would keep MPI_Finalize waiting


def unused(comm: Communicator, out: str) -> None:
    """Rank 0 uses the branch, rank 1 does not; saves the weights after the broadcast, the
    first step's gradients and the weights after 2 SGD steps with weight decay and momentum."""
    for mode, bucket_mb in SYNC_MODES:
        model = DataParallel(Branchy(seed=comm.rank), comm, bucket_mb=bucket_mb,
                             overlap=mode != "off")
        params = model.parameters()
        saved = {f"start{i}": p.numpy() for i, p in enumerate(params)}
        opt = ndl.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
        for step, x in enumerate(batches()):
            opt.reset_grad()
            loss = square_loss(model(ndl.Tensor(model.shard(x), device=CPU), comm.rank == 0))
            if mode == "plain":
                loss.backward()
                model.sync_gradients(model.local_fraction(BATCH))
            else:
                model.backward(loss, model.local_fraction(BATCH))
            if step == 0:
                saved.update({f"grad{i}": p.grad.numpy() for i, p in enumerate(params)
                              if p.grad is not None})
            opt.step()
        saved.update({f"end{i}": p.numpy() for i, p in enumerate(params)})
        np.savez(f"{out}/unused_{mode}_{bucket_mb}_{comm.rank}.npz", **saved)


def fraction(comm: Communicator, out: str) -> None:
    """Bad fractions must raise on every rank, and the step after must still work."""
    comm.timeout_s = 10.0  # before the fix, the rank whose peer refused waited this long
    (x,) = batches(1)
    cases = {"sum 0.9": (0.5, 0.4), "out of range": (1.5, 0.5), "nan": (float("nan"), 0.5),
             "good": (0.6, 0.4)}
    report = {}
    for overlap in (False, True):
        model = DataParallel(nn.Linear(IN, OUT, device=CPU), comm, overlap=overlap)
        for name, fractions in cases.items():
            loss = square_loss(model(ndl.Tensor(model.shard(x), device=CPU)))
            try:
                model.backward(loss, fractions[comm.rank])
                report[f"{name} {overlap}"] = [p.grad.numpy().tolist() for p in model.parameters()]
            except (ValueError, TimeoutError) as e:
                report[f"{name} {overlap}"] = f"{type(e).__name__}: {e}"
    with open(f"{out}/fraction{comm.rank}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    {"objects": objects, "unused": unused, "fraction": fraction}[sys.argv[1]](
        Communicator(), sys.argv[2]
    )
