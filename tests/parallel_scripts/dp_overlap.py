"""Run under mpiexec: data parallelism with a BatchNorm model, allreduce overlapped or not.

Trains the same steps twice from the same start, once with `overlap=True` (buckets start inside
backward) and once with `overlap=False`, and saves per rank: the weights and BatchNorm
statistics of both runs, and the order in which gradients became ready and buckets started.
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


def make_model() -> nn.Module:
    """BatchNorm on the input features, then the MLP; rank-dependent weights, so the broadcast
    matters (rank 0's win)."""
    first, second = make_stages(seed=comm.rank, device=device)
    return nn.Sequential(nn.BatchNorm1d(IN, device=device), first, second)


def train(overlap: bool, events: list) -> nn.Module:
    model = DataParallel(make_model(), comm, bucket_mb=bucket_mb, overlap=overlap)
    start = comm.iallreduce_sum_

    def recording_start(buf):
        bucket = next((k for k, b in enumerate(model._buffers) if b is buf), "stats")
        events.append(["start", bucket])
        return start(buf)

    comm.iallreduce_sum_ = recording_start
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
        model.backward(loss, model.local_fraction(len(x)))
        opt.step()
    comm.iallreduce_sum_ = start
    return model


for overlap in (True, False):
    events: list = []
    model = train(overlap, events)
    norm = model.module.modules[0]
    name = "on" if overlap else "off"
    np.savez(
        f"{outdir}/{name}{comm.rank}.npz", *[p.numpy() for p in model.parameters()],
        running_mean=norm.running_mean.numpy(), running_var=norm.running_var.numpy(),
    )
    with open(f"{outdir}/{name}{comm.rank}.json", "w") as f:
        json.dump({"events": events, "buckets": len(model._buffers)}, f)
