"""`/blobs` on a port of its own: a plain HTTP/1.1 listener, one thread per connection.

The node's main server (uvicorn) hands a request body over in 256 KiB messages, copies it
twice and pauses and resumes reading for each: 24-51 ms of CPU per 16 MiB upload, more than
the blob's hashing and writing together. Here a connection's thread receives straight into
reused page-aligned 1 MiB buffers with blocking `recv_into` (the GIL is released while it
waits) and hands them to a `BlobWriter` (which hashes them and writes them with O_DIRECT on
threads of its own), and answers a download from O_DIRECT reads into the same kind of
buffers, read on threads ahead of the sends (`sendfile` for small blobs), or from memory
for the latest large uploads (`RecentUploads`). Measured here
against an asyncio `BufferedProtocol` receiving the same 16 MiB bodies: 5.2 against 6.1-7.0
ms of CPU each, 2.0 against 1.5 GB/s best.

It speaks what `BlobClient` and `BlobApp` speak: `PUT/GET/HEAD /blobs/0x<id>` and `POST
/blobs/` (`BatchReceiver` framing), keep-alive, `Content-Length` bodies (checked against
the size limit before any byte is read; `Expect: 100-continue` answered after that check),
the same status codes and JSON replies, each naming the store (`STORE_HEADER`, as `BlobApp`
does: a client uses this port only if it names the store of the node's main port); an upload
is acknowledged only after its group commit (fsync), and one cut short stores nothing.
`/info` advertises it as `blob_url`.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from http import HTTPStatus
from typing import BinaryIO
from urllib.parse import urlsplit

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from chain.blobhttp import (
    ALLOWED,
    DRAIN_LIMIT,
    FRAME_LENGTH,
    LENGTH_DIGITS,
    STORE_HEADER,
    BatchReceiver,
    blob_route,
    commit_reply,
    not_found,
    parse_length,
    store_failure,
)
from chain.blobs import BlobStore, BlobTooLarge, parse_id

log = logging.getLogger(__name__)

RECV_BYTES = 1 << 20  # an upload is received into pool buffers of this size
POOL_BYTES = 64 << 20  # idle receive buffers kept, at most
DIRECT_READ_BYTES = 1 << 20  # downloads from this size are read with O_DIRECT
READ_AHEAD = 3  # ... RECV_BYTES at a time, this many reads of one download in flight
READ_THREADS = 16  # reader threads shared by all downloads
RECENT_BYTES = 256 << 20  # the latest large uploads kept in their receive buffers, at most
HEAD_LIMIT = 16 << 10  # request line and headers, at most
MAX_CONNECTIONS = 256  # one thread each; more are answered 503
# from one remote address, at most (more are answered 503): one client held them all, and
# every other was refused. The rest stays for other addresses. A host's clients share it
# (a devnet's all come from 127.0.0.1): a worker holds up to 16 (one per job and upload
# thread), a client 16, so a devnet of 13 workers on one host fits, as 15 did before
MAX_CONNECTIONS_PER_ADDRESS = MAX_CONNECTIONS - MAX_CONNECTIONS // 8
IDLE_TIMEOUT = 120.0  # a connection silent this long (between or inside requests) is closed
ACCEPT_RETRY_S = 1.0  # after a failed accept (out of file descriptors), as asyncio waits
# the node's and the worker's uvicorn servers (`BoundedHttpProtocol`): a request's line and
# headers, at most, and the seconds they may take from their first byte (or the connection's
# start); browsers' cookies for localhost, shared by every port there, can fill 16 KiB
UVICORN_HEAD_LIMIT = 64 << 10
HEAD_TIMEOUT = 30.0
# ... their connections at once, and from one remote address (more are answered 503 and
# closed as they open; `chain up --max-connections`): each holds a file descriptor, and a
# client that opened thousands ran the process out of them (the node's blob uploads and
# the blob listener's accepts then failed). A worker or a client holds about 20 (a
# keep-alive connection per thread, long polls included), so a devnet with dozens of them
# on one host is far below. Not uvicorn's limit_concurrency: it answers 503 to every
# request, on established connections too, once that many connections are open (idle
# ones count), so whoever held them shut every worker out.
UVICORN_MAX_CONNECTIONS = 1024


class BadRequest(ValueError):
    """A request this listener cannot parse (answered 400 and the connection closed)."""


class HeadTimeout(BadRequest):
    """A request's line and headers took over HEAD_TIMEOUT from their first byte (408)."""


