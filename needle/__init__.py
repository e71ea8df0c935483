"""needle: a small deep-learning framework (CMU 10-414/714 API) on numpy, C++ and CUDA backends."""

import importlib.util

from . import ops
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

# nn, optim, init and data are built by another part of the project; import those present.
for _name in ("init", "nn", "optim", "data"):
    if importlib.util.find_spec(f"{__name__}.{_name}") is not None:
        importlib.import_module(f"{__name__}.{_name}")
del _name

__all__ = [
    "BackendDevice",
    "NDArray",
    "Tensor",
    "TensorTuple",
    "all_devices",
    "cpu",
    "cpu_numpy",
    "cuda",
    "default_device",
    "no_grad",
    "ops",
]
