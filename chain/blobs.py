"""Content-addressed binary blobs: the operands and results of matmul jobs.

A blob is ``b"NNB1"`` + dtype code (1 byte) + ndim (1 byte) + 2 zero bytes +
ndim little-endian uint64 dims + the raw little-endian C-order array bytes.
Its id is ``BLAKE3-256(blob)`` (ids v2; v1 was sha256): the hash covers the bytes, the shape
and the dtype, so a blob id names exactly one array. `blob_id` and `blob_hasher` are the only
places that name the algorithm; every sender and receiver hashes through them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import math
import os
import secrets
import struct
import tempfile
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import blake3
import numpy as np

from chain.dirlock import sync_directory

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
HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
MAX_NDIM = 8
DEFAULT_MAX_BLOB_BYTES = 256 << 20  # a node's limit unless `chain up --max-blob-mb` says
# the store keeps this much of its file system free, by default (`chain up --blob-reserve-mb`):
# the chain's database shares the data dir, and a full disk stops it committing blocks
MIN_RESERVE_BYTES = 1 << 30
RESERVE_PERCENT = 5  # ... or this share of the file system, if more
PIPELINE_BYTES = 1 << 20  # an upload is hashed and written in steps of this size, on threads
WRITE_DEPTH = 2  # ... this many steps of one upload written at once, each at its own offset
BACKLOG_BYTES = 16 << 20  # received but not yet hashed and written, at most (memory bound)
SYNC_THREADS = 16  # fdatasyncs of one group commit in flight together
SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start write-back of the range, do not wait
DIRECT_ALIGN = 4096  # O_DIRECT writes: memory address, file offset and length multiples of it
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
# Linux's sync_file_range(2) and fallocate(2) (None elsewhere: the final fdatasync then
# flushes everything, and the file grows as it is written); ctypes calls release the GIL
_start_writeback = getattr(_libc, "sync_file_range", None)
if _start_writeback is not None:
    _start_writeback.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
_allocate = getattr(_libc, "fallocate", None)
if _allocate is not None:
    _allocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def encode_array(array: np.ndarray) -> bytes:
    """Serialise an array (float32, int8, int16, int32 or int64) to blob bytes."""
    array = np.asarray(array)
    header = encode_header(array)
    return header + np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def parse_header(prefix: bytes | bytearray | memoryview) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, data offset) from a blob's first bytes; ValueError says what is corrupt."""
    if len(prefix) < HEADER.size:
        raise ValueError(f"blob of {len(prefix)} bytes is shorter than the {HEADER.size}-byte "
                         "header")
    magic, code, ndim = HEADER.unpack_from(prefix)
    if magic != MAGIC:
        raise ValueError(f"bad blob magic {magic!r}, expected {MAGIC!r}")
    if code not in DTYPES:
        raise ValueError(f"unknown blob dtype code {code}")
    if ndim > MAX_NDIM:
        raise ValueError(f"blob declares {ndim} dims; at most {MAX_NDIM} allowed")
    dims_end = HEADER.size + 8 * ndim
    if len(prefix) < dims_end:
        raise ValueError("blob truncated inside its dims")
    return DTYPES[code], struct.unpack_from(f"<{ndim}Q", prefix, HEADER.size), dims_end


def check_size(dtype: np.dtype, shape: tuple[int, ...], data_bytes: int) -> None:
    """ValueError unless `data_bytes` fill `shape` exactly and numpy can hold the shape: a
    zero dim makes the data empty whatever the other dims, so those are bounded as numpy
    bounds them (size times itemsize, zeros counted as 1, within intp), else the store would
    keep a blob that no reader can decode."""
    if dtype.itemsize * math.prod(max(dim, 1) for dim in shape) > np.iinfo(np.intp).max:
        raise ValueError(f"blob shape {shape} is too large for an array")
    expected = dtype.itemsize * math.prod(shape)
    if data_bytes != expected:
        raise ValueError(f"blob data is {data_bytes} bytes but shape {shape} of {dtype} "
                         f"needs {expected}")


def encode_header(array: np.ndarray) -> bytes:
    """The header of `array`'s blob (the data follows as its raw C-order bytes)."""
    code = DTYPE_CODES.get(array.dtype.newbyteorder("<"))
    if code is None:
        raise ValueError(
            f"unsupported dtype {array.dtype}; blobs hold float32, int8, int16, int32 or int64"
        )
    if array.ndim > MAX_NDIM:
        raise ValueError(f"array has {array.ndim} dims; blobs hold at most {MAX_NDIM}")
    return HEADER.pack(MAGIC, code, array.ndim) + struct.pack(f"<{array.ndim}Q", *array.shape)