class StoreFailed(Exception):
    """The store's disk failed an upload (answered by `store_failure`). Not an OSError: those
    are the client's socket failing, which ends the connection without a reply."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


@contextmanager
def _store_writes() -> Iterator[None]:
    """Around the store's part of an upload: its OSErrors become StoreFailed."""
    try:
        yield
    except OSError as exc:
        raise StoreFailed(exc) from exc


class BufferPool:
    """Page-aligned `RECV_BYTES` receive buffers, reused: fresh memory is costly on this VM
    (the guest hands freed pages back to the host, which faults them in again: 13 % of an
    upload's server profile was zeroing new pages), and aligned buffers let `BlobWriter`
    write them with O_DIRECT. At most `POOL_BYTES` are kept idle (more while `grow` fills it
    for `recent`). With none idle, the buffers of the least recently used blob of `recent`
    are taken before fresh memory is mapped."""

    def __init__(self) -> None:
        self.idle: list[mmap.mmap] = []
        self.lock = threading.Lock()
        self.recent: RecentUploads | None = None
        self.growing = False

    def take(self) -> mmap.mmap:
        with self.lock:
            if self.idle:
                return self.idle.pop()
        if self.recent is not None and (buffers := self.recent.evict_oldest()):
            with self.lock:
                self.idle += buffers[1:]
            return buffers[0]
        return _fresh_buffer()

    def idle_bytes(self) -> int:
        with self.lock:
            return len(self.idle) * RECV_BYTES

    def grow(self, nbytes: int) -> None:
        """Map fresh buffers until `nbytes` are idle, on a thread of its own: fresh memory is
        costly here (filling 16 MiB of fresh shared 1 MiB buffers 17-27 ms on this VM, of
        reused ones 1.5-1.8), so a receive does not wait for it."""
        with self.lock:
            if self.growing:
                return
            self.growing = True
        threading.Thread(target=self._grow, args=(nbytes,), name="blob-pool-grow",
                         daemon=True).start()

    def _grow(self, nbytes: int) -> None:
        try:
            while self.idle_bytes() < nbytes:
                buffer = _fresh_buffer()
                with self.lock:
                    self.idle.append(buffer)
        finally:
            with self.lock:
                self.growing = False

    def give(self, buffers: list[mmap.mmap]) -> None:
        with self.lock:
            self.idle += buffers[:max(POOL_BYTES // RECV_BYTES - len(self.idle), 0)]


def _fresh_buffer() -> mmap.mmap:
    """A new receive buffer, its pages faulted in by the kernel in one go. Private: on this
    VM 16 MiB of private buffers took 8.4-12.3 ms, of shared ones (Python's default) 15-19."""
    return mmap.mmap(-1, RECV_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                     | getattr(mmap, "MAP_POPULATE", 0))


class _Recent:
    """One cached blob: its bytes as `pieces` (views of the receive `buffers` it arrived in,
    a short tail copied), `nbytes` of memory, and the sends in progress."""

    def __init__(self, pieces: list[memoryview], buffers: list[mmap.mmap], size: int,
                 nbytes: int) -> None:
        self.pieces, self.buffers, self.size, self.nbytes = pieces, buffers, size, nbytes
        self.readers = 0
        self.dropped = False


class RecentUploads:
    """The latest large uploads' bytes, kept in the receive buffers they arrived in instead
    of going back to the pool, so that a download soon after (a worker fetching the operand
    a client just uploaded) is sent from memory instead of read back from disk: on the
    16-core host a 16 MiB blob just written reads back with O_DIRECT at 0.8-1.6 GB/s. Only
    blobs whose id checked out and whose commit succeeded are added. Bounded by bytes: an
    upload reserves its size before its body is received (evicting the least recently used
    blobs; none if it does not fit), and the buffers of an evicted blob go back to the pool
    once its last send is done. The cache is filled from memory at hand: an upload is kept
    only if idle buffers and cached ones can hold it (the pool takes the oldest blob's
    buffers when none is idle), and while the cache is under its bound the pool grows in
    the background to one upload's worth of idle buffers, so receives do not fault in
    fresh memory."""

    def __init__(self, pool: BufferPool, capacity: int) -> None:
        self.pool, self.capacity = pool, capacity
        self.blobs: OrderedDict[bytes, _Recent] = OrderedDict()
        self.held = 0  # reserved by uploads in progress, cached, or dropped but being sent
        self.lock = threading.Lock()
        pool.recent = self

    def reserve(self, size: int) -> bool:
        """Room for an upload of `size` bytes (True), evicting the oldest blobs for it;
        False if it is over the bound or more than the memory at hand (a lead and a tail
        buffer besides its size)."""
        need = (size // RECV_BYTES + 2) * RECV_BYTES
        with self.lock:
            if size > self.capacity:
                return False
            idle = self.pool.idle_bytes()
            if idle < need and self.held + need <= self.capacity:
                self.pool.grow(need)
            spare = sum(len(b.buffers) for b in self.blobs.values() if not b.readers)
            if idle + spare * RECV_BYTES < need:
                return False
            while self.held + size > self.capacity and self.blobs:
                self._drop(self.blobs.popitem(last=False)[1])
            if self.held + size > self.capacity:
                return False
            self.held += size
            return True

    def evict_oldest(self) -> list[mmap.mmap]:
        """The buffers of the least recently used blob not being sent, evicted for a
        receive ([] if there is none)."""
        with self.lock:
            for id_ in [i for i, b in self.blobs.items() if not b.readers]:
                blob = self.blobs.pop(id_)
                self.held -= blob.nbytes
                buffers, blob.buffers, blob.pieces = blob.buffers, [], []
                if buffers:
                    return buffers
            return []

    def add(self, id_: bytes, blob: _Recent, reserved: int) -> None:
        """Cache a committed upload in place of its reservation (`blob.nbytes` <= it)."""
        with self.lock:
            self.held += blob.nbytes - reserved
            if id_ in self.blobs:
                self._drop(self.blobs.pop(id_))
            self.blobs[id_] = blob

    def release(self, reserved: int) -> None:
        """An upload that reserved room and is not cached after all."""
        with self.lock:
            self.held -= reserved

    def open(self, id_: bytes) -> _Recent | None:
        """The cached blob, held for a send until `close`; None if not cached."""
        with self.lock:
            blob = self.blobs.get(id_)
            if blob is not None:
                blob.readers += 1
                self.blobs.move_to_end(id_)
            return blob

    def close(self, blob: _Recent) -> None:
        with self.lock:
            blob.readers -= 1
            if blob.dropped and not blob.readers:
                self._free(blob)

    def _drop(self, blob: _Recent) -> None:
        blob.dropped = True
        if not blob.readers:
            self._free(blob)

    def _free(self, blob: _Recent) -> None:
        self.held -= blob.nbytes
        self.pool.give(blob.buffers)
        blob.buffers, blob.pieces = [], []


class _Stream:
    """A connection's socket and the bytes received past the current request's headers."""

    def __init__(self, sock: socket.socket, pool: BufferPool) -> None:
        self.sock = sock
        self.pool = pool
        self.pending = bytearray()
        self.taken: list[tuple[int, mmap.mmap]] = []  # (end offset in the body, buffer)

    def read_head(self) -> bytes | None:
        """The next request's line and headers (None if the client closed between
        requests); the bytes after them stay pending."""
        deadline = None  # HEAD_TIMEOUT from the head's first byte, as on the uvicorn ports:
        # the idle timeout alone let a head trickling in a byte a minute hold its thread
        while (end := self.pending.find(b"\r\n\r\n")) < 0:
            if len(self.pending) > HEAD_LIMIT:
                raise BadRequest(f"request headers over {HEAD_LIMIT} bytes")
            if self.pending:
                deadline = deadline or time.monotonic() + HEAD_TIMEOUT
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HeadTimeout(f"request line and headers not received in "
                                      f"{HEAD_TIMEOUT:g} s")
                self.sock.settimeout(min(left, IDLE_TIMEOUT))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    continue  # answered above
                raise
            if not data:
                if self.pending:
                    raise BadRequest("connection closed inside the request headers")
                return None
            self.pending += data
        if deadline is not None:
            self.sock.settimeout(IDLE_TIMEOUT)
        head = bytes(self.pending[:end])
        del self.pending[:end + 4]
        return head

    def body(self, length: int, lead: int = 0) -> Iterator[memoryview]:
        """`length` body bytes in pieces, each at the start of a pool buffer (the bytes
        received with the headers copied into the first): `lead` bytes (a batch's first
        frame length), then `RECV_BYTES` at a time, so that the pieces after the lead are
        aligned in memory and in the blob that follows it (`BlobWriter` writes them with
        O_DIRECT). The buffers stay taken (a writer keeps pieces until they are hashed and
        written) until `release`. ConnectionAbortedError if the client closes first."""
        done = 0
        while done < length:
            buffer = self.pool.take()
            view = memoryview(buffer)[:min(lead or RECV_BYTES, length - done)]
            lead = 0
            filled = min(len(self.pending), len(view))
            view[:filled] = self.pending[:filled]
            del self.pending[:filled]
            while filled < len(view):
                n = self.sock.recv_into(view[filled:])
                if n == 0:
                    raise ConnectionAbortedError(f"client closed with {length - done - filled}"
                                                 " body bytes unsent")
                filled += n
            done += filled
            self.taken.append((done, buffer))
            yield view

    def release(self, settled: int | None = None) -> None:
        """Give back the buffers of the body's first `settled` bytes (all by default): the
        writer is done with them. Buffers an aborted writer may still read are just
        dropped (`forget`)."""
        while self.taken and (settled is None or self.taken[0][0] <= settled):
            self.pool.give([self.taken.pop(0)[1]])

    def forget(self) -> None:
        self.taken.clear()

    def keep(self, start: int, size: int) -> _Recent:
        """The body's bytes `start` to `start + size` as a `_Recent` blob: the buffers they
        fill whole are kept (no copy), a part-filled one is copied and given back with the
        buffers outside the range."""
        pieces, kept, nbytes, begin = [], [], 0, 0
        for end, buffer in self.taken:
            low, high = max(begin, start), min(end, start + size)
            if high - low == RECV_BYTES:
                pieces.append(memoryview(buffer))
                kept.append(buffer)
                nbytes += RECV_BYTES
            else:
                if high > low:
                    pieces.append(memoryview(buffer[low - begin:high - begin]))
                    nbytes += high - low
                self.pool.give([buffer])
            begin = end
        self.taken.clear()
        return _Recent(pieces, kept, size, nbytes)

    def drain(self, length: int) -> None:
        """Read and drop the rest of a refused body."""
        if length > DRAIN_LIMIT:
            raise ConnectionAbortedError("refused body too large to drain")
        for _ in self.body(length):
            self.release()


class _Request:
    def __init__(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise BadRequest(f"bad request line {lines[0][:100]!r}")
        self.method, target, version = parts
        self.path = target.split("?", 1)[0]
        self.headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon:
                raise BadRequest(f"bad header line {line[:100]!r}")
            name, value = name.strip().lower(), value.strip()
            if name == "content-length" and self.headers.get(name, value) != value:
                raise BadRequest("conflicting Content-Length headers")  # which body is it?
            self.headers[name] = value
        if "transfer-encoding" in self.headers:
            raise BadRequest("chunked bodies are not supported: send Content-Length")
        length = self.headers.get("content-length", "0")
        if length.startswith("-") and length[1:].isdigit():
            raise BadRequest("Content-Length is negative")
        if not (length.isascii() and length.isdigit()):  # int() takes "+5" and "1_0" too
            raise BadRequest("Content-Length is not a number")
        parsed = parse_length(length)
        if parsed is None:
            raise BadRequest(f"Content-Length over {LENGTH_DIGITS} digits")
        self.length = parsed
        connection = self.headers.get("connection", "").lower()
        self.keep_alive = connection != "close" and (version != "HTTP/1.0"
                                                     or connection == "keep-alive")


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (port 0: any free one); OSError if it is taken.
    The kernel's buffer autotuning is kept: fixed 4 MiB SO_RCVBUF/SO_SNDBUF made no
    difference beyond the noise here."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # "::" like uvicorn
    sock = socket.create_server((host, port), family=family, backlog=128)
    # as IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets with that protocol number,
    # and create_server's is 0, so uvicorn on this socket (the node's JSON-RPC, a worker's
    # API) sent each reply's body after a delayed ACK: 44 ms per keep-alive request, not 0.2
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, fileno=sock.detach())


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (`uvicorn.Config(http=BoundedHttpProtocol)`) with each
    request's line and headers bounded: `UVICORN_HEAD_LIMIT` bytes (then 431), sent within
    `HEAD_TIMEOUT` s of their first byte or of the connection's start (then closed). uvicorn
    bounds neither: the parser kept an endless header line in memory (a client grew the node
    by 225 MB in a second, without end), and a connection that never finished its headers
    was held for good. Connections beyond `max_connections`, or beyond half of them from one
    address, are answered 503 and closed as they open (`bounded_http` sets another bound);
    the established ones are served on."""

    max_connections = UVICORN_MAX_CONNECTIONS

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.reading_head, self.head_bytes, self.head_timer = True, 0, None
        self.head_tail = b""  # the last bytes of the head so far: its end may straddle reads
        if (refusal := self._over_limit()) is not None:
            self._refuse_head(503, refusal)
            return
        self.head_timer = self.loop.call_later(HEAD_TIMEOUT, self._head_too_slow)

    def _over_limit(self) -> str | None:
        """Why this new connection is refused (None: it is not): over `max_connections`,
        or over half of them from its address."""
        if len(self.connections) > self.max_connections:
            return f"over {self.max_connections} connections"
        if not self.client:
            return None
        address, per_address = self.client[0], max(self.max_connections // 2, 1)
        same = sum(1 for c in self.connections if (getattr(c, "client", None) or ("",))[0]
                   == address)
        return f"over {per_address} connections from {address}" if same > per_address else None

    def data_received(self, data: bytes) -> None:
        """The head is measured before the parser sees it: a whole head in one read was
        parsed and its request served before a count after parsing could refuse it."""
        if self.reading_head:
            if self.head_timer is None:  # the first byte of a keep-alive request
                self.head_timer = self.loop.call_later(HEAD_TIMEOUT, self._head_too_slow)
            seen = self.head_tail + data
            end = seen.find(b"\r\n\r\n")
            head = self.head_bytes + (len(data) if end < 0 else end + 4 - len(self.head_tail))
            if head > UVICORN_HEAD_LIMIT:
                self._refuse_head(431, f"request line and headers over {UVICORN_HEAD_LIMIT} "
                                       "bytes")
                return
            self.head_bytes += len(data)
            self.head_tail = seen[-3:]
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self.reading_head = False
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.reading_head, self.head_bytes, self.head_tail = True, 0, b""  # the next request's

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_too_slow(self) -> None:
        self.head_timer = None
        if self.reading_head and not self.transport.is_closing():
            self._refuse_head(408, f"request line and headers not received in "
                                   f"{HEAD_TIMEOUT:g} s")

    def _refuse_head(self, status: int, message: str) -> None:
        """Answer `status` with `message` (unless a response on this connection is under way)
        and close the connection."""
        if self.cycle is None or self.cycle.response_complete:
            body = json.dumps({"error": message}).encode()
            self.transport.write(
                f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: "
                f"application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
                .encode() + body)
        self.transport.close()


def bounded_http(max_connections: int) -> type[BoundedHttpProtocol]:
    """`BoundedHttpProtocol` with `max_connections` in place of UVICORN_MAX_CONNECTIONS."""
    return type("BoundedHttpProtocol", (BoundedHttpProtocol,),
                {"max_connections": max_connections})


class BlobServer:
    """Serves `store` at `http://host:port/blobs` (port 0: any free one; `port` is then
    the real one), or on `listener`, a socket from `listen`, until `close()`."""

    def __init__(self, store: BlobStore, host: str = "127.0.0.1", port: int = 0,
                 recent_bytes: int = RECENT_BYTES,
                 listener: socket.socket | None = None) -> None:
        self.store = store
        self.identity = store.identity  # sent on every reply (`STORE_HEADER`)
        self.listener = listener or listen(host, port)
        self.port: int = self.listener.getsockname()[1]
        self.connections: set[socket.socket] = set()
        self.per_address: dict[str, int] = {}  # open connections by remote address
        self.pool = BufferPool()
        self.recent = RecentUploads(self.pool, recent_bytes)
        self.readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="blob-read")
        self.lock = threading.Lock()
        self.closed = False
        self.acceptor = threading.Thread(target=self._accept, name="blob-listener", daemon=True)

    def start(self) -> BlobServer:
        self.acceptor.start()
        return self

    def close(self) -> None:
        """Stop accepting and cut every open connection (an upload in progress stores
        nothing); waits for the listener's thread. Closing again does nothing."""
        if self.closed:
            return
        self.closed = True
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self.lock:
            for sock in self.connections:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # its client closed it meanwhile
        if self.acceptor.is_alive():
            self.acceptor.join()
        self.readers.shutdown(wait=False)

    def __enter__(self) -> BlobServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, remote = self.listener.accept()
            except OSError as exc:
                if self.closed:
                    return
                # out of file descriptors (EMFILE) or memory: the connection waits in the
                # backlog; returning here stopped the listener until the node restarted
                log.warning("blob listener cannot accept (%s); retrying", exc)
                time.sleep(ACCEPT_RETRY_S)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(IDLE_TIMEOUT)
            if (refusal := self._admit(sock, remote[0])) is not None:
                try:
                    _reply(sock, 503, {"error": refusal}, False, identity=self.identity)
                except OSError:
                    pass  # its client is gone already
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, remote[0]),
                             name="blob-connection", daemon=True).start()

    def _admit(self, sock: socket.socket, address: str) -> str | None:
        """Count a new connection from `address` in; why it is refused if it is over a
        limit (MAX_CONNECTIONS, MAX_CONNECTIONS_PER_ADDRESS)."""
        with self.lock:
            if len(self.connections) >= MAX_CONNECTIONS:
                return f"over {MAX_CONNECTIONS} blob connections"
            if self.per_address.get(address, 0) >= MAX_CONNECTIONS_PER_ADDRESS:
                return f"over {MAX_CONNECTIONS_PER_ADDRESS} blob connections from {address}"
            self.connections.add(sock)
            self.per_address[address] = self.per_address.get(address, 0) + 1
            return None

    def _release(self, sock: socket.socket, address: str) -> None:
        with self.lock:
            self.connections.discard(sock)
            if self.per_address[address] == 1:
                del self.per_address[address]
            else:
                self.per_address[address] -= 1

    def _serve(self, sock: socket.socket, address: str) -> None:
        stream = _Stream(sock, self.pool)
        try:
            while (head := stream.read_head()) is not None:
                try:
                    request = _Request(head)
                except BadRequest as exc:
                    _reply(sock, 400, {"error": str(exc)}, False, identity=self.identity)
                    return
                if not self._handle(stream, request) or not request.keep_alive:
                    return
        except HeadTimeout as exc:
            with contextlib.suppress(OSError):
                sock.settimeout(5.0)  # the head's deadline is spent: a moment to answer
                _reply(sock, 408, {"error": str(exc)}, False, identity=self.identity)
        except (OSError, ConnectionAbortedError, BadRequest):
            return  # the client went away, timed out or sent garbage: nothing to answer
        finally:
            self._release(sock, address)
            sock.close()

    def _handle(self, stream: _Stream, request: _Request) -> bool:
        """Answer one request; False if the connection must close (its body unread)."""
        method, sock = request.method, stream.sock
        keep = request.keep_alive
        name = blob_route(request.path)
        if name is None:
            return self._refuse(stream, request, 404, {"error": f"no route {request.path[:100]}"})
        if method in ("PUT", "POST") and "content-length" not in request.headers:
            # a body of 0 bytes would be refused as a blob, the bytes sent parsed as a request
            _reply(sock, 411, {"error": "an upload needs Content-Length"}, False,
                   identity=self.identity)
            return False
        if method == "POST" and name == "":
            return self._post(stream, request)
        if method not in ("GET", "HEAD", "PUT"):
            return self._refuse(stream, request, 405,
                                {"error": f"method {method} not allowed on blobs"},
                                extra=f"allow: {ALLOWED.decode()}\r\n")
        try:
            id_ = parse_id(name)
        except ValueError as exc:
            return self._refuse(stream, request, 400, {"error": str(exc)})
        if method == "PUT":
            return self._put(stream, request, id_)
        if request.length:
            stream.drain(request.length)
        if (blob := self.recent.open(id_)) is not None:
            try:
                sock.sendall(_head(200, "application/octet-stream", blob.size, keep,
                                   identity=self.identity))
                if method == "GET":
                    for piece in blob.pieces:
                        sock.sendall(piece)
            finally:
                self.recent.close(blob)
            return True
        try:
            file = open(self.store.path(id_), "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            _reply(sock, 404, not_found(id_), keep, head=method == "HEAD",
                   identity=self.identity)
            return True
        with file:
            size = file.seek(0, 2)
            sock.sendall(_head(200, "application/octet-stream", size, keep,
                               identity=self.identity))
            if method == "GET":
                self._send(sock, file, size)
        return True

    def _send(self, sock: socket.socket, file: BinaryIO, size: int) -> None:
        """A blob's bytes: a large one read with O_DIRECT into pool buffers (it was most
        likely written that way, so it is not in the page cache, and filling the cache
        costs more here than reading the disk: 12-20 ms per 16 MiB against 18-49 for
        `sendfile`), `READ_AHEAD` reads in flight on the reader threads while the socket
        sends the oldest (a disk read and a send take about as long each, so one after the
        other would halve the rate); a small one by `sendfile` from the page cache."""
        fd = -1
        if size >= DIRECT_READ_BYTES and self.store.direct_io:
            try:
                fd = os.open(file.name, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                fd = -1  # a filesystem without O_DIRECT
        if fd < 0:
            sock.sendfile(file, 0, size)
            return
        buffers = [self.pool.take() for _ in range(min(READ_AHEAD, -(-size // RECV_BYTES)))]
        offsets = iter(range(0, size, RECV_BYTES))
        reads: deque[tuple[Future, mmap.mmap]] = deque()

        def read_next(buffer: mmap.mmap) -> None:
            offset = next(offsets, None)
            if offset is None:
                return
            try:
                reads.append((self.readers.submit(os.preadv, fd, [buffer], offset), buffer))
            except RuntimeError:  # the readers shut down: `close()` cuts this connection
                raise ConnectionAbortedError("blob server closed") from None

        sent = 0
        try:
            for buffer in buffers:
                read_next(buffer)
            while reads:
                reading, buffer = reads.popleft()
                try:
                    n = reading.result()
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self.store.direct_io = False  # opened with O_DIRECT, cannot read so
                    sock.sendfile(file, sent, size - sent)
                    return
                if n != min(RECV_BYTES, size - sent):
                    raise ConnectionAbortedError(f"blob file {file.name} shorter than {size}")
                sock.sendall(memoryview(buffer)[:n])
                sent += n
                read_next(buffer)
        finally:
            for reading, _ in reads:
                reading.cancel()
            wait([reading for reading, _ in reads])  # a running read still fills its buffer
            os.close(fd)
            self.pool.give(buffers)

    def _refuse(self, stream: _Stream, request: _Request, status: int, body: dict,
                unread: int | None = None, extra: str = "") -> bool:
        """Reply `status`, then read and drop the `unread` rest of the body (all of it by
        default) so that the connection stays usable; a client that waits for `100
        Continue` before sending the body is not sent it, and the connection closes."""
        unread = request.length if unread is None else unread
        waits = request.headers.get("expect", "").lower() == "100-continue" and \
            unread == request.length
        _reply(stream.sock, status, body, request.keep_alive and not waits,
               head=request.method == "HEAD", extra=extra, identity=self.identity)
        if waits:
            return False
        stream.drain(unread)
        return True

    def _continue(self, stream: _Stream, request: _Request) -> None:
        if request.headers.get("expect", "").lower() == "100-continue":
            stream.sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _put(self, stream: _Stream, request: _Request, id_: bytes) -> bool:
        try:
            writer = self.store.writer(request.length)
        except BlobTooLarge as exc:
            return self._refuse(stream, request, 413, {"error": str(exc)})
        except OSError as exc:  # no temp file to be had
            return self._refuse(stream, request, *store_failure(exc))
        self._continue(stream, request)
        reserved = self._reserve(request.length)
        received = 0
        try:
            for piece in stream.body(request.length):
                received += len(piece)
                with _store_writes():
                    writer.write(piece)
                    while (step := writer.lagging()) is not None:
                        step.result()  # the disk or the hash is behind
                if not reserved:
                    stream.release(writer.settled)
            with _store_writes():
                reply = commit_reply(self.store, [(writer, id_)], False)
        except BaseException as exc:
            writer.abort()
            stream.forget()
            self.recent.release(reserved)
            if not isinstance(exc, StoreFailed):
                raise
            return self._refuse(stream, request, *store_failure(exc.error),
                                unread=request.length - received)
        self._remember(stream, reserved, reply[0] == 200, id_, 0, writer.size)
        _reply(stream.sock, *reply, request.keep_alive, identity=self.identity)
        return True

    def _reserve(self, length: int) -> int:
        """Bytes reserved in the recent uploads for a body of `length` (0: not cached)."""
        if length < DIRECT_READ_BYTES or not self.recent.reserve(length):
            return 0
        return length

    def _remember(self, stream: _Stream, reserved: int, stored: bool, id_: bytes, start: int,
                  size: int) -> None:
        """After a request's commit: its blob (`size` bytes from body offset `start`) cached
        if room was `reserved` for it and it was `stored` (its id checked, on disk); the
        other buffers released."""
        if reserved and stored:
            self.recent.add(id_, stream.keep(start, size), reserved)
        else:
            self.recent.release(reserved)
        stream.release()

    def _post(self, stream: _Stream, request: _Request) -> bool:
        batch = BatchReceiver(self.store)
        received = reserved = 0
        try:
            with _store_writes():  # a body over the free-space reserve: 507
                batch.check_declared(request.length)
            self._continue(stream, request)
            reserved = self._reserve(request.length)  # a one-blob body is cached
            for piece in stream.body(request.length, lead=FRAME_LENGTH.size):
                received += len(piece)
                with _store_writes():
                    if batch.holds_too_much():
                        batch.finish_held()
                    while (step := batch.lagging()) is not None:
                        step.result()  # a large blob's disk or hash is behind
                    if not reserved:
                        stream.release(batch.settled())
                    batch.feed(piece)
            uploads = batch.end()
            with _store_writes():
                reply = commit_reply(self.store, uploads, True)
        except BaseException as exc:
            batch.abort()
            stream.forget()
            self.recent.release(reserved)
            if isinstance(exc, StoreFailed):
                refusal = store_failure(exc.error)
            elif isinstance(exc, ValueError):  # a malformed batch: batch.error says which
                refusal = batch.error(exc)
            else:
                raise
            return self._refuse(stream, request, *refusal, unread=request.length - received)
        one = len(uploads) == 1 and reply[0] == 200
        self._remember(stream, reserved, one, uploads[0][1] if one else b"",
                       batch.starts[0] if one else 0, uploads[0][0].size if one else 0)
        _reply(stream.sock, *reply, request.keep_alive, identity=self.identity)
        return True


def _head(status: int, content_type: str, length: int, keep_alive: bool,
          extra: str = "", *, identity: str) -> bytes:
    """A response's status line and headers (`extra`: more header lines, each with CRLF),
    naming the store (`identity`) as `BlobApp` does, so a client can check that this port
    serves the same store as the node's main port."""
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {length}\r\n{STORE_HEADER}: {identity}\r\n" + extra
            + ("" if keep_alive else "connection: close\r\n") + "\r\n").encode("latin-1")


def _reply(sock: socket.socket, status: int, body: dict, keep_alive: bool,
           head: bool = False, extra: str = "", *, identity: str) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    sock.sendall(_head(status, "application/json", len(data), keep_alive, extra,
                       identity=identity) + (b"" if head else data))


def blob_url(base_url: str, port: int | None) -> str:
    """The `/blobs` URL /info advertises: the listener's (`port`) at the host the client used
    to reach `base_url` (the node's main port); `base_url`'s own without a listener."""
    if port is None:
        return f"{base_url}/blobs"
    url = urlsplit(base_url)
    host = f"[{url.hostname}]" if ":" in (url.hostname or "") else url.hostname
    return f"{url.scheme}://{host}:{port}/blobs"
