"""Run under mpiexec: data-parallel training; each rank saves its final weights to OUTDIR."""
import sys

import numpy as np
from common import CPU, make_batches, make_model

import needle as ndl
from needle import nn
from needle.parallel import Communicator, DataParallel

outdir, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
bucket_mb = float(sys.argv[4])
comm = Communicator()
# Rank 1 starts from different weights: DataParallel must broadcast rank 0's.
model = DataParallel(make_model(seed=comm.rank), comm, bucket_mb=bucket_mb)
opt = ndl.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
loss_fn = nn.SoftmaxLoss()
for x, y in make_batches(steps, batch):
    xl, yl = model.shard(x), model.shard(y)
    opt.reset_grad()
    loss = loss_fn(model(ndl.Tensor(xl, device=CPU)), ndl.Tensor(yl, device=CPU))
    model.backward(loss, model.local_fraction(len(x)))
    opt.step()
np.savez(f"{outdir}/rank{comm.rank}.npz", *[p.numpy() for p in model.parameters()])

# Replicas that differ must be refused on every rank, not deadlock.
try:
    DataParallel(nn.Linear(3, 3 + comm.rank), comm)
    message = "accepted"
except ValueError as err:
    message = str(err)
with open(f"{outdir}/mismatch{comm.rank}.txt", "w") as f:
    f.write(message)