def decode_array(blob: bytes | bytearray | memoryview) -> np.ndarray:
    """Parse blob bytes back into an array (a view of `blob`); ValueError says what is
    corrupt."""
    dtype, shape, offset = parse_header(blob)
    check_size(dtype, shape, len(blob) - offset)
    return np.frombuffer(blob, dtype=dtype, offset=offset).reshape(shape)


def blob_id(blob: bytes | bytearray | memoryview) -> bytes:
    """The 32-byte content address of a blob: its BLAKE3-256."""
    return blob_hasher().update(blob).digest()


def blob_hasher() -> blake3.blake3:
    """An incremental blob id: ``update(chunk)`` with the blob's bytes in order, then
    ``digest()``, the 32-byte id. It releases the GIL, so a thread can hash received chunks
    while another receives the next ones."""
    return blake3.blake3()


def parse_id(text_or_bytes: str | bytes) -> bytes:
    """Accept a blob id as 32 bytes or ``0x``-prefixed hex; ValueError otherwise."""
    if isinstance(text_or_bytes, bytes | bytearray):
        raw = bytes(text_or_bytes)
    else:
        text = text_or_bytes[2:] if text_or_bytes.startswith(("0x", "0X")) else text_or_bytes
        # checked before bytes.fromhex, which skips whitespace: one id, one spelling
        if not HEX_DIGITS.issuperset(text) or len(text) % 2:
            raise ValueError(f"blob id {text_or_bytes[:80]!r} is not hex")
        raw = bytes.fromhex(text)
    if len(raw) != 32:
        raise ValueError(f"blob id must be 32 bytes, got {len(raw)}")
    return raw


class BlobTooLarge(ValueError):
    """A blob over the store's size limit."""


class BlobStoreFull(OSError):
    """An upload that would leave less than the store's free-space reserve on its disk (an
    OSError with ENOSPC: both blob servers answer it 507, as a disk really full)."""


