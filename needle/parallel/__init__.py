"""Training beyond one device: data parallel (MPI allreduce), model parallel, GPipe pipeline."""
from .comm import Communicator, NcclCommunicator, nccl_available
from .data_parallel import DataParallel, plan_buckets
from .model_parallel import ModelParallel, place, to_device
from .pipeline import Pipeline, gpipe_schedule

_LAUNCH = ("find_launcher", "launch_command", "launch_env")


def __getattr__(name: str):
    """The launcher's names, imported on first use: were `.launch` imported with the package,
    `python -m needle.parallel.launch` would find it loaded already and runpy would warn."""
    if name in _LAUNCH:
        from . import launch

        return getattr(launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Communicator",
    "DataParallel",
    "ModelParallel",
    "NcclCommunicator",
    "Pipeline",
    "find_launcher",
    "gpipe_schedule",
    "launch_command",
    "launch_env",
    "nccl_available",
    "place",
    "plan_buckets",
    "to_device",
]
