"""Run under mpiexec: data parallelism with a BatchNorm model, allreduce overlapped or not.

Trains the same steps three times from the same start: "on" (`overlap=True`, buckets start
inside `model.backward`), "off" (`overlap=False`) and "plain" (`overlap=True`, but a plain
`loss.backward()` then `model.sync_gradients()`, where the hooks must do nothing). Saves per
rank and mode: the weights and BatchNorm statistics, and the order in which gradients became
ready and buckets started.
"""
import json
import sys

import numpy as np
from common import IN, make_batches, make_stages

import needle as ndl
from needle import nn
from needle.parallel import Communicator, DataParallel, NcclCommunicator
from needle.parallel.comm import select_gpu_for_rank

ON_GPU = sys.argv[5] == "cuda"
if ON_GPU:
    select_gpu_for_rank()
outdir, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
bucket_mb = float(sys.argv[4])
device = ndl.cuda() if ON_GPU else ndl.cpu()
comm = NcclCommunicator(Communicator()) if ON_GPU else Communicator()


class Net(nn.Module):
    """BatchNorm on the input features, then the MLP, and a layer forward never uses.
    Rank-dependent weights, so the broadcast matters (rank 0's win)."""

    def __init__(self):
        super().__init__()
        np.random.seed(100 + comm.rank)
        # first attribute: its parameters come first, so their buckets are the last to start
        self.unused = nn.Linear(3, 2, device=device)
        self.norm = nn.BatchNorm1d(IN, device=device)
        self.body = nn.Sequential(*make_stages(seed=comm.rank, device=device))

    def forward(self, x):
        return self.body(self.norm(x))


def train(mode: str, events: list) -> nn.Module:
    model = DataParallel(Net(), comm, bucket_mb=bucket_mb, overlap=mode != "off")
    start = comm.iallreduce_sum_

    def recording_start(buf):
        bucket = next((k for k, b in enumerate(model._buffers) if b is buf), "stats")
        events.append(["start", bucket])
        return start(buf)

    comm.iallreduce_sum_ = recording_start
    unused_start.append(model.module.unused.weight.numpy())
    params = model.parameters()
    for i, p in enumerate(params):  # after DataParallel's own hook, so it sees the pack done
        p.register_grad_ready_hook(lambda _, i=i: events.append(["ready", i]))
    opt = ndl.optim.SGD(params, lr=0.1, momentum=0.9)
    loss_fn = nn.SoftmaxLoss()
    for x, y in make_batches(steps, batch):
        events.append(["step"])
        opt.reset_grad()
        xl, yl = model.shard(x), model.shard(y)
        loss = loss_fn(model(ndl.Tensor(xl, device=device)), ndl.Tensor(yl, device=device))
        if mode == "plain":
            loss.backward()
            model.sync_gradients(model.local_fraction(len(x)))
        else:
            model.backward(loss, model.local_fraction(len(x)))
        opt.step()
    comm.iallreduce_sum_ = start
    return model


for name in ("on", "off", "plain"):
    events: list = []
    unused_start: list = []
    model = train(name, events)
    norm = model.module.norm
    np.savez(
        f"{outdir}/{name}{comm.rank}.npz", *[p.numpy() for p in model.parameters()],
        running_mean=norm.running_mean.numpy(), running_var=norm.running_var.numpy(),
        unused_start=unused_start[0],
    )
    with open(f"{outdir}/{name}{comm.rank}.json", "w") as f:
        json.dump({"events": events, "buckets": len(model._buffers)}, f)
