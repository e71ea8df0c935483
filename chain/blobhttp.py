"""Blobs over HTTP, both ends: `BlobApp`, a raw ASGI app mounted at `/blobs` of the node's
server, and `BlobClient`, the client workers and submitters use.

Bulk bytes skip every per-request framework layer: an upload is hashed and written to a
temp file as it arrives, on threads beside the event loop (`BlobWriter`; never held in
memory), a download is read from disk in large chunks, and the client sends an array's
header and data buffer as they are (a large blob hashed while it is sent, its id after its
bytes) and receives into one preallocated buffer of the announced size, hashing as it reads.
"""
from __future__ import annotations

import asyncio
import errno
import http.client
import json
import logging
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from chain.blobs import (
    BACKLOG_BYTES,
    BlobStore,
    BlobTooLarge,
    BlobWriter,
    blob_hasher,
    decode_array,
    encode_header,
    parse_id,
)
from chain.keepalive import Connections

CHUNK = 4 << 20
STREAM_BYTES = 1 << 20  # from this size an upload goes alone, hashed while it is sent
FRAME_LENGTH = struct.Struct("<Q")  # a batch frame: <u64 length><blob><its id>
ID_BYTES = 32
MAX_BATCH_BLOBS = 256  # blobs per POST (each holds a temp file open until the batch commits)
BATCH_BYTES = 8 << 20  # the client batches blobs below STREAM_BYTES up to this much
HASH_THREAD_BYTES = 8 << 20  # downloads from this size are hashed on a second thread
HASH_STEP = 1 << 20  # ... in steps of this size (measured: a gain at 16 MiB, a loss at 4)
HASH_THREADS = 8  # streamed uploads hashed at once (put_arrays runs up to 8 uploads)
SEND_STEP = 1 << 20  # a streamed upload checks between sends whether the store has the blob
BODY_TIMEOUT = 120.0  # an upload whose next body bytes take longer is dropped (408)
DRAIN_LIMIT = 1 << 30  # the unread body of a refused upload is read and dropped up to this
# much (so the client, which sends its whole body before reading, gets the reply)
LENGTH_DIGITS = 20  # a Content-Length with more significant digits is refused (> 2**64)
REPLY_BYTES = 1 << 16  # a store's JSON reply or error text, at most (the client refuses more)
ALLOWED = b"GET, HEAD, PUT"  # the methods of /blobs/0x<id> (405's Allow; POST is /blobs/'s)
CLOSE = ((b"connection", b"close"),)
STORE_HEADER = "x-blob-store"  # a store's `identity`, on every reply of both blob servers
CONNECT_TIMEOUT = 3.0  # s: a blob port that does not accept sooner is taken as firewalled
PROBE_TIMEOUT = 10.0  # s, at most, for the one small request that asks a port which store
PROBE_PATH = "/0x" + "00" * ID_BYTES  # what that request asks for (any reply names the store)
REFUSED_RETRY_SECONDS = 0.25  # pause between tries of a request the store refused to connect
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})  # 507, not 500

log = logging.getLogger(__name__)


class BlobError(ValueError):
    """A blob that could not be stored or fetched, or whose bytes do not match its id."""


class BlobNotFound(BlobError, KeyError):
    """The store has no blob with this id."""


class BlobCutOff(BlobError, ConnectionError):
    """The store's answer ended before the blob did (a store restarting, a dropped link):
    network trouble, so callers that retry those (node.market.is_transient) retry it."""


