"""Save and load a model's state (and optionally its optimiser's) as one .npz file.

Keys are `model/<tensor name>`, `optimizer/<slot>.<parameter index>` and, for a training
loop's own counters, `train/<name>`; arrays only, so loading never unpickles anything.
"""
import contextlib
import os
import secrets
import tokenize
import zipfile
import zlib

import numpy as np

from needle.nn import Module
from needle.optim import Optimizer


def save(path: str, model: Module, optimizer: Optimizer | None = None,
         train: dict[str, np.ndarray] | None = None) -> None:
    """Write atomically: a crash mid-write leaves any previous checkpoint at path intact.

    The bytes go to a temporary file of a name of its own beside `path` (so that savers
    writing the same path at once, such as data-parallel ranks, never mix their bytes), are
    synced to disk, then renamed over `path`; on any error the temporary file is removed.
    """
    arrays = {f"model/{k}": v for k, v in model.state_dict().items()}
    if optimizer is not None:
        arrays.update({f"optimizer/{k}": v for k, v in optimizer.state_dict().items()})
    arrays.update({f"train/{k}": np.asarray(v) for k, v in (train or {}).items()})
    _require_numbers(arrays, f"cannot save {path}")  # load() refuses anything else
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot save {path}: folder {folder} does not exist")
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "xb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())  # else a power cut after the rename can leave an empty file
        os.replace(tmp, path)
        _sync_folder(folder)  # else a power cut can undo the rename: the old checkpoint is back
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def load(path: str, model: Module, optimizer: Optimizer | None = None) -> dict[str, np.ndarray]:
    """Restore model (and optimizer) from `path`; on any error neither is changed. Returns
    the `train` entries given to save() (empty for checkpoints written without them)."""
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # a bare .npy array
            raise ValueError("an .npy array, not an .npz archive")
        with loaded as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error,
            NotImplementedError, tokenize.TokenError) as e:  # zlib.error, NotImplementedError:
        # damaged compressed data, method field; TokenError: an array header cut off
        raise ValueError(f"{path}: not a readable needle checkpoint ({e})") from None
    _require_numbers(arrays, path)
    parts: dict[str, dict[str, np.ndarray]] = {"model": {}, "optimizer": {}, "train": {}}
    for key, value in arrays.items():
        part, _, name = key.partition("/")
        if part not in parts or not name:
            raise ValueError(f"{path}: unexpected entry {key!r} in checkpoint")
        parts[part][name] = value
    if not parts["model"]:
        raise ValueError(f"{path}: checkpoint holds no model state")
    if optimizer is not None and not parts["optimizer"]:
        raise ValueError(f"{path}: checkpoint holds no optimizer state")
    previous = model.state_dict()
    try:
        model.load_state_dict(parts["model"])
    except (KeyError, ValueError) as e:
        raise _naming(path, e) from None
    if optimizer is not None:
        try:
            optimizer.load_state_dict(parts["optimizer"])
        except Exception as e:
            model.load_state_dict(previous)  # the model alone must not move to the checkpoint
            if isinstance(e, (KeyError, ValueError)):
                raise _naming(path, e) from None
            raise
    return parts["train"]


def _naming(path: str, error: Exception) -> Exception:
    """The same kind of error, its message led by the checkpoint's path: a model or optimizer
    that does not match says which file it does not match."""
    message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return type(error)(f"{path}: {message}")


def _require_numbers(arrays: dict, where: str) -> None:
    """Only arrays of numbers go into or come out of a checkpoint (NpzFile hands a member that
    is not an .npy file over as bytes)."""
    for key, value in arrays.items():
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "biuf":
            held = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
            raise ValueError(f"{where}: entry {key!r} holds {held}, not numbers")


def _sync_folder(folder: str) -> None:
    """Make a rename in folder durable: fsync of the file alone does not persist its name."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
