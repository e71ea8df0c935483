"""CIFAR-10 from its "python version" pickled batches (data_batch_1..5, test_batch)."""
import os
import pickle

import numpy as np

from ..data_basic import ArrayDataset

_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
_TEST = ["test_batch"]


class _DType:
    """Stands in for numpy.dtype while a batch is unpickled. numpy's dtype.__setstate__ trusts
    its input (a damaged state tuple crashes the interpreter), so a dtype is rebuilt here from
    its name and byte order only, and only a plain numeric one."""

    def __init__(self, spec, align=False, copy=True):
        if isinstance(spec, bytes):
            spec = spec.decode("latin1")
        if not isinstance(spec, str):
            raise pickle.UnpicklingError(f"dtype spec {spec!r}")
        dtype = np.dtype(spec)
        if dtype.kind not in "biuf" or dtype.fields is not None or dtype.subdtype is not None:
            raise pickle.UnpicklingError(f"dtype {dtype} is not a plain numeric type")
        self.dtype = dtype

    def __setstate__(self, state):
        # (version, byte order, subarray, names, fields, itemsize, alignment, flags[, metadata])
        if not isinstance(state, tuple) or (len(state), *state[:1]) not in ((8, 3), (9, 4)):
            raise pickle.UnpicklingError(f"malformed dtype state {state!r}")
        order = state[1]
        if isinstance(order, bytes):
            order = order.decode("latin1")
        if order not in ("<", ">", "|", "="):
            raise pickle.UnpicklingError(f"malformed dtype state {state!r}")
        if order != "|":
            self.dtype = self.dtype.newbyteorder(order)


def _real(dtype) -> np.dtype:
    """The numpy dtype a checked stand-in holds; anything else in its place is refused."""
    if not isinstance(dtype, _DType):
        raise pickle.UnpicklingError(f"expected a dtype, got {type(dtype).__name__}")
    return dtype.dtype


class _Array(np.ndarray):
    """What numpy's _reconstruct makes while unpickling: its state is checked before numpy's
    own ndarray.__setstate__ sees it."""

    def __setstate__(self, state):
        if not isinstance(state, tuple) or len(state) != 5 or not isinstance(state[4], bytes):
            raise pickle.UnpicklingError("malformed array state")
        version, shape, dtype, fortran, raw = state
        np.ndarray.__setstate__(self, (version, shape, _real(dtype), bool(fortran), raw))


def _reconstruct(subtype, shape, typecode) -> np.ndarray:
    """numpy's _reconstruct, making an _Array (filled in by its checked __setstate__)."""
    if subtype is not np.ndarray:
        raise pickle.UnpicklingError(f"array subtype {subtype!r}")
    return _Array((0,), np.uint8)


def _scalar(dtype, raw) -> np.generic:
    """numpy's scalar(dtype, bytes), with the byte count checked."""
    dtype = _real(dtype)
    if not isinstance(raw, bytes) or len(raw) != dtype.itemsize:
        raise pickle.UnpicklingError(f"malformed {dtype} scalar")
    return np.frombuffer(raw, dtype)[0]


def _frombuffer(buf, dtype, shape, order) -> np.ndarray:
    """numpy's _frombuffer (arrays at pickle protocol 5); reshape checks the size."""
    return np.frombuffer(bytes(buf), _real(dtype)).reshape(shape, order=order)


# What pickled numpy arrays, dtypes and scalars refer to (numpy 1 spells the module numpy.core,
# numpy 2 numpy._core; protocol 5 rebuilds arrays with _frombuffer), mapped to the checked
# stand-ins above. Nothing else may be loaded but _codecs.encode, which Python 3 uses to
# pickle bytes at protocol 2 or lower.
_ALLOWED = {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): _DType,
    **{(f"numpy.{core}.multiarray", "_reconstruct"): _reconstruct for core in ("core", "_core")},
    **{(f"numpy.{core}.multiarray", "scalar"): _scalar for core in ("core", "_core")},
    **{(f"numpy.{core}.numeric", "_frombuffer"): _frombuffer for core in ("core", "_core")},
}


class _ArraysOnly(pickle.Unpickler):
    """Unpickles dicts, lists and numpy arrays and nothing else: a batch file cannot run code."""

    def find_class(self, module, name):
        if (module, name) == ("_codecs", "encode"):
            return super().find_class(module, name)
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        raise pickle.UnpicklingError(f"CIFAR-10 batch refers to {module}.{name}; not allowed")


def _field(batch: dict, key: str):
    """batch[key] under its bytes name (the original Python 2 files read with
    encoding='bytes') or its str name (a batch re-pickled by Python 3); None when absent."""
    value = batch.get(key.encode())
    return batch.get(key) if value is None else value


def load_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One batch file -> images float32 (N, 3, 32, 32) in [0, 1], labels uint8 (N,).

    A file that is not a well-formed batch (empty, truncated, corrupt, other contents, pixels
    that are not bytes, labels outside 0..9) raises ValueError naming it."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ValueError(f"{path}: empty file, expected a CIFAR-10 python batch")
        try:
            batch = _ArraysOnly(f, encoding="bytes").load()
        except Exception as e:  # a damaged pickle fails in many ways: all mean the same here
            raise ValueError(
                f"{path}: not a CIFAR-10 python batch ({type(e).__name__}: {e})") from None
    if not isinstance(batch, dict) or _field(batch, "data") is None \
            or _field(batch, "labels") is None:
        raise ValueError(f"{path}: a CIFAR-10 batch is a dict with b'data' and b'labels'")
    try:
        data = np.asarray(_field(batch, "data"))
        labels = np.asarray(_field(batch, "labels"))
    except ValueError as e:  # ragged lists
        raise ValueError(f"{path}: malformed data or labels ({e})") from None
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.ndim != 1 \
            or len(labels) != len(data):
        raise ValueError(
            f"{path}: expected data (N, 3072) and N labels, got {data.shape} and "
            f"labels of shape {labels.shape}"
        )
    if data.size and (not np.issubdtype(data.dtype, np.integer)
                      or data.min() < 0 or data.max() > 255):
        raise ValueError(f"{path}: pixels must be bytes (uint8 0..255), got {data.dtype} data")
    if labels.size and (not np.issubdtype(labels.dtype, np.integer)
                        or labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{path}: labels must be integers 0..9, got {labels.dtype} labels")
    return data.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0, labels.astype(np.uint8)


class CIFAR10Dataset(ArrayDataset):
    """Examples are (3 x 32 x 32 image in [0, 1], label), as CMU needle's reader gives them.

    Transforms see the image as H x W x C and hand back the same layout. `p` is accepted, and
    unused, for the course's signature CIFAR10Dataset(base_folder, train, p, transforms).
    """

    def __init__(self, base_folder: str, train: bool, p: float | None = 0.5, transforms=None):
        names = _TRAIN if train else _TEST
        parts = [load_batch(os.path.join(base_folder, name)) for name in names]
        super().__init__(np.concatenate([x for x, _ in parts]),
                         np.concatenate([y for _, y in parts]), transforms=transforms)

    def apply_transforms(self, x: np.ndarray) -> np.ndarray:
        """Transforms see the C x H x W image as H x W x C (examples are ArrayDataset's, so
        a DataLoader batch without transforms reads the stored rows at once)."""
        if not self.transforms:
            return x
        return super().apply_transforms(x.transpose(1, 2, 0)).transpose(2, 0, 1)
