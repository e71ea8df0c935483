"""CIFAR-10 from its "python version" pickled batches (data_batch_1..5, test_batch)."""
import os
import pickle

import numpy as np

from ..data_basic import ArrayDataset

_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
_TEST = ["test_batch"]
_NUMPY_NAMES = ("_reconstruct", "ndarray", "dtype", "scalar")  # what a pickled array needs


class _ArraysOnly(pickle.Unpickler):
    """Unpickles dicts, lists and numpy arrays and nothing else: a batch file cannot run code."""

    def find_class(self, module, name):
        if module.split(".")[0] == "numpy" and name in _NUMPY_NAMES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"CIFAR-10 batch refers to {module}.{name}; not allowed")


def load_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One batch file -> images float32 (N, 3, 32, 32) in [0, 1], labels uint8 (N,)."""
    with open(path, "rb") as f:
        try:
            batch = _ArraysOnly(f, encoding="bytes").load()
        except (pickle.UnpicklingError, EOFError, ValueError) as e:
            raise ValueError(f"{path}: not a CIFAR-10 python batch ({e})") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise ValueError(f"{path}: a CIFAR-10 batch is a dict with b'data' and b'labels'")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[b"labels"])
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise ValueError(
            f"{path}: expected data (N, 3072) and N labels, got {data.shape} and {len(labels)}"
        )
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{path}: labels must be 0..9")
    return data.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0, labels.astype(np.uint8)


class CIFAR10Dataset(ArrayDataset):
    """Examples are (3 x 32 x 32 image in [0, 1], label), as CMU needle's reader gives them.

    Transforms see the image as H x W x C and hand back the same layout.
    """

    def __init__(self, base_folder: str, train: bool, transforms=None):
        names = _TRAIN if train else _TEST
        parts = [load_batch(os.path.join(base_folder, name)) for name in names]
        super().__init__(np.concatenate([x for x, _ in parts]),
                         np.concatenate([y for _, y in parts]), transforms=transforms)

    def __getitem__(self, index):
        x = self.X[index]
        if self.transforms:
            x = self.apply_transforms(x.transpose(1, 2, 0)).transpose(2, 0, 1)
        return x, self.y[index]
