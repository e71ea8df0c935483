"""MNIST from the original idx files (gzip-compressed or not)."""
import gzip
import struct
import zlib

import numpy as np

from ..data_basic import ArrayDataset

_IMAGES_MAGIC, _LABELS_MAGIC = 2051, 2049


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    # BadGzipFile is an OSError, a cut file an EOFError, a damaged deflate stream a zlib.error
    except (OSError, EOFError, zlib.error) as err:
        raise ValueError(f"{path}: corrupt or truncated gzip data ({err})") from err


def _check_header(path: str, raw: bytes, magic: int, header: int, kind: str) -> None:
    """ValueError naming the file unless raw starts with a whole idx header of this magic."""
    if not raw:
        raise ValueError(f"{path}: empty file, expected an idx {kind} file")
    found = struct.unpack(">I", raw[:4])[0] if len(raw) >= 4 else None
    if found != magic:
        raise ValueError(f"{path}: not an idx {kind} file (magic {found}, expected {magic})")
    if len(raw) < header:
        raise ValueError(f"{path}: {len(raw)} bytes, too short for the {header}-byte idx "
                         f"{kind} header")


def parse_mnist(image_filename: str, label_filename: str) -> tuple[np.ndarray, np.ndarray]:
    """Images as float32 (N, rows * cols) scaled to [0, 1], labels as uint8 (N,)."""
    X, y, _ = _parse(image_filename, label_filename)
    return X, y


def _parse(image_filename: str, label_filename: str
           ) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    images, labels = _read(image_filename), _read(label_filename)
    _check_header(image_filename, images, _IMAGES_MAGIC, 16, "image")
    _check_header(label_filename, labels, _LABELS_MAGIC, 8, "label")
    n, rows, cols = struct.unpack(">III", images[4:16])
    (n_labels,) = struct.unpack(">I", labels[4:8])
    if len(images) != 16 + n * rows * cols:
        raise ValueError(
            f"{image_filename}: header says {n} images of {rows}x{cols} "
            f"({16 + n * rows * cols} bytes) but the file has {len(images)} bytes"
        )
    if len(labels) != 8 + n_labels:
        raise ValueError(
            f"{label_filename}: header says {n_labels} labels, file has {len(labels) - 8}"
        )
    if n != n_labels:
        raise ValueError(f"{n} images but {n_labels} labels")
    X = np.frombuffer(images, dtype=np.uint8, offset=16).reshape(n, rows * cols)
    y = np.frombuffer(labels, dtype=np.uint8, offset=8).copy()
    return X.astype(np.float32) / 255.0, y, (rows, cols)


class MNISTDataset(ArrayDataset):
    """Examples are (flat 784 image in [0, 1], label), as in CMU needle; transforms see the
    image as rows x cols x 1 (28 x 28)."""

    def __init__(self, image_filename: str, label_filename: str, transforms=None):
        X, y, self.image_shape = _parse(image_filename, label_filename)
        super().__init__(X, y, transforms=transforms)

    def apply_transforms(self, x: np.ndarray) -> np.ndarray:
        """Transforms see the flat image as rows x cols x 1 (examples are ArrayDataset's, so
        a DataLoader batch without transforms reads the stored rows at once)."""
        if not self.transforms:
            return x
        return super().apply_transforms(x.reshape(*self.image_shape, 1)).reshape(-1)
