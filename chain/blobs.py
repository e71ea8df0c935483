"""Content-addressed binary blobs: the operands and results of matmul jobs.

A blob is ``b"NNB1"`` + dtype code (1 byte) + ndim (1 byte) + 2 zero bytes +
ndim little-endian uint64 dims + the raw little-endian C-order array bytes.
Its id is ``sha256(blob)``: the hash covers the bytes, the shape and the dtype,
so a blob id names exactly one array.
"""
from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

MAGIC = b"NNB1"
HEADER = struct.Struct("<4sBBxx")
DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"),
    1: np.dtype("i1"),
    2: np.dtype("<i2"),
    3: np.dtype("<i4"),
    4: np.dtype("<i8"),
}
DTYPE_CODES = {dt: code for code, dt in DTYPES.items()}
MAX_NDIM = 8


def encode_array(array: np.ndarray) -> bytes:
    """Serialise an array (float32, int8, int16, int32 or int64) to blob bytes."""
    array = np.asarray(array)
    code = DTYPE_CODES.get(array.dtype.newbyteorder("<"))
    if code is None:
        raise ValueError(
            f"unsupported dtype {array.dtype}; blobs hold float32, int8, int16, int32 or int64"
        )
    if array.ndim > MAX_NDIM:
        raise ValueError(f"array has {array.ndim} dims; blobs hold at most {MAX_NDIM}")
    data = np.ascontiguousarray(array, dtype=DTYPES[code]).tobytes()
    dims = struct.pack(f"<{array.ndim}Q", *array.shape)
    return HEADER.pack(MAGIC, code, array.ndim) + dims + data


def decode_array(blob: bytes) -> np.ndarray:
    """Parse blob bytes back into a read-only array; ValueError says what is corrupt."""
    if len(blob) < HEADER.size:
        raise ValueError(f"blob of {len(blob)} bytes is shorter than the {HEADER.size}-byte header")
    magic, code, ndim = HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise ValueError(f"bad blob magic {magic!r}, expected {MAGIC!r}")
    if code not in DTYPES:
        raise ValueError(f"unknown blob dtype code {code}")
    if ndim > MAX_NDIM:
        raise ValueError(f"blob declares {ndim} dims; at most {MAX_NDIM} allowed")
    dims_end = HEADER.size + 8 * ndim
    if len(blob) < dims_end:
        raise ValueError("blob truncated inside its dims")
    shape = struct.unpack_from(f"<{ndim}Q", blob, HEADER.size)
    dtype = DTYPES[code]
    expected = dtype.itemsize * int(np.prod(shape, dtype=object))
    if len(blob) - dims_end != expected:
        raise ValueError(
            f"blob data is {len(blob) - dims_end} bytes but shape {shape} of {dtype} "
            f"needs {expected}"
        )
    return np.frombuffer(blob, dtype=dtype, offset=dims_end).reshape(shape)


def blob_id(blob: bytes) -> bytes:
    """The 32-byte content address of a blob."""
    return hashlib.sha256(blob).digest()


def parse_id(text_or_bytes: str | bytes) -> bytes:
    """Accept a blob id as 32 bytes or ``0x``-prefixed hex; ValueError otherwise."""
    if isinstance(text_or_bytes, bytes | bytearray):
        raw = bytes(text_or_bytes)
    else:
        text = text_or_bytes[2:] if text_or_bytes.startswith(("0x", "0X")) else text_or_bytes
        try:
            raw = bytes.fromhex(text)
        except ValueError as exc:
            raise ValueError(f"blob id {text_or_bytes!r} is not hex") from exc
    if len(raw) != 32:
        raise ValueError(f"blob id must be 32 bytes, got {len(raw)}")
    return raw


class BlobStore:
    """Blobs on disk, one file per id; writes are atomic (temp file + rename)."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int = 256 * 2**20) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

    def path(self, id_: bytes | str) -> Path:
        return self.directory / parse_id(id_).hex()

    def put(self, data: bytes) -> bytes:
        """Store a blob after checking its size and format; returns its id."""
        if len(data) > self.max_bytes:
            raise ValueError(f"blob of {len(data)} bytes exceeds the {self.max_bytes}-byte limit")
        decode_array(data)
        id_ = blob_id(data)
        target = self.path(id_)
        if not target.exists():
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return id_

    def get(self, id_: bytes | str) -> bytes | None:
        try:
            return self.path(id_).read_bytes()
        except FileNotFoundError:
            return None

    def has(self, id_: bytes | str) -> bool:
        return self.path(id_).exists()
