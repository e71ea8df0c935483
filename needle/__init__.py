"""needle: a small deep-learning framework (CMU 10-414/714 API) on numpy, C++ and CUDA backends."""

from . import data, init, nn, ops, optim
from .autograd import Tensor, TensorTuple, no_grad
from .backend_ndarray import (
    BackendDevice,
    NDArray,
    all_devices,
    cpu,
    cpu_numpy,
    cuda,
    default_device,
)
from .ops import *  # noqa: F403 (CMU exposes ops at the top level too)

__all__ = [
    "BackendDevice",
    "NDArray",
    "Tensor",
    "TensorTuple",
    "all_devices",
    "data",
    "init",
    "nn",
    "optim",
    "cpu",
    "cpu_numpy",
    "cuda",
    "default_device",
    "no_grad",
    "ops",
]