class BatchReceiver:
    """The body of `POST <mount>`: several blobs, each framed as <u64 length><blob>
    <blob_id(blob)>. The id follows the bytes, so a sender can hash while it sends; each blob
    goes to a `BlobWriter` as it arrives and is stored (`BlobStore.commit_uploads`) only if
    it matches. Fed the body in pieces by either server (`feed`), which between pieces
    hashes and writes the small blobs held (`finish_held`, when `holds_too_much`) and waits
    for a large blob's lagging step (`lagging`). Pieces must not change afterwards."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store
        self.limit = store.max_bytes + MAX_BATCH_BLOBS * (FRAME_LENGTH.size + ID_BYTES)
        self.uploads: list[tuple[BlobWriter, bytes]] = []
        self.starts: list[int] = []  # where each blob's bytes begin in the body
        self.writer: BlobWriter | None = None  # the blob being received
        self.remaining = 0  # of its bytes
        self.pending = bytearray()  # a length or an id being received
        self.total = self.held = 0
        self.position = 0  # body bytes consumed
        self.unsettled = 0  # the first upload whose writer may still need its bytes

    def check_declared(self, length: int) -> None:
        """Refuse a body of `length` before it is read: BlobTooLarge over the size limit,
        BlobStoreFull (an OSError: 507) if it would cross the store's free-space reserve
        (each blob's own claim, as it starts, is checked again)."""
        if length > self.limit:
            raise BlobTooLarge(f"batch of {length} bytes exceeds the {self.limit}-byte limit")
        self.store.check_space(length)

    def feed(self, body: memoryview) -> None:
        """Take the next piece of the body. ValueError (BlobTooLarge: 413) says what is
        wrong with the batch."""
        self.total += len(body)
        if self.total > self.limit:
            raise BlobTooLarge(f"batch exceeds the {self.limit}-byte limit")
        while body:
            if self.writer is not None and self.remaining:  # inside a blob's bytes
                take = body[:self.remaining]
                self.writer.write(take)
                self.remaining -= len(take)
                body = body[len(take):]
                self.position += len(take)
                continue
            need = ID_BYTES if self.writer is not None else FRAME_LENGTH.size
            take = body[:need - len(self.pending)]
            self.pending += take
            body = body[len(take):]
            self.position += len(take)
            if len(self.pending) < need:
                continue
            if self.writer is None:  # a length: the next blob starts
                if len(self.uploads) == MAX_BATCH_BLOBS:
                    raise ValueError(f"more than {MAX_BATCH_BLOBS} blobs in one batch")
                (self.remaining,) = FRAME_LENGTH.unpack(self.pending)
                self.writer = self.store.writer(self.remaining)
                self.starts.append(self.position)
            else:  # its id: the blob is complete
                self.uploads.append((self.writer, bytes(self.pending)))
                self.held += self.writer.held_bytes()
                self.writer = None
            self.pending.clear()

    def holds_too_much(self) -> bool:
        return self.held > BACKLOG_BYTES

    def finish_held(self) -> None:
        """Hash and write the small blobs received so far (blocks)."""
        for writer, _ in self.uploads:
            writer.finish()
        self.held = 0

    def lagging(self) -> Future | None:
        return None if self.writer is None else self.writer.lagging()

    def settled(self) -> int:
        """Body bytes from the start that no writer needs any more (hashed and written)."""
        writers = [w for w, _ in self.uploads] + [self.writer] * (self.writer is not None)
        while self.unsettled < len(writers):
            writer = writers[self.unsettled]
            writer.lagging()  # brings its `settled` up to date
            if writer is self.writer or writer.settled < writer.size:
                break
            self.unsettled += 1
        if self.unsettled < len(writers):
            return self.starts[self.unsettled] + writers[self.unsettled].settled
        return self.position - len(self.pending)

    def end(self) -> list[tuple[BlobWriter, bytes]]:
        """The complete uploads once the body is over; ValueError if it ends inside one."""
        if self.writer is not None or self.pending:
            raise ValueError(f"body ends inside blob {len(self.uploads)}")
        return self.uploads

    def error(self, exc: ValueError) -> tuple[int, dict]:
        """The reply to a batch refused by `exc`."""
        if isinstance(exc, BlobTooLarge):
            return 413, {"error": f"blob {len(self.uploads)}: {exc}"}
        return 400, {"error": f"not stored: {exc}"}

    def abort(self) -> None:
        """Nothing of a broken batch is stored."""
        for writer in [w for w, _ in self.uploads] + [self.writer] * (self.writer is not None):
            writer.abort()


def parse_length(value: str | bytes) -> int | None:
    """A Content-Length value as a number; None unless it is plain ASCII digits (int() also
    takes "+5", "1_0" and other scripts' digits) with at most LENGTH_DIGITS significant ones.
    Leading zeros are allowed: int() alone raised ValueError past 4300 digits, zeros
    included (a traceback and no reply, where the length was a valid one)."""
    digits = value.decode("latin-1") if isinstance(value, bytes) else value
    if not (digits.isascii() and digits.isdigit()):
        return None
    significant = digits.lstrip("0")
    return int(significant or "0") if len(significant) <= LENGTH_DIGITS else None


def declared_length(scope) -> int | None:
    """A request's Content-Length; None if it has none (chunked, or no body)."""
    declared = dict(scope["headers"]).get(b"content-length")
    return None if declared is None else parse_length(declared)  # uvicorn checked it


def unframed(scope) -> bool:
    """An upload with neither Content-Length nor Transfer-Encoding: in HTTP/1.1 its body is
    empty, which would be refused as a blob of 0 bytes, not for what is wrong (411)."""
    names = {name for name, _ in scope["headers"]}
    return scope["method"] in ("PUT", "POST") and not \
        {b"content-length", b"transfer-encoding"} & names


def unbounded(declared: int | None) -> tuple[tuple[bytes, bytes], ...]:
    """The headers of a refusal sent before the body is read: uvicorn reads and drops the rest
    of a body, so a chunked one or one over `DRAIN_LIMIT` (which may never end) closes the
    connection instead."""
    return CLOSE if declared is None or declared > DRAIN_LIMIT else ()


def commit_reply(store: BlobStore, uploads: list[tuple[BlobWriter, bytes]], batch: bool
                 ) -> tuple[int, dict]:
    """Commit received uploads (blocks on the disk); the reply to `PUT` (`batch` false: one
    upload) or `POST`."""
    stored, errors = store.commit_uploads(uploads)
    if errors:
        return 400, ({"error": "not stored: " + "; ".join(errors), "stored": stored} if batch
                     else {"error": f"not stored: {errors[0]}"})
    if batch:
        return 200, {"ids": stored}
    writer, id_ = uploads[0]
    return 200, {"id": "0x" + id_.hex(), "size": writer.size}


def store_failure(exc: OSError) -> tuple[int, dict]:
    """The reply to an upload the store could not write (its temp files already removed):
    507 when the disk, a quota or a file size limit is full, else 500, naming the cause;
    before, the listener cut the connection (a client retried it as network trouble) and the
    main port answered a bare 500 with a traceback in its log."""
    status = 507 if exc.errno in DISK_FULL_ERRNOS else 500
    return status, {"error": f"not stored: the blob store could not write it: "
                             f"{exc.strerror or exc}"}


def not_found(id_: bytes) -> dict:
    return {"error": f"blob 0x{id_.hex()} not found"}


def blob_route(path: str) -> str | None:
    """What a request path names: "" the mount (`/blobs/`: batch uploads), a blob id as
    written (`/blobs/0x<id>`), or None, no route: a nested path (`/blobs/x/0x<id>`,
    `/blobs/../0x<id>`) would be one more spelling of a blob's URL. Empty segments are
    skipped (a base URL given with a trailing slash)."""
    segments = [segment for segment in path.split("/") if segment]
    if not segments or segments[0] != "blobs" or len(segments) > 2:
        return None
    return segments[1] if len(segments) == 2 else ""


class UploadStalled(Exception):
    """No body bytes for the server's body timeout: the upload is dropped (408)."""


class BodyWatch:
    """Raises UploadStalled in the task reading an upload's body once a receive has waited
    `timeout` s: one timer per upload, moved on lazily (asyncio.wait_for around every body
    message cost ~35 us of event loop each, against ~2 for the receive itself)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.waiting_since: float | None = None
        self.stalled = False
        self.timer = self.loop.call_later(timeout, self._check)

    async def receive(self, receive) -> dict:
        self.waiting_since = self.loop.time()
        try:
            return await receive()
        except asyncio.CancelledError:
            if not self.stalled:
                raise
            if hasattr(self.task, "uncancel"):  # Python 3.11+: this cancel is handled here
                self.task.uncancel()
            raise UploadStalled(f"no body bytes for {self.timeout:g} s: upload dropped"
                                ) from None
        finally:
            self.waiting_since = None

    def _check(self) -> None:
        since, now = self.waiting_since, self.loop.time()
        idle = 0.0 if since is None else now - since  # only a wait on the client counts
        if idle >= self.timeout:
            self.stalled = True
            self.task.cancel()
        else:
            self.timer = self.loop.call_later(self.timeout - idle, self._check)

    def close(self) -> None:
        self.timer.cancel()


class BlobApp:
    """`PUT/GET/HEAD /blobs/0x<id>` and `POST /blobs` over a BlobStore (ASGI), on the node's
    main port (`chain/blobserver.py` serves the same on a port of its own, faster). uvicorn
    bounds no request body in time: a client that stops mid-upload without closing would hold
    its temp file and connection for good, so a wait for body bytes ends after `body_timeout` s."""

    def __init__(self, store: BlobStore, body_timeout: float = BODY_TIMEOUT) -> None:
        self.store = store
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        send = self._naming_the_store(send)
        method = scope["method"]
        name = blob_route(scope["path"])
        if name is None:
            await json_reply(send, 404, {"error": f"no route {scope['path'][:100]}"},
                             head=method == "HEAD")
            return
        if unframed(scope):
            await json_reply(send, 411, {"error": "an upload needs Content-Length"},
                             headers=CLOSE)
            return
        if method == "POST" and name == "":
            await self._post_batch(scope, receive, send)
            return
        if method not in ("GET", "HEAD", "PUT"):
            await json_reply(send, 405, {"error": f"method {method} not allowed on blobs"},
                             headers=((b"allow", ALLOWED),))
            return
        try:
            id_ = parse_id(name)
        except ValueError as exc:
            await json_reply(send, 400, {"error": str(exc)}, head=method == "HEAD")
            return
        if method == "PUT":
            await self._put(id_, scope, receive, send)
        else:
            await self._get(id_, send, head=method == "HEAD")

    def _naming_the_store(self, send):
        """`send` with the store's `STORE_HEADER` added to the response's headers, as the
        listener sends it: a client compares the two before it trusts the listener."""
        header = (STORE_HEADER.encode(), self.store.identity.encode())

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)
        return send_named

    async def _put(self, id_: bytes, scope, receive, send) -> None:
        declared = declared_length(scope)
        try:
            writer = self.store.writer(declared)
        except BlobTooLarge as exc:
            await json_reply(send, 413, {"error": str(exc)}, headers=unbounded(declared))
            return
        except OSError as exc:  # no temp file to be had
            await json_reply(send, *store_failure(exc), headers=unbounded(declared))
            return
        watch = BodyWatch(self.body_timeout)
        try:
            more = True
            while more:
                message = await watch.receive(receive)
                if message["type"] == "http.disconnect":
                    writer.abort()
                    return
                writer.write(message.get("body", b""))
                more = message.get("more_body", False)
                while (step := writer.lagging()) is not None:
                    await asyncio.wrap_future(step)  # the disk or the hash is behind
        except BlobTooLarge as exc:  # the writer dropped the upload
            await json_reply(send, 413, {"error": str(exc)}, headers=unbounded(declared))
            return
        except UploadStalled as exc:
            writer.abort()
            await json_reply(send, 408, {"error": str(exc)}, headers=CLOSE)
            return
        except OSError as exc:  # the store's disk: the body comes from uvicorn, not a socket
            writer.abort()
            await json_reply(send, *store_failure(exc), headers=unbounded(declared))
            return
        except BaseException:
            writer.abort()
            raise
        finally:
            watch.close()
        try:  # fsync off the event loop: concurrent uploads then share the disk's flushes
            reply = await asyncio.to_thread(commit_reply, self.store, [(writer, id_)], False)
        except OSError as exc:  # the writer is aborted
            reply = store_failure(exc)
        await json_reply(send, *reply)

    async def _post_batch(self, scope, receive, send) -> None:
        """`POST <mount>` (`BatchReceiver`). Replies the stored ids, or 400 naming each
        refused blob (the others are stored)."""
        declared = declared_length(scope)
        batch = BatchReceiver(self.store)
        watch = BodyWatch(self.body_timeout)
        try:
            if declared is not None:
                batch.check_declared(declared)
            more = True
            while more:
                if batch.holds_too_much():
                    await asyncio.to_thread(batch.finish_held)
                while (step := batch.lagging()) is not None:
                    await asyncio.wrap_future(step)  # a large blob's disk or hash is behind
                message = await watch.receive(receive)
                if message["type"] == "http.disconnect":
                    batch.abort()
                    return
                batch.feed(memoryview(message.get("body", b"")))
                more = message.get("more_body", False)
            uploads = batch.end()
        except ValueError as exc:
            batch.abort()
            await json_reply(send, *batch.error(exc), headers=unbounded(declared))
            return
        except UploadStalled as exc:
            batch.abort()
            await json_reply(send, 408, {"error": str(exc)}, headers=CLOSE)
            return
        except OSError as exc:  # the store's disk
            batch.abort()
            await json_reply(send, *store_failure(exc), headers=unbounded(declared))
            return
        except BaseException:
            batch.abort()
            raise
        finally:
            watch.close()
        try:
            reply = await asyncio.to_thread(commit_reply, self.store, uploads, True)
        except OSError as exc:  # every writer is aborted
            reply = store_failure(exc)
        await json_reply(send, *reply)

    async def _get(self, id_: bytes, send, head: bool) -> None:
        try:
            file = open(self.store.path(id_), "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            await json_reply(send, 404, not_found(id_), head=head)
            return
        with file:
            size = file.seek(0, 2)
            file.seek(0)
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/octet-stream"),
                (b"content-length", str(size).encode())]})
            if head:
                await send({"type": "http.response.body", "body": b""})
                return
            while chunk := file.read(CHUNK):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})


async def json_reply(send, status: int, body, head: bool = False,
                     headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """A whole JSON response (the node's blob routes, JSON-RPC and long polls)."""
    data = json.dumps(body, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        *headers]})
    await send({"type": "http.response.body", "body": b"" if head else data})


