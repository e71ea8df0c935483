"""Run under mpiexec: data-parallel training; each rank saves its final weights to OUTDIR.

With "offload", every matmul (forward and backward) goes through needle.remote's offload
policy to its in-process executor, the path that remote jobs take.
"""
import contextlib
import json
import sys

import numpy as np
from common import CPU, make_batches, make_model

import needle as ndl
from needle import nn
from needle.parallel import Communicator, DataParallel, NcclCommunicator
from needle.parallel.comm import select_gpu_for_rank
from needle.remote import LocalExecutor
from needle.remote import offload as offload_to

# "cpu"; "cuda" (NCCL, buckets on the GPU); "cuda-mpi" (GPU model, buckets staged through host MPI)
ON_GPU = sys.argv[6].startswith("cuda")
if ON_GPU:
    select_gpu_for_rank()  # before the first use of CUDA: one GPU per rank

outdir, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
bucket_mb, offload = float(sys.argv[4]), sys.argv[5] == "offload"
device = ndl.cuda() if ON_GPU else CPU
comm = NcclCommunicator(Communicator()) if sys.argv[6] == "cuda" else Communicator()
# Rank 1 starts from different weights: DataParallel must broadcast rank 0's.
model = DataParallel(make_model(seed=comm.rank, device=device), comm, bucket_mb=bucket_mb)
opt = ndl.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
loss_fn = nn.SoftmaxLoss()
executor = LocalExecutor()
with offload_to(executor) if offload else contextlib.nullcontext():
    for x, y in make_batches(steps, batch):
        xl, yl = model.shard(x), model.shard(y)
        opt.reset_grad()
        loss = loss_fn(model(ndl.Tensor(xl, device=device)), ndl.Tensor(yl, device=device))
        model.backward(loss, model.local_fraction(len(x)))
        opt.step()
with open(f"{outdir}/offloaded{comm.rank}.txt", "w") as f:
    f.write(str(executor.calls))
np.savez(f"{outdir}/rank{comm.rank}.npz", *[p.numpy() for p in model.parameters()])

# Bad input is refused on every rank with a message naming it, and nothing hangs.
def nan_on_rank_1():
    x, y = make_batches(1, 4)[0]
    if comm.rank == 1:
        x[:, 0] = np.nan
    opt.reset_grad()
    model.backward(loss_fn(model(ndl.Tensor(x, device=device)), ndl.Tensor(y, device=device)))


refusals = {}
for name, attempt in {
    "replicas": lambda: DataParallel(nn.Linear(3, 3 + comm.rank, device=device), comm),
    "shard": lambda: model.shard(np.zeros((1, 3))),
    "fraction": lambda: model.local_fraction(1),
    "weight": lambda: model.sync_gradients(local_fraction=1.5),
    "nan": nan_on_rank_1,
}.items():
    try:
        attempt()
        refusals[name] = "accepted"
    except (ValueError, FloatingPointError) as err:
        refusals[name] = str(err)
model.check_finite = False  # the same NaN now goes through, on every rank
nan_on_rank_1()
refusals["unchecked_nan_grads"] = all(np.isnan(p.grad.numpy()).all() for p in model.parameters())
with open(f"{outdir}/refusals{comm.rank}.json", "w") as f:
    json.dump(refusals, f)