def default_reserve(directory: str | os.PathLike) -> int:
    """The free space a store keeps by default: MIN_RESERVE_BYTES or RESERVE_PERCENT of its
    file system, whichever is more."""
    fs = os.statvfs(directory)
    return max(MIN_RESERVE_BYTES, fs.f_blocks * fs.f_frsize * RESERVE_PERCENT // 100)


def free_bytes(directory: str | os.PathLike) -> int:
    """Bytes of `directory`'s file system that an unprivileged process can still fill."""
    fs = os.statvfs(directory)
    return fs.f_bavail * fs.f_frsize


class BlobStore:
    """Blobs on disk, one file per id; writes are atomic (temp file + rename). An upload is
    refused (BlobStoreFull) if it would leave less than `reserve_bytes` free on the disk
    (None: `default_reserve`; 0: no reserve), else one uploader could fill the disk under
    the chain's database and halt the chain."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int = 256 * 2**20,
                 reserve_bytes: int | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.reserve_bytes = default_reserve(self.directory) if reserve_bytes is None \
            else reserve_bytes
        self.claimed = 0  # bytes promised to uploads in progress, not yet held by their files
        self.space_lock = threading.Lock()
        self.direct_io = hasattr(os, "O_DIRECT")  # cleared if the filesystem refuses it
        # names this store to clients (both of a node's blob servers send it on every reply),
        # so that one can tell the advertised blob port from another store on the same port
        self.identity = secrets.token_hex(16)
        self.sync_pool = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="blob-sync")

    def path(self, id_: bytes | str) -> Path:
        return self.directory / parse_id(id_).hex()

    def discard_partial_uploads(self) -> int:
        """Delete the temp files of uploads that never committed (a process killed mid-upload
        leaves them); the number deleted. Only for the store's one owner, before it serves:
        another writer's upload in progress would be lost."""
        count = 0
        for tmp in self.directory.glob(".tmp-*"):
            tmp.unlink(missing_ok=True)
            count += 1
        return count

    def put(self, data: bytes) -> bytes:
        """Store a blob after checking its size and format; returns its id."""
        writer = self.writer(len(data))
        writer.write(data)
        id_ = writer.commit(blob_id(data))
        self.sync_directory()
        return id_

    def writer(self, declared_size: int | None = None) -> BlobWriter:
        """A streamed upload of one blob (size limit checked up front when declared)."""
        if declared_size is not None and declared_size > self.max_bytes:
            raise BlobTooLarge(f"blob of {declared_size} bytes exceeds the {self.max_bytes}-byte "
                               "limit")
        return BlobWriter(self, declared_size)

    def check_space(self, nbytes: int) -> None:
        """BlobStoreFull unless `nbytes` more can be written and the disk still have the
        reserve free, counting the bytes claimed by uploads in progress."""
        if not self.reserve_bytes:
            return
        left = free_bytes(self.directory) - self.claimed - nbytes
        if left < self.reserve_bytes:
            raise BlobStoreFull(errno.ENOSPC, (
                f"free-space reserve reached: {nbytes} more bytes would leave "
                f"{max(left, 0) >> 20} MiB free on the disk, under the {self.reserve_bytes >> 20}"
                " MiB kept for the chain database (chain up --blob-reserve-mb)"))

    def claim_space(self, nbytes: int) -> None:
        """`check_space`, then count `nbytes` as taken until `release_space` (concurrent
        uploads cannot all pass against the same free space)."""
        with self.space_lock:
            self.check_space(nbytes)
            self.claimed += nbytes

    def release_space(self, nbytes: int) -> None:
        with self.space_lock:
            self.claimed -= nbytes

    def commit_uploads(self, uploads: list[tuple[BlobWriter, bytes]]
                       ) -> tuple[list[str], list[str]]:
        """Group commit of received uploads (writer, claimed id): each blob checked, then all
        fdatasynced at once on `SYNC_THREADS` threads (concurrent flushes share the
        filesystem's journal commits: measured 2x faster than one after the other for 100
        small files) and renamed, then one directory fsync for all; an upload is
        acknowledged only after it. Returns (stored ids, errors naming each refused blob);
        on a disk error every writer is aborted (no temp file left) and the error raised."""
        checked, errors = [], []
        try:
            for i, (writer, id_) in enumerate(uploads):
                try:
                    writer.check(id_)
                    checked.append(writer)
                except ValueError as exc:
                    errors.append(f"blob {i} (0x{id_.hex()}): {exc}")
            if len(checked) == 1:
                checked[0].persist()
            else:  # all ended before any error is raised: the aborts below must not close a
                # file descriptor that another writer's persist is still using
                persists = [self.sync_pool.submit(BlobWriter.persist, w) for w in checked]
                wait(persists)
                for persist in persists:
                    persist.result()
            if checked:
                self.sync_directory()
        except BaseException:
            for writer, _ in uploads:
                writer.abort()
            raise
        return ["0x" + w.id.hex() for w in checked], errors

    def sync_directory(self) -> None:
        """Make the renames of committed blobs durable: one fsync of the directory covers
        every blob renamed into it before, so a batch of uploads pays it once."""
        sync_directory(self.directory)

    def get(self, id_: bytes | str) -> bytes | None:
        try:
            return self.path(id_).read_bytes()
        except FileNotFoundError:
            return None

    def head(self, id_: bytes | str) -> bytes | None:
        """A blob's header (its first bytes, the longest header there can be): what it holds
        is known without reading it, which may be hundreds of MB."""
        try:
            with self.path(id_).open("rb") as f:
                return f.read(HEADER.size + 8 * MAX_NDIM)
        except FileNotFoundError:
            return None

    def has(self, id_: bytes | str) -> bool:
        return self.path(id_).exists()


class BlobWriter:
    """Receives one blob in chunks and writes it to a temp file (the body is never held in
    memory), then fsyncs and renames the file into place once the size, the id and the
    header check out. Any failure leaves nothing behind. The rename is durable only after
    the store's `sync_directory()`.

    A blob from `PIPELINE_BYTES` on is a pipeline: every `PIPELINE_BYTES` received go to a
    hash thread and to one of `WRITE_DEPTH` write threads (the hasher and os.pwrite release
    the GIL), so chunk i is hashed and written while chunk i+1 is received, and the disk
    has `WRITE_DEPTH` writes of the blob in flight at their own offsets. A declared size is
    allocated up front (fallocate), so those writes land inside the file: ext4 serialises
    direct writes that extend a file or fill a hole (measured on the 16-core host, 64 MiB
    with two writes in flight: 1.58 GB/s median appended, 1.99 allocated; this VM 1.20
    against 1.52). Chunks written through the page cache have their write-back started at
    once, so the final fdatasync has little left to flush. Smaller blobs are hashed and
    written by `check()`, on the caller's thread. Chunks handed to `write()` must not change
    afterwards (they are kept until written; `settled` says how many bytes from the start
    are hashed and written).

    A chunk whose memory and file offset are `DIRECT_ALIGN`-aligned (the blob listener's
    receive buffers) is written with O_DIRECT, from the buffer straight to the disk, its
    last partial block through the page cache: on this VM a buffered 16 MiB write and
    fdatasync took 22-102 ms (fresh page-cache pages are costly here), O_DIRECT 13-15 ms
    and 2.5 ms of CPU. Other chunks are written through the page cache."""

    def __init__(self, store: BlobStore, declared_size: int | None = None) -> None:
        self.store = store
        self.declared_size = declared_size
        self.id: bytes | None = None  # set once the body checked out
        self.digest = blob_hasher()
        self.size = 0
        self.prefix = bytearray()  # the first bytes, enough for the header and dims
        store.claim_space(declared_size or 0)  # BlobStoreFull before any file is made
        self.claimed = declared_size or 0  # released once the file holds it, or dropped
        try:
            self.fd, self.tmp = tempfile.mkstemp(dir=store.directory, prefix=".tmp-")
        except BaseException:
            self._release_claim()
            raise
        self.direct_fd = -1  # the temp file opened with O_DIRECT, once a chunk qualifies
        self.allocated = 0  # file size set up front
        self.received: list = []  # chunks not yet handed to the hash and write steps
        self.received_bytes = 0
        self.lanes: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self.in_flight: deque[tuple[Future, Future, int]] = deque()
        self.in_flight_bytes = 0
        self.handed = self.settled = 0  # bytes handed to the write steps; hashed and written
        self.aborted = False

    def write(self, chunk: bytes | memoryview) -> None:
        self.size += len(chunk)
        if self.size > self.store.max_bytes:
            self.abort()
            raise BlobTooLarge(f"blob exceeds the {self.store.max_bytes}-byte limit")
        if self.declared_size is None:  # not claimed up front: checked as it arrives
            try:
                self.store.check_space(len(chunk) + self.held_bytes())
            except BlobStoreFull:
                self.abort()
                raise
        if len(self.prefix) < HEADER.size + 8 * MAX_NDIM:
            self.prefix += chunk[:HEADER.size + 8 * MAX_NDIM - len(self.prefix)]
        self.received.append(chunk)
        self.received_bytes += len(chunk)
        if self.received_bytes >= PIPELINE_BYTES:
            self._hand_over()

    def lagging(self) -> Future | None:
        """The oldest step still running while more than `BACKLOG_BYTES` are in flight: a
        receiver waits for it before taking more (memory stays bounded). Raises what a
        finished step raised (a failed write must not be forgotten)."""
        while self.in_flight and self.in_flight[0][0].done() and self.in_flight[0][1].done():
            hashed, written, nbytes = self.in_flight[0]
            hashed.result()  # a failed step stays in flight: check() raises it again
            written.result()
            self.in_flight.popleft()
            self.in_flight_bytes -= nbytes
            self.settled += nbytes
        if self.in_flight_bytes <= BACKLOG_BYTES:
            return None
        hashed, written, _ = self.in_flight[0]
        return written if hashed.done() else hashed

    def held_bytes(self) -> int:
        """Received bytes this writer holds in memory until `finish()` or `check()`."""
        return self.received_bytes + self.in_flight_bytes

    def _hand_over(self) -> None:
        chunks, self.received, nbytes = self.received, [], self.received_bytes
        self.received_bytes = 0
        if self.direct_fd < 0 and self.store.direct_io and \
                self._direct_bytes(memoryview(chunks[0]).cast("B"), self.handed, opened=False):
            self._open_direct()
        if self.lanes is None:
            self._allocate()
            self.lanes = (ThreadPoolExecutor(1, thread_name_prefix="blob-hash"),
                          ThreadPoolExecutor(WRITE_DEPTH, thread_name_prefix="blob-write"))
        self.in_flight.append((self.lanes[0].submit(self._hash, chunks),
                               self.lanes[1].submit(self._write, chunks, self.handed), nbytes))
        self.handed += nbytes
        self.in_flight_bytes += nbytes

    def _open_direct(self) -> None:
        """The O_DIRECT descriptor, opened on the receiving thread before the first step
        that can use it (the write threads share it)."""
        try:
            self.direct_fd = os.open(self.tmp, os.O_WRONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.store.direct_io = False  # the filesystem refuses O_DIRECT

    def _allocate(self) -> None:
        """The declared size allocated before the first write step (best effort: a
        filesystem without fallocate grows the file as it is written)."""
        if _allocate is not None and self.declared_size and \
                _allocate(self.fd, 0, 0, self.declared_size) == 0:
            self.allocated = self.declared_size
            self._release_claim()  # the file holds the space now: statvfs counts it

    def _hash(self, chunks: list) -> None:
        for chunk in chunks:
            self.digest.update(chunk)

    def _write(self, chunks: list, offset: int) -> None:
        """Write `chunks` from file offset `offset` (a write thread; steps run side by
        side)."""
        if self.aborted:
            return
        buffered = []
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            direct = self._direct_bytes(view, offset)
            if direct:
                try:
                    _pwrite(self.direct_fd, view[:direct], offset)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self.store.direct_io = False  # the filesystem refuses O_DIRECT
                    direct = 0
            if direct < len(view):
                _pwrite(self.fd, view[direct:], offset + direct)
                buffered.append((offset + direct, len(view) - direct))
            offset += len(view)
        if _start_writeback is not None and buffered:
            start = buffered[0][0]
            _start_writeback(self.fd, start, sum(buffered[-1]) - start, SYNC_FILE_RANGE_WRITE)

    def _direct_bytes(self, view: memoryview, offset: int, opened: bool = True) -> int:
        """How much of `view`, written at `offset`, can go with O_DIRECT (whole aligned
        blocks; `opened`: through the descriptor opened for it)."""
        if (opened and self.direct_fd < 0) or not self.store.direct_io or \
                offset % DIRECT_ALIGN or \
                len(view) < DIRECT_ALIGN or np.frombuffer(view, np.uint8).ctypes.data % \
                DIRECT_ALIGN:
            return 0
        return len(view) - len(view) % DIRECT_ALIGN

    def finish(self) -> None:
        """Hash and write everything received so far (blocks); raises what a hash or write
        step raised."""
        if self.lanes is None:
            chunks, self.received, self.received_bytes = self.received, [], 0
            self._hash(chunks)
            self._write(chunks, self.handed)
            self.handed = self.settled = self.size
            return
        if self.received:
            self._hand_over()
        for hashed, written, _ in self.in_flight:
            hashed.result()
            written.result()
        self.in_flight.clear()
        self.in_flight_bytes = 0
        self.settled = self.size

    def commit(self, id_: bytes) -> bytes:
        """Check that the blob is `id_` and well formed, and store it; returns its id.
        ValueError says what was wrong."""
        self.check(id_)
        self.persist()
        return id_

    def check(self, id_: bytes) -> None:
        """ValueError (and nothing left behind) unless the body hashes to `id_` and is a
        well-formed blob. Blocks until every chunk is hashed and written."""
        try:
            self.finish()
            if self.digest.digest() != id_:
                raise ValueError(f"BLAKE3 of the body is 0x{self.digest.hexdigest()}, "
                                 f"not 0x{id_.hex()}")
            dtype, shape, offset = parse_header(self.prefix)
            if any(self.prefix[HEADER.size - 2:HEADER.size]):
                # refused here, not by parse_header: blobs stored before decode as they did
                raise ValueError("blob header bytes 6-7 must be zero")
            check_size(dtype, shape, self.size - offset)
        except BaseException:
            self.abort()
            raise
        self.id = id_

    def persist(self) -> None:
        """fdatasync the checked blob and rename it into place (dropped if the store has it:
        content-addressed, the same bytes are already there, unless the stored file has lost
        some of them, which this upload then repairs). Blocks on the disk: a batch runs these
        on several threads, so the filesystem joins their flushes."""
        try:
            target = self.store.path(self.id)
            if target.exists() and target.stat().st_size == self.size:
                self.abort()
                return
            if self.allocated > self.size:  # declared more than came: the file is the blob
                os.ftruncate(self.fd, self.size)
            os.fdatasync(self.fd)
            self._close()
            os.replace(self.tmp, target)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop the upload. Steps still queued are skipped; the file is closed and removed
        once the write steps running are done with it (on their threads: never blocks)."""
        if self.aborted:
            return
        self.aborted = True
        lanes, self.lanes = self.lanes, None
        if lanes is None:
            self._remove()
            return
        for lane in lanes:
            lane.shutdown(wait=False, cancel_futures=True)
        running = [written for _, written, _ in self.in_flight if not written.done()]
        remaining = [len(running)]
        lock = threading.Lock()

        def step_done(_: Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._remove()

        if not running:
            self._remove()
        for written in running:
            written.add_done_callback(step_done)

    def _remove(self) -> None:
        self._close()
        Path(self.tmp).unlink(missing_ok=True)

    def _release_claim(self) -> None:
        claimed, self.claimed = self.claimed, 0
        if claimed:
            self.store.release_space(claimed)

    def _close(self) -> None:
        self._release_claim()
        for fd in (self.fd, self.direct_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = -1
        if self.lanes is not None:
            for lane in self.lanes:
                lane.shutdown(wait=False)
            self.lanes = None


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        offset += n
        view = view[n:]