class _Hasher:
    """The id of a buffer that is being filled, on a thread of its own for large blobs: the
    hasher releases the GIL, so chunk i is hashed while the socket fills chunk i+1."""

    def __init__(self, size: int) -> None:
        self.digest = blob_hasher()
        self.done = 0  # bytes handed over for hashing
        self.pool = ThreadPoolExecutor(1) if size >= HASH_THREAD_BYTES else None

    def hashed_up_to(self, view: memoryview, end: int) -> None:
        if self.pool is None or end - self.done < HASH_STEP:
            return
        self.pool.submit(self.digest.update, view[self.done:end])  # runs in order
        self.done = end

    def finish(self, view: memoryview, end: int) -> bytes:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.digest.update(view[self.done:end])
        return self.digest.digest()


def _blob_id(views: list[memoryview]) -> bytes:
    """`blob_id` of the blob made of `views` in order (not concatenated)."""
    digest = blob_hasher()
    for view in views:
        digest.update(view)
    return digest.digest()


class _AlreadyStored(Exception):
    """The store has the blob being sent: the rest of it is not sent."""


class _HashedFrame:
    """One blob framed for `POST` as <u64 length><blob><id>. A thread of `pool` hashes it
    (one call per buffer: 1 MiB steps cost ~30 % more client CPU for no gain here) while the
    socket sends it (both release the GIL), then asks the store (`stored`, a HEAD) whether it
    has the blob; if so, the upload stops at the next `SEND_STEP`, so a repeated blob costs
    about its hash, as when the client hashed before asking. Iterating again (a retried
    request) starts over."""

    def __init__(self, views: list[memoryview], size: int, pool: ThreadPoolExecutor,
                 stored: Callable[[bytes], bool]) -> None:
        self.views, self.size, self.pool, self.stored = views, size, pool, stored
        self.hashing: Future | None = None
        self.asking: Future | None = None

    @property
    def id(self) -> bytes:
        return self.hashing.result()

    def _hash(self) -> bytes:
        return _blob_id(self.views)

    def _ask(self, hashing: Future) -> None:
        self.asking = self.pool.submit(self._stored, hashing.result())

    def _stored(self, id_: bytes) -> bool:
        try:
            return self.stored(id_)
        except (OSError, http.client.HTTPException):
            return False  # then the upload simply completes

    def __iter__(self):
        self.asking = None
        self.hashing = self.pool.submit(self._hash)
        self.hashing.add_done_callback(self._ask)
        yield FRAME_LENGTH.pack(self.size)
        for view in self.views:
            for start in range(0, len(view), SEND_STEP):
                if self.asking is not None and self.asking.done() and self.asking.result():
                    raise _AlreadyStored
                yield view[start:start + SEND_STEP]
        yield self.id


