"""Save and load a model's state (and optionally its optimiser's) as one .npz file.

Keys are `model/<tensor name>` and `optimizer/<slot>.<parameter index>`; arrays only, so loading
never unpickles anything.
"""
import os
import zipfile

import numpy as np

from needle.nn import Module
from needle.optim import Optimizer


def save(path: str, model: Module, optimizer: Optimizer | None = None) -> None:
    """Write atomically: a crash mid-write leaves any previous checkpoint at path intact."""
    arrays = {f"model/{k}": v for k, v in model.state_dict().items()}
    if optimizer is not None:
        arrays.update({f"optimizer/{k}": v for k, v in optimizer.state_dict().items()})
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def load(path: str, model: Module, optimizer: Optimizer | None = None) -> None:
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable needle checkpoint ({e})") from None
    parts: dict[str, dict[str, np.ndarray]] = {"model": {}, "optimizer": {}}
    for key, value in arrays.items():
        part, _, name = key.partition("/")
        if part not in parts or not name:
            raise ValueError(f"{path}: unexpected entry {key!r} in checkpoint")
        parts[part][name] = value
    if not parts["model"]:
        raise ValueError(f"{path}: checkpoint holds no model state")
    if optimizer is not None and not parts["optimizer"]:
        raise ValueError(f"{path}: checkpoint holds no optimizer state")
    model.load_state_dict(parts["model"])
    if optimizer is not None:
        optimizer.load_state_dict(parts["optimizer"])
