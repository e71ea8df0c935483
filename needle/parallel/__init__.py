"""Training beyond one device: data parallel (MPI allreduce), model parallel, GPipe pipeline."""
from .comm import Communicator, NcclCommunicator, nccl_available
from .data_parallel import DataParallel, plan_buckets
from .launch import find_launcher, launch_command, launch_env
from .model_parallel import ModelParallel, place, to_device
from .pipeline import Pipeline, gpipe_schedule

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