def _same_place(a: Connections, b: Connections) -> bool:
    """Whether two connection sets reach the same URL (an older node's /info advertises
    none: the client's URL and its fallback are then one and need no check)."""
    return (a.kind, a.host, a.port, a.prefix.rstrip("/")) == \
        (b.kind, b.host, b.port, b.prefix.rstrip("/"))


def array_parts(array: np.ndarray) -> list:
    """An array's blob as [header, data] without concatenating them (no copy of the data
    when it is already little-endian and contiguous)."""
    array = np.asarray(array)
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return [encode_header(array), data.reshape(-1).view(np.uint8)]


class BlobStoreUnavailable(ConnectionError):
    """A blob server answered a 5xx to the question which store it is (transient)."""


class BlobPortUnreachable(ConnectionError):
    """A connection to the blob port could not be made in `CONNECT_TIMEOUT` (packets dropped
    by a firewall), or was refused, or the host or network is unreachable."""


class _ConnectBounded:
    """An `http.client` connection whose connect may take `connect_timeout` s at most (then
    BlobPortUnreachable), its requests the connection's own timeout: a firewalled blob port
    held the first request for that whole timeout (60 s), with no fallback after it."""

    connect_timeout = CONNECT_TIMEOUT

    def connect(self) -> None:
        timeout = self.timeout
        self.timeout = min(self.connect_timeout, timeout)
        try:
            super().connect()
        except OSError as exc:
            raise BlobPortUnreachable(f"blob port {self.host}:{self.port}: {exc}") from exc
        finally:
            self.timeout = timeout
        self.sock.settimeout(timeout)


