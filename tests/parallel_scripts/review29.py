"""Run under mpiexec, 2 ranks: the review-29 cases (tests/test_parallel_review29.py).

    early OUT     rank 1 raises before any Communicator exists (its data missing, say);
                  rank 0 goes on to build one: the job must end, not wait in MPI's start-up
    options OUT   the ranks build DataParallel with different bucket_mb, overlap, or batch
                  norms of the same parameter shapes: each rank must refuse it at once
"""
import json
import os
import sys

import needle as ndl
from needle import nn
from needle.parallel import Communicator, DataParallel

CPU = ndl.cpu()
case, out = sys.argv[1], sys.argv[2]

if case == "early":
    if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1":
        raise FileNotFoundError("rank 1: data shard missing")
    Communicator(timeout_s=600).barrier()  # longer than the test waits: the abort ends it
    raise AssertionError("rank 0 passed a barrier that rank 1 never reached")

comm = Communicator(timeout_s=20)


def model(norm=nn.BatchNorm1d):
    return nn.Sequential(nn.Linear(4, 8, device=CPU), norm(8, device=CPU))


refusals = {}
for name, attempt in {
    "bucket_mb": lambda: DataParallel(model(), comm, bucket_mb=4 if comm.rank == 0 else 1e-6),
    "overlap": lambda: DataParallel(model(), comm, overlap=comm.rank == 1),
    "norm": lambda: DataParallel(model(nn.BatchNorm1d if comm.rank == 0 else nn.LayerNorm1d),
                                 comm),
}.items():
    try:
        attempt()
        refusals[name] = None
    except ValueError as err:
        refusals[name] = str(err)
with open(os.path.join(out, f"refusals{comm.rank}.json"), "w") as f:
    json.dump(refusals, f)
