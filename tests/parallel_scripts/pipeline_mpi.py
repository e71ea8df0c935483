"""Run under mpiexec -n 2: a two-stage GPipe step with one stage per rank (per GPU on "cuda")."""
import sys

import numpy as np
from common import make_batches, make_stages

import needle as ndl
from needle import nn
from needle.parallel import Communicator, Pipeline
from needle.parallel.comm import select_gpu_for_rank

outdir, micro_batches, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if sys.argv[4] == "cuda":
    select_gpu_for_rank()
device = ndl.cuda() if sys.argv[4] == "cuda" else ndl.cpu()
comm = Communicator()
pipe = Pipeline(make_stages(seed=0), [device, device], micro_batches, comm)
(x, y), = make_batches(1, batch)
loss = pipe.forward_backward(x, y, nn.SoftmaxLoss())
np.savez(f"{outdir}/stage{comm.rank}.npz", *[p.grad.numpy() for p in pipe.parameters()])
with open(f"{outdir}/loss{comm.rank}.txt", "w") as f:
    f.write(repr(loss))
