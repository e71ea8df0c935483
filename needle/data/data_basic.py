"""Dataset and DataLoader (CMU needle's `needle.data`)."""
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from needle.autograd import Tensor


def is_positive_int(value) -> bool:
    """An int or numpy integer >= 1, and not a bool: a float or bool batch size would fail
    only at the first iteration, obscurely."""
    return not isinstance(value, bool) and isinstance(value, int | np.integer) and value >= 1


def _getitem_overridden(dataset: "Dataset", base: type) -> bool:
    """Whether a subclass of `base` defines its own __getitem__: a batch indexing base's arrays
    at once would silently skip it (the DataLoader gave the stored rows, not its examples)."""
    return type(dataset).__getitem__ is not base.__getitem__


class Dataset:
    """A sized collection of examples; subclasses implement __getitem__ and __len__."""

    def __init__(self, transforms: Sequence[Callable] | None = None):
        self.transforms = transforms

    def __getitem__(self, index):
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def apply_transforms(self, x: np.ndarray) -> np.ndarray:
        for transform in self.transforms or ():
            x = transform(x)
        return x

    def batch(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
        """The examples at indices, stacked field by field."""
        examples = [self[int(i)] for i in indices]
        if not isinstance(examples[0], tuple | list):  # a list [x, y] is fields too
            examples = [(e,) for e in examples]
        return tuple(np.stack(field) for field in zip(*examples, strict=True))


class ArrayDataset(Dataset):
    """Examples held in memory: X[i] (with transforms applied) and, when given, y[i]."""

    def __init__(self, X: np.ndarray, y: np.ndarray | None = None, transforms=None):
        super().__init__(transforms)
        # lists become arrays: batches index them with an array of positions
        X, y = (np.asarray(a) if isinstance(a, list | tuple) else a for a in (X, y))
        if y is not None and len(X) != len(y):
            raise ValueError(f"{len(X)} inputs but {len(y)} labels")
        self.X = X
        self.y = y

    def __getitem__(self, index):
        x = self.apply_transforms(self.X[index])
        return x if self.y is None else (x, self.y[index])

    def __len__(self) -> int:
        return len(self.X)

    def batch(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
        """The rows at indices at once, unless examples are not the stored rows: random
        per-example transforms, or a subclass's own __getitem__, go one example at a time."""
        if self.transforms or _getitem_overridden(self, ArrayDataset):
            return super().batch(indices)
        return (self.X[indices],) if self.y is None else (self.X[indices], self.y[indices])


class NDArrayDataset(Dataset):
    """The CMU course's dataset of parallel arrays: example i is (a[i] for a in arrays)."""

    def __init__(self, *arrays: np.ndarray):
        super().__init__()
        if not arrays:
            raise ValueError("NDArrayDataset needs at least one array")
        self.arrays = tuple(np.asarray(a) for a in arrays)
        lengths = [len(a) for a in self.arrays]
        if len(set(lengths)) != 1:
            raise ValueError(f"NDArrayDataset arrays differ in length: {lengths}")

    def __getitem__(self, index):
        return tuple(a[index] for a in self.arrays)

    def __len__(self) -> int:
        return len(self.arrays[0])

    def batch(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
        if _getitem_overridden(self, NDArrayDataset):  # its examples are its own
            return super().batch(indices)
        return tuple(a[indices] for a in self.arrays)


class DataLoader:
    """Batches of a dataset as tuples of Tensors (one per field of an example).

    shuffle reorders every epoch: from a generator seeded by `seed` when one is given, else
    from numpy's global generator (so np.random.seed makes the order reproducible, as in the
    CMU course); drop_last skips a final batch smaller than batch_size.
    """

    def __init__(self, dataset: Dataset, batch_size: int = 1, shuffle: bool = False,
                 drop_last: bool = False, seed: int | None = None, device=None,
                 dtype: str = "float32"):
        if not is_positive_int(batch_size):
            raise ValueError(f"batch_size must be positive and an integer, got {batch_size!r}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.device = device
        self.dtype = dtype
        self.rng = np.random if seed is None else np.random.default_rng(seed)

    def reseed(self, seed) -> None:
        """Shuffle from a generator seeded by `seed` from now on: a training loop that reseeds
        every epoch with (seed, epoch) shuffles a resumed run as it did the uninterrupted one."""
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        n, b = len(self.dataset), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        n = len(self.dataset)
        order = self.rng.permutation(n) if self.shuffle else np.arange(n)
        for batch in range(len(self)):
            indices = order[batch * self.batch_size : (batch + 1) * self.batch_size]
            yield tuple(
                Tensor(field, device=self.device, dtype=self.dtype, requires_grad=False)
                for field in self.dataset.batch(indices)
            )
