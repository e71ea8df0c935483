"""GPipe pipeline parallelism: stages on devices (or ranks), the batch cut into micro-batches.

Each stage boundary cuts the autograd graph: a stage's input is a fresh leaf
tensor on the stage's device, its output activation goes to the next stage and
the leaf's gradient comes back to the previous one. Forward passes of all
micro-batches run first (stage s handles micro-batch m at tick s + m), then
the backward passes in reverse; parameter gradients are summed over
micro-batches, and each micro-batch's loss is weighted by its share of the
batch, so the gradients equal those of the unsplit model on the whole batch
(for models without cross-sample layers such as BatchNorm, which sees only a
micro-batch here, as in GPipe).

In one process the stages run one after another on their devices; with a
communicator of one rank per stage, rank r runs stage r and activations and
gradients travel by MPI send/recv, so the stages really overlap.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from needle import autograd
from needle.autograd import Tensor
from needle.nn import Module, Parameter

from .comm import Communicator
from .model_parallel import host_array, place


class Task(NamedTuple):
    phase: str  # "F" forward or "B" backward
    stage: int
    micro_batch: int


def gpipe_schedule(num_stages: int, num_micro_batches: int) -> list[list[Task]]:
    """Tasks per clock tick: all forwards as a wavefront, then all backwards in reverse."""
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(
            f"need at least one stage and one micro-batch, got {num_stages} and "
            f"{num_micro_batches}"
        )
    ticks = num_stages + num_micro_batches - 1
    forward = [
        [Task("F", s, t - s) for s in range(num_stages) if 0 <= t - s < num_micro_batches]
        for t in range(ticks)
    ]
    backward = [
        [
            Task("B", s, num_micro_batches - 1 - (t - (num_stages - 1 - s)))
            for s in reversed(range(num_stages))
            if 0 <= t - (num_stages - 1 - s) < num_micro_batches
        ]
        for t in range(ticks)
    ]
    return forward + backward


LossFn = Callable[[Tensor, Tensor], Tensor]


class Pipeline:
    """Train `stages` (stage i on `devices[i]`) with GPipe over `micro_batches` micro-batches.

    With `comm` of size len(stages), this rank runs only stage `comm.rank`; build the
    same stages on every rank (same seed) and each keeps its own.
    """

    def __init__(
        self,
        stages: Sequence[Module],
        devices: Sequence,
        micro_batches: int,
        comm: Communicator | None = None,
    ):
        if len(stages) != len(devices) or not stages:
            raise ValueError(
                f"need one device per stage, got {len(stages)} stages and {len(devices)} devices"
            )
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
        if comm is not None and comm.size != len(stages):
            raise ValueError(f"{len(stages)} stages need {len(stages)} ranks, got {comm.size}")
        if comm is not None:
            _refuse_weights_tied_across_stages(stages)
        self.comm = comm
        self.devices = list(devices)
        self.micro_batches = micro_batches
        self.schedule = gpipe_schedule(len(stages), micro_batches)
        self.local = [comm.rank] if comm is not None else list(range(len(stages)))
        self.stages = list(stages)
        for s in self.local:
            place(self.stages[s], self.devices[s])

    def parameters(self) -> list[Parameter]:
        """Parameters of the stages this process runs, each once: a weight tied between two
        stages gets the sum of both stages' gradients, and one optimiser update."""
        unique = {id(p): p for s in self.local for p in self.stages[s].parameters()}
        return list(unique.values())

    def forward_backward(self, x: np.ndarray | Tensor, y: np.ndarray | Tensor,
                         loss_fn: LossFn) -> float:
        """One GPipe step; leaves the batch-mean gradient in each local parameter's `.grad`.

        Returns the batch-mean loss (on every rank).
        """
        if not autograd.is_grad_enabled():  # the stages would record no graph to take gradients of
            raise RuntimeError("Pipeline.forward_backward computes gradients; call it outside "
                               "needle.no_grad()")
        x, y = host_array(x), host_array(y)
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"inputs have {x.shape[0]} rows but targets have {y.shape[0]}")
        if x.shape[0] < self.micro_batches:
            raise ValueError(
                f"a batch of {x.shape[0]} rows cannot make {self.micro_batches} micro-batches"
            )
        xs, ys = np.array_split(x, self.micro_batches), np.array_split(y, self.micro_batches)
        last = len(self.stages) - 1
        inputs: dict[tuple[int, int], Tensor] = {}
        outputs: dict[tuple[int, int], Tensor] = {}
        grads: dict[int, Tensor] = {}  # by id(parameter): Tensor's == builds a graph node
        loss = 0.0
        for tick in self.schedule:
            for phase, s, m in tick:
                if s not in self.local:
                    continue
                if phase == "F":
                    source = xs[m] if s == 0 else self._receive(s - 1, m, outputs, "F")
                    inputs[s, m] = Tensor(source, device=self.devices[s], requires_grad=s > 0)
                    origin = "the batch" if s == 0 else f"stage {s - 1}"
                    shape = tuple(inputs[s, m].shape)
                    with _naming_stage(s, f"the forward of micro-batch {m} on an input of "
                                          f"shape {shape} from {origin}"):
                        out = self.stages[s](inputs[s, m])
                        if s == last:
                            target = Tensor(ys[m], device=self.devices[s], requires_grad=False)
                            out = loss_fn(out, target) * (len(ys[m]) / len(y))
                            loss += out.numpy().item()
                    outputs[s, m] = out
                    self._send(s + 1, m, out, "F")
                else:
                    params = self.stages[s].parameters()
                    for p in params:
                        p.grad = None
                    out_grad = None  # the last stage's output is the loss: ones
                    if s < last:
                        grad = self._receive(s + 1, m, inputs, "B")
                        out_grad = Tensor(grad, device=self.devices[s])
                    with _naming_stage(s, f"the backward of micro-batch {m}"):
                        outputs[s, m].backward(out_grad)
                    for p in params:
                        if p.grad is not None:
                            g = p.grad.detach()
                            grads[id(p)] = g if id(p) not in grads else grads[id(p)] + g
                    if s > 0:
                        self._send(s - 1, m, inputs[s, m].grad, "B")
        for p in self.parameters():
            p.grad = grads.get(id(p))
        if self.comm is not None:
            loss = self.comm.broadcast_object(loss, root=self.comm.size - 1)
        return loss

    def _send(self, dst: int, m: int, tensor: Tensor, phase: str) -> None:
        """Hand a boundary tensor to stage `dst`; a no-op in one process (it reads `outputs`)."""
        if self.comm is None or not 0 <= dst < len(self.stages):
            return
        self.comm.send(tensor.numpy(), dest=dst, tag=self._tag(m, phase))

    def _receive(self, src: int, m: int, local: dict, phase: str):
        """The boundary tensor stage `src` produced for micro-batch m (activation or gradient)."""
        if self.comm is None:
            value = local[src, m]
            return value if phase == "F" else value.grad
        return self.comm.recv(source=src, tag=self._tag(m, phase))

    def _tag(self, m: int, phase: str) -> int:
        return 2 * m + (phase == "B")


def _refuse_weights_tied_across_stages(stages: Sequence[Module]) -> None:
    """With one stage per rank, a weight two stages share (tied embeddings, say) is a copy on
    each of their ranks, updated from that rank's stage's gradient alone: the copies would drift
    apart, silently, from the model trained in one process. Every rank builds every stage, so
    every rank finds the same tie and raises, before any message."""
    owner: dict[int, int] = {}
    for s, stage in enumerate(stages):
        for param in stage.parameters():
            first = owner.setdefault(id(param), s)
            if first != s:
                raise ValueError(
                    f"stages {first} and {s} share a parameter (a tied weight): with one stage "
                    "per rank each rank would train its own copy of it; untie it, or run the "
                    "stages in one process (comm=None), where it gets both stages' gradients"
                )


@contextlib.contextmanager
def _naming_stage(stage: int, task: str) -> Iterator[None]:
    """Say which stage and micro-batch a stage's own error came from (with one stage per rank, a
    layer's bare error would not say that the mismatch lies at a stage boundary)."""
    try:
        yield
    except Exception as e:
        raise RuntimeError(f"pipeline stage {stage} failed in {task}: {type(e).__name__}: {e}") \
            from e
