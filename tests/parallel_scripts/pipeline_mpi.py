"""Run under mpiexec -n 2: a two-stage GPipe step with one stage per rank."""
import sys

import numpy as np
from common import make_batches, make_stages

import needle as ndl
from needle import nn
from needle.parallel import Communicator, Pipeline

outdir, micro_batches, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
comm = Communicator()
pipe = Pipeline(make_stages(seed=0), [ndl.cpu(), ndl.cpu()], micro_batches, comm)
(x, y), = make_batches(1, batch)
loss = pipe.forward_backward(x, y, nn.SoftmaxLoss())
np.savez(f"{outdir}/stage{comm.rank}.npz", *[p.grad.numpy() for p in pipe.parameters()])
with open(f"{outdir}/loss{comm.rank}.txt", "w") as f:
    f.write(repr(loss))
