"""Model parallelism: consecutive stages of a model live on different devices.

Activations move forward and gradients move backward through `to_device`, an
ordinary autograd op, so one `loss.backward()` spans all devices.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from needle.autograd import Tensor, TensorOp
from needle.nn import Module


class ToDevice(TensorOp):
    """Copy a tensor to another device; its gradient is copied back."""

    def __init__(self, device):
        self.device = device

    def compute(self, a):
        return a.to(self.device)

    def gradient(self, out_grad: Tensor, node: Tensor):
        return to_device(out_grad, node.inputs[0].device)


def to_device(x: Tensor, device) -> Tensor:
    return ToDevice(device)(x)


def host_array(batch: np.ndarray | Tensor) -> np.ndarray:
    """A batch as numpy: np.asarray would make a Tensor (a DataLoader's batch) an array of
    Tensor objects, which needle refuses only later, as dtype object."""
    return batch.numpy() if isinstance(batch, Tensor) else np.asarray(batch)


def place(module: Module, device) -> Module:
    """Move every tensor a module holds (parameters and buffers such as running means)."""
    for _, tensor in module.named_tensors():
        if tensor.device != device:
            tensor.data = Tensor(tensor, device=device)
    return module


class ModelParallel(Module):
    """Run `stages[i]` on `devices[i]`, moving activations between devices as needed."""

    def __init__(self, stages: Sequence[Module], devices: Sequence):
        super().__init__()
        if len(stages) != len(devices) or not stages:
            raise ValueError(
                f"need one device per stage, got {len(stages)} stages and {len(devices)} devices"
            )
        self.stages = [place(stage, device) for stage, device in zip(stages, devices, strict=True)]
        self.devices = list(devices)

    def forward(self, x: Tensor) -> Tensor:
        for stage, device in zip(self.stages, self.devices, strict=True):
            x = stage(to_device(x, device))
        return x
