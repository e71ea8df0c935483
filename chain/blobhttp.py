"""Blobs over HTTP, both ends: `BlobApp`, a raw ASGI app mounted at `/blobs` of the node's
server, and `BlobClient`, the client workers and submitters use.

Bulk bytes skip every per-request framework layer: an upload is hashed and written to a
temp file chunk by chunk as it arrives (never held in memory), a download is read from disk
in large chunks, and the client sends an array's header and data buffer as they are and
receives into one preallocated buffer of the announced size, hashing as it reads.
"""
from __future__ import annotations

import asyncio
import hashlib
import http.client
import json

import numpy as np

from chain.blobs import BlobStore, BlobTooLarge, decode_array, encode_header, parse_id
from chain.keepalive import Connections

CHUNK = 4 << 20
ASK_FIRST_BYTES = 1 << 20  # from this size an upload first asks (HEAD) whether it is needed


class BlobError(ValueError):
    """A blob that could not be stored or fetched, or whose bytes do not match its id."""


class BlobNotFound(BlobError, KeyError):
    """The store has no blob with this id."""


class BlobApp:
    """`PUT/GET/HEAD <mount>/0x<id>` over a BlobStore (ASGI)."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        method = scope["method"]
        try:
            id_ = parse_id(scope["path"].rstrip("/").rsplit("/", 1)[-1])
        except ValueError as exc:
            await _reply(send, 400, {"error": str(exc)}, head=method == "HEAD")
            return
        if method == "PUT":
            await self._put(id_, scope, receive, send)
        elif method in ("GET", "HEAD"):
            await self._get(id_, send, head=method == "HEAD")
        else:
            await _reply(send, 405, {"error": f"method {method} not allowed on blobs"})

    async def _put(self, id_: bytes, scope, receive, send) -> None:
        declared = dict(scope["headers"]).get(b"content-length")
        try:
            writer = self.store.writer(id_, int(declared) if declared else None)
        except BlobTooLarge as exc:
            await _reply(send, 413, {"error": str(exc)})
            return
        try:
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    writer.abort()
                    return
                writer.write(message.get("body", b""))
                more = message.get("more_body", False)
            # fsync off the event loop: concurrent uploads then share the disk's flushes
            await asyncio.to_thread(writer.commit)
        except BlobTooLarge as exc:
            await _reply(send, 413, {"error": str(exc)})
            return
        except ValueError as exc:
            await _reply(send, 400, {"error": f"not stored: {exc}"})
            return
        await _reply(send, 200, {"id": "0x" + id_.hex(), "size": writer.size})

    async def _get(self, id_: bytes, send, head: bool) -> None:
        try:
            file = open(self.store.path(id_), "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            await _reply(send, 404, {"error": f"blob 0x{id_.hex()} not found"}, head=head)
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


async def _reply(send, status: int, body: dict, head: bool = False) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": b"" if head else data})


class BlobClient:
    """PUT and GET blobs at `base_url` (`http://host:port/blobs`); one keep-alive connection
    per thread, so transfers from a thread pool run in parallel."""

    def __init__(self, base_url: str, max_bytes: int, timeout: float = 60.0) -> None:
        self.connections = Connections(base_url, timeout, blocksize=CHUNK)
        self.max_bytes = max_bytes

    def _request(self, method: str, id_: bytes, parts=()) -> http.client.HTTPResponse:
        def send(conn: http.client.HTTPConnection) -> http.client.HTTPResponse:
            conn.putrequest(method, f"{self.connections.prefix}/0x{id_.hex()}",
                            skip_accept_encoding=True)
            if method == "PUT":
                conn.putheader("Content-Length", str(sum(len(p) for p in parts)))
                conn.putheader("Content-Type", "application/octet-stream")
            conn.endheaders()
            for part in parts:
                conn.send(part)
            return conn.getresponse()

        return self.connections.request(send)

    def put_parts(self, parts: list) -> bytes:
        """Upload a blob given as consecutive byte buffers; returns its id."""
        size = sum(memoryview(p).nbytes for p in parts)
        if size > self.max_bytes:
            raise BlobError(f"blob of {size} bytes exceeds the {self.max_bytes}-byte limit")
        digest = hashlib.sha256()
        for part in parts:
            digest.update(part)
        id_ = digest.digest()
        if size >= ASK_FIRST_BYTES and self.has(id_):
            return id_  # a large blob the store already has is not sent again
        response = self._request("PUT", id_, [memoryview(p).cast("B") for p in parts])
        body = response.read()
        if response.status != 200:
            raise BlobError(f"blob store refused 0x{id_.hex()}: {response.status} "
                            f"{body[:200].decode(errors='replace')}")
        return id_

    def put(self, data: bytes) -> bytes:
        return self.put_parts([data])

    def put_array(self, array: np.ndarray) -> bytes:
        """Upload an array without concatenating header and data (no copy of the data when
        it is already little-endian and contiguous)."""
        array = np.asarray(array)
        header = encode_header(array)
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        return self.put_parts([header, data.reshape(-1).view(np.uint8)])

    def get(self, id_: bytes) -> bytearray:
        """The blob's bytes, read into one buffer and hashed as they arrive; BlobError if the
        store does not have it, it is over the size limit, or its sha256 is not `id_`."""
        response = self._request("GET", id_)
        if response.status != 200:
            body = response.read()
            if response.status == 404:
                raise BlobNotFound(f"blob 0x{id_.hex()} not found in the blob store")
            raise BlobError(f"blob 0x{id_.hex()}: {response.status} {body[:200]!r}")
        size = int(response.getheader("content-length", "-1"))
        if not 0 <= size <= self.max_bytes:
            self.connections.current().close()  # its unread body must not reach the next request
            raise BlobError(f"blob 0x{id_.hex()} of {size} bytes exceeds the "
                            f"{self.max_bytes}-byte limit")
        buffer = bytearray(size)
        view, digest, got = memoryview(buffer), hashlib.sha256(), 0
        while got < size:
            n = response.readinto(view[got:got + CHUNK])
            if n == 0:
                self.connections.current().close()
                raise BlobError(f"blob 0x{id_.hex()}: connection closed after {got} of "
                                f"{size} bytes")
            digest.update(view[got:got + n])
            got += n
        if digest.digest() != id_:
            raise BlobError(f"blob 0x{id_.hex()} arrived with a different hash: corrupt or "
                            "forged")
        return buffer

    def get_array(self, id_: bytes) -> np.ndarray:
        return decode_array(self.get(id_))

    def has(self, id_: bytes) -> bool:
        response = self._request("HEAD", id_)
        response.read()
        return response.status == 200

    def close(self) -> None:
        self.connections.close()
