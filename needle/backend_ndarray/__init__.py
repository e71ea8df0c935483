"""NDArray and the devices (numpy reference, C++ cpu, CUDA) it runs on."""

from .ndarray import (
    BackendDevice,
    MissingPrimitive,
    NDArray,
    all_devices,
    allow_tf32,
    array,
    cpu,
    cpu_numpy,
    cuda,
    default_device,
    empty,
    full,
)

__all__ = [
    "BackendDevice",
    "MissingPrimitive",
    "NDArray",
    "all_devices",
    "allow_tf32",
    "array",
    "cpu",
    "cpu_numpy",
    "cuda",
    "default_device",
    "empty",
    "full",
]
