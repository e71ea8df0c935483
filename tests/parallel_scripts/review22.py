"""Run under mpiexec: the review-22 cases of needle.parallel (see tests/test_parallel_review22.py).

    fraction OUT   (2 ranks) rank 0 passes a local_fraction that is not a number
    pipeline OUT   (3 ranks) 2 stages on 3 ranks are refused; then 3 stages (the middle one
                   without parameters), 4 micro-batches of a 10-row batch, SGD steps, with a
                   forward_backward under needle.no_grad() between them
    mismatch OUT   (2 ranks) stage 1 expects 20 features, stage 0 gives 16; nothing catches it
"""
import json
import sys
import time

import numpy as np

import needle as ndl
from needle import nn
from needle.parallel import Communicator, DataParallel, Pipeline

CPU = ndl.cpu()
IN, HIDDEN, CLASSES, BATCH, MICRO = 12, 16, 5, 10, 4
TIMEOUT_S = 6.0  # what a rank left waiting by a peer's refusal would wait
SGD_STEPS = 3  # before forward_backward under no_grad, and one after it


def batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(22)
    return [(rng.standard_normal((BATCH, IN)).astype(np.float32),
             rng.integers(0, CLASSES, BATCH).astype(np.float32)) for _ in range(steps)]


def make_stages(hidden_in: int = HIDDEN) -> list[nn.Module]:
    """An MLP in 3 stages; the middle one has no parameters. Stage 2 expects `hidden_in`."""
    np.random.seed(3)
    return [nn.Sequential(nn.Linear(IN, HIDDEN, device=CPU), nn.ReLU()), nn.Tanh(),
            nn.Linear(hidden_in, CLASSES, device=CPU)]


def make_optimizer(params) -> ndl.optim.SGD:
    return ndl.optim.SGD(params, lr=0.1, momentum=0.9)


def attempt(step, *args) -> dict:
    """What `step(*args)` raised (or "returned") and how long it took."""
    start = time.monotonic()
    try:
        step(*args)
        outcome = "returned"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    return {"outcome": outcome, "seconds": time.monotonic() - start}


def fraction(comm: Communicator, out: str) -> None:
    """Each non-number on rank 0 (rank 1 passes 0.5), then a good step: still in step?"""
    comm.timeout_s = TIMEOUT_S
    (x, _), = batches(1)
    model = DataParallel(nn.Linear(IN, CLASSES, device=CPU), comm)
    report = {}
    for name, bad in [("string", "0.5"), ("tensor", ndl.Tensor([0.5], device=CPU)),
                      ("bool", True), ("good", 0.5)]:
        out_tensor = model(ndl.Tensor(model.shard(x), device=CPU))
        loss = ndl.ops.summation(out_tensor * out_tensor) / out_tensor.shape[0]
        report[name] = attempt(model.backward, loss, bad if comm.rank == 0 else 0.5)
    report["grads"] = [p.grad.numpy().tolist() for p in model.parameters()]
    with open(f"{out}/fraction{comm.rank}.json", "w") as f:
        json.dump(report, f)


def pipeline(comm: Communicator, out: str) -> None:
    comm.timeout_s = TIMEOUT_S
    report = {"ranks": attempt(Pipeline, make_stages()[:2], [CPU, CPU], MICRO, comm)}
    pipe = Pipeline(make_stages(), [CPU] * 3, MICRO, comm)
    opt = make_optimizer(pipe.parameters())
    losses = []
    for step, (x, y) in enumerate(batches(SGD_STEPS + 1)):
        if step == SGD_STEPS:
            with ndl.no_grad():
                report["no_grad"] = attempt(pipe.forward_backward, x, y, nn.SoftmaxLoss())
        opt.reset_grad()
        losses.append(pipe.forward_backward(x, y, nn.SoftmaxLoss()))
        opt.step()
    report["losses"] = losses
    report["params"] = [p.numpy().tolist() for p in pipe.parameters()]
    with open(f"{out}/pipeline{comm.rank}.json", "w") as f:
        json.dump(report, f)


def mismatch(comm: Communicator, out: str) -> None:
    """Uncaught, as in a training script: the error aborts the job (rank 0 waits for stage 1)."""
    comm.timeout_s = 60.0  # the abort, not this, must end rank 0's wait
    pipe = Pipeline(make_stages(hidden_in=20)[::2], [CPU, CPU], MICRO, comm)
    (x, y), = batches(1)
    try:
        pipe.forward_backward(x, y, nn.SoftmaxLoss())
    except Exception as e:  # kept in a file too: an aborting job may lose its last output
        with open(f"{out}/mismatch{comm.rank}.txt", "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        raise


if __name__ == "__main__":
    {"fraction": fraction, "pipeline": pipeline, "mismatch": mismatch}[sys.argv[1]](
        Communicator(), sys.argv[2]
    )