def _connect_bounded(kind: type, connect_timeout: float) -> type:
    return type(f"ConnectBounded{kind.__name__}", (_ConnectBounded, kind),
                {"connect_timeout": connect_timeout})


class BlobClient:
    """PUT and GET blobs at `base_url` (`http://host:port/blobs`); one keep-alive connection
    per thread, so transfers from a thread pool run in parallel.

    With a `fallback_url` (`/blobs` on the node's main port) the client moves there for good
    if `base_url` (the blob port /info advertises) cannot be used: nothing listens there, it
    does not accept within `connect_timeout` (firewalled), or it is not the same store. The
    advertised URL is built from the address the client used, so another server can be
    behind it (a port mapping, another devnet's listener): before its first request the
    client asks both URLs once which store they serve (`STORE_HEADER`), and uses `base_url`
    only if they name the same one (an older node, which names none, is used through the
    fallback).

    `refused_upload_wait` is how long an upload (PUT, POST) whose connection is refused (the
    store restarting) is tried again before the refusal is raised: a refused connection
    delivered nothing, so nothing is sent twice, and blobs of the same `put_arrays` that
    arrived are not sent again. 0 (the default) raises it at once, for callers that retry
    on their own terms (downloads always: their callers retry them)."""

    def __init__(self, base_url: str, max_bytes: int, timeout: float = 60.0,
                 fallback_url: str | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT,
                 refused_upload_wait: float = 0.0) -> None:
        self.connections = Connections(base_url, timeout, blocksize=CHUNK)
        self.fallback = None if fallback_url is None else Connections(
            fallback_url, timeout, blocksize=CHUNK)
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.refused_upload_wait = refused_upload_wait
        self._upload_pool: ThreadPoolExecutor | None = None
        self._hashers: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._route_lock = threading.Lock()  # held while the route is checked
        self._switch_lock = threading.Lock()
        self._route_checked = self.fallback is None or _same_place(self.connections,
                                                                   self.fallback)
        if not self._route_checked:
            self.connections.kind = _connect_bounded(self.connections.kind, connect_timeout)

    def _route(self) -> Connections:
        """The connections to use: on the first call, with a fallback, `_check_route` (one
        thread asks, the others wait for its answer)."""
        if not self._route_checked:
            with self._route_lock:
                if not self._route_checked:
                    self._check_route()
                    self._route_checked = True
        return self.connections

    def _check_route(self) -> None:
        """Use the fallback unless `base_url` serves the store the fallback serves: one small
        request to each. The fallback's failure is raised (the check is made again on the
        next request); `base_url`'s means it is not usable."""
        main = self._store_identity(self.fallback)
        if main is None:
            self._use_fallback("the node's main port does not name its blob store (an older "
                               "node)", logging.INFO)
            return
        try:
            advertised = self._store_identity(self.connections)
        except (OSError, http.client.HTTPException) as exc:
            self._use_fallback(f"not reachable ({exc})", logging.INFO)
            return
        if advertised != main:
            self._use_fallback("another blob store answers there "
                               f"({STORE_HEADER}: {str(advertised)[:40]!r})", logging.WARNING)

    def _store_identity(self, connections: Connections) -> str | None:
        """The `STORE_HEADER` of a HEAD at `connections`' URL (None if it sends none), on a
        connection of its own whose whole exchange is bounded by `PROBE_TIMEOUT`."""
        conn = connections.kind(connections.host, connections.port,
                                timeout=min(self.timeout, PROBE_TIMEOUT))
        try:
            conn.request("HEAD", connections.prefix + PROBE_PATH)
            response = conn.getresponse()
            response.read()
            if response.status >= 500:  # a restart or an outage says nothing of the store:
                # asked again with the next request, not taken as an older node for good
                raise BlobStoreUnavailable(f"{connections.host}:{connections.port} answered "
                                           f"{response.status} when asked for its store")
            return response.getheader(STORE_HEADER)
        finally:
            conn.close()

    def _use_fallback(self, reason: str, level: int) -> None:
        """Move every thread to the fallback for good (said once, in the log)."""
        with self._switch_lock:
            if self.connections is self.fallback:
                return
            fast, main = self.connections, self.fallback
            log.log(level, "blob port %s:%s%s unused, blobs go to %s:%s%s: %s", fast.host,
                    fast.port, fast.prefix, main.host, main.port, main.prefix, reason)
            self.connections = main
            self._route_checked = True

    def _request(self, method: str, id_: bytes | None, parts=(), length: int = 0
                 ) -> http.client.HTTPResponse:
        """`_request_once`; an upload tried again while the store refuses the connection,
        for up to `refused_upload_wait` seconds (only a refusal: a reset or cut connection
        may have delivered it)."""
        end = time.monotonic() + (self.refused_upload_wait if method in ("PUT", "POST") else 0)
        while True:
            try:
                return self._request_once(method, id_, parts, length)
            except ConnectionRefusedError:
                if time.monotonic() + REFUSED_RETRY_SECONDS > end:
                    raise
                time.sleep(REFUSED_RETRY_SECONDS)

    def _request_once(self, method: str, id_: bytes | None, parts=(), length: int = 0
                      ) -> http.client.HTTPResponse:
        """`parts` (`length` bytes in all) is iterated once per attempt: a keep-alive
        connection the server closed is retried with the whole body again."""
        connections = self._route()

        def send(conn: http.client.HTTPConnection) -> http.client.HTTPResponse:
            path = connections.prefix + (f"/0x{id_.hex()}" if id_ is not None else "/")
            conn.putrequest(method, path, skip_accept_encoding=True)
            if method in ("PUT", "POST"):
                conn.putheader("Content-Length", str(length))
                conn.putheader("Content-Type", "application/octet-stream")
            conn.endheaders()
            for part in parts:
                conn.send(part)
            return conn.getresponse()

        try:
            return connections.request(send)
        except (ConnectionRefusedError, BlobPortUnreachable) as exc:
            if self.fallback is None or connections is self.fallback:
                raise
            connections = self.fallback  # `send` takes its prefix
            # refused there too, the node is down (restarting): the blob port is kept; it was
            # given up for good, and every later transfer took the slower main port
            response = connections.request(send)
            self._use_fallback(str(exc), logging.INFO)  # for every thread from now on
            return response

    def _reply(self, response: http.client.HTTPResponse) -> bytes:
        """A reply's body (JSON or an error text), read only up to `REPLY_BYTES`: a longer
        one, declared or sent (chunked, or until the connection closes), is refused and its
        connection closed; before, a hostile or broken store's endless error reply was read
        whole into memory, and a huge declared length allocated up front."""
        declared = response.length  # None: chunked, or until the connection closes
        body = b""
        with self.connections.closing_on_failure():
            while (declared is None or declared <= REPLY_BYTES) and len(body) <= REPLY_BYTES \
                    and (more := response.read(REPLY_BYTES + 1 - len(body))):
                body += more
        if len(body) > REPLY_BYTES or (declared or 0) > REPLY_BYTES:
            self.connections.current().close()  # the rest must not reach the next request
            raise BlobError(f"blob store answered {response.status} with a reply over "
                            f"{REPLY_BYTES} bytes")
        return body

    def _checked_size(self, parts: list) -> tuple[list[memoryview], int]:
        """A blob's buffers as byte views and its size, within the limit (checked before
        anything is sent)."""
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(len(v) for v in views)
        if size > self.max_bytes:
            raise BlobError(f"blob of {size} bytes exceeds the {self.max_bytes}-byte limit")
        return views, size

    def put_parts(self, parts: list) -> bytes:
        """Upload a blob given as consecutive byte buffers; returns its id. From
        `STREAM_BYTES` on, the blob is hashed while it is sent (`POST` framing, its id
        after its bytes) instead of before (`PUT` to its id), and not sent to the end if the
        store turns out to have it."""
        views, size = self._checked_size(parts)
        if size >= STREAM_BYTES:
            frame = _HashedFrame(views, size, self._hash_pool(), self.has)
            try:
                response = self._request("POST", None, frame,
                                         FRAME_LENGTH.size + size + ID_BYTES)
            except _AlreadyStored:
                return frame.id  # the connection, left mid-body, was closed
            id_ = frame.id
        else:
            id_ = _blob_id(views)
            response = self._request("PUT", id_, views, size)
        body = self._reply(response)
        if response.status != 200:
            raise BlobError(f"blob store refused 0x{id_.hex()}: {response.status} "
                            f"{body[:300].decode(errors='replace')}")
        if size >= STREAM_BYTES and json.loads(body)["ids"] != ["0x" + id_.hex()]:
            raise BlobError(f"blob store acknowledged another id than 0x{id_.hex()}")
        return id_

    def put(self, data: bytes) -> bytes:
        return self.put_parts([data])

    def put_many(self, blobs: list[list]) -> list[bytes]:
        """Upload several blobs (each given as consecutive byte buffers) in one request; the
        node commits them as a group (one directory fsync). Returns their ids."""
        frames, ids = [], []
        for parts in blobs:
            views, size = self._checked_size(parts)
            ids.append(_blob_id(views))
            frames += [FRAME_LENGTH.pack(size), *views, ids[-1]]
        # one buffer: small blobs as separate sends would each be a syscall and a segment
        body = b"".join(frames)
        response = self._request("POST", None, [body], len(body))
        body = self._reply(response)
        if response.status != 200:
            raise BlobError(f"blob store refused a batch of {len(blobs)}: {response.status} "
                            f"{body[:300].decode(errors='replace')}")
        if json.loads(body)["ids"] != ["0x" + id_.hex() for id_ in ids]:
            raise BlobError("blob store acknowledged other ids than the batch's")
        return ids

    def put_arrays(self, arrays: list[np.ndarray], threads: int = 8) -> list[bytes]:
        """Upload arrays, the small ones batched (up to MAX_BATCH_BLOBS blobs or BATCH_BYTES
        per request), the large ones one per request; requests run on `threads` threads (a
        connection each). Returns the ids in order. An array given more than once (one B
        shared by a batch of products) is sent once."""
        first_of: dict[int, int] = {}  # id() of an array -> the index it is uploaded at
        groups: list[list[int]] = []
        batch: list[int] = []
        batch_bytes = 0
        for i, array in enumerate(arrays):
            if first_of.setdefault(id(array), i) != i:
                continue
            nbytes = np.asarray(array).nbytes
            if nbytes >= STREAM_BYTES:
                groups.append([i])
                continue
            if not batch or batch_bytes + nbytes > BATCH_BYTES or len(batch) == MAX_BATCH_BLOBS:
                batch, batch_bytes = [], 0
                groups.append(batch)
            batch.append(i)
            batch_bytes += nbytes

        def upload(group: list[int]) -> list[bytes]:
            if np.asarray(arrays[group[0]]).nbytes >= STREAM_BYTES:
                return [self.put_array(arrays[group[0]])]
            return self.put_many([array_parts(arrays[i]) for i in group])

        ids: list[bytes] = [b""] * len(arrays)
        # one request on this thread's connection; several on the client's pool, whose
        # threads (and so keep-alive connections) live as long as the client
        uploads = map(upload, groups) if len(groups) == 1 else self._pool(threads).map(
            upload, groups)
        for group, group_ids in zip(groups, uploads, strict=True):
            for i, id_ in zip(group, group_ids, strict=True):
                ids[i] = id_
        return [ids[first_of[id(array)]] for array in arrays]

    def _pool(self, threads: int) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._upload_pool is None:
                self._upload_pool = ThreadPoolExecutor(threads, thread_name_prefix="blob-put")
            return self._upload_pool

    def _hash_pool(self) -> ThreadPoolExecutor:
        """The threads that hash streamed uploads and ask the store about them (each keeps
        its keep-alive connection for the HEADs)."""
        with self._pool_lock:
            if self._hashers is None:
                self._hashers = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="blob-hash")
            return self._hashers

    def put_array(self, array: np.ndarray) -> bytes:
        return self.put_parts(array_parts(array))

    def get(self, id_: bytes) -> memoryview:
        """The blob's bytes, read into one buffer and hashed as they arrive; BlobError if the
        store does not have it, it is over the size limit, or its id is not `id_`.

        The buffer is a fresh `np.empty`, owned by the returned view (never reused by a later
        download): numpy asks for transparent huge pages for large allocations and does not
        zero them, so a 64 MiB buffer costs ~6 ms of page faults here instead of a
        `bytearray`'s ~45 (4 KiB faults and a memset) before the first byte lands."""
        response = self._request("GET", id_)
        if response.status != 200:
            body = self._reply(response)
            if response.status == 404:
                raise BlobNotFound(f"blob 0x{id_.hex()} not found in the blob store")
            raise BlobError(f"blob 0x{id_.hex()}: {response.status} {body[:200]!r}")
        size = parse_length(response.getheader("content-length", ""))
        if size is None:
            self.connections.current().close()
            raise BlobError(f"blob 0x{id_.hex()}: the store sent no usable Content-Length "
                            f"({response.getheader('content-length', 'none')[:40]!r})")
        if size > self.max_bytes:
            self.connections.current().close()  # its unread body must not reach the next request
            raise BlobError(f"blob 0x{id_.hex()} of {size} bytes exceeds the "
                            f"{self.max_bytes}-byte limit")
        view, hasher, got = memoryview(np.empty(size, np.uint8)), _Hasher(size), 0
        try:
            with self.connections.closing_on_failure():  # a cut, a timeout, a Ctrl-C
                while got < size:
                    n = response.readinto(view[got:got + CHUNK])
                    if n == 0:
                        raise BlobCutOff(f"blob 0x{id_.hex()}: connection closed after {got} "
                                         f"of {size} bytes")
                    got += n
                    hasher.hashed_up_to(view, got)
        finally:
            digest = hasher.finish(view, got)
        if digest != id_:
            raise BlobError(f"blob 0x{id_.hex()} arrived with a different hash: corrupt or "
                            "forged")
        return view

    def get_array(self, id_: bytes) -> np.ndarray:
        return decode_array(self.get(id_))

    def has(self, id_: bytes) -> bool:
        response = self._request("HEAD", id_)
        response.read()
        return response.status == 200

    def close(self) -> None:
        for pool in (self._upload_pool, self._hashers):
            if pool is not None:
                pool.shutdown(wait=True)
        self.connections.close()
        if self.fallback is not None:
            self.fallback.close()
