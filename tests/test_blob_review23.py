"""Blob transfer under a full disk, with odd Content-Lengths, and against a hostile store,
over real HTTP on 127.0.0.1.

A store whose disk fills up (a file size limit set on the server process, so the writes fail
with EFBIG as they would with ENOSPC) must refuse an upload with a clear 507 from both blob
servers (the listener, `chain/blobserver.py`, and `BlobApp` under uvicorn), leave no temp
file, and keep serving; a Content-Length of thousands of digits (leading zeros: a valid
length) must be parsed or refused, not crash the request; and `BlobClient` must not read a
store's error or JSON reply without bound (raw-socket servers sending a huge declared
length, or an endless body), nor take a Content-Length that is no number."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import blake3
import numpy as np
import pytest
from helpers import BLOB_SERVERS, blob_node

from chain.blobhttp import BlobClient, BlobError
from chain.blobs import encode_array

pytestmark = pytest.mark.timeout(60)
FILE_LIMIT = 512 << 10  # the servers' process may write no file past this offset
REPO = Path(__file__).resolve().parents[1]
SERVE_WITH_FILE_LIMIT = """
import json, resource, signal, socket, sys, threading, time
import uvicorn
from chain.blobhttp import BlobApp
from chain.blobs import BlobStore
from chain.blobserver import BlobServer
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
store = BlobStore(sys.argv[1], max_bytes=16 << 20)
listener = BlobServer(store).start()
sock = socket.create_server(("127.0.0.1", 0))
server = uvicorn.Server(uvicorn.Config(BlobApp(store), log_level="critical"))
threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
while not server.started:
    time.sleep(0.01)
print(json.dumps([listener.port, sock.getsockname()[1]]), flush=True)
sys.stdin.read()  # serve until the test closes stdin
"""


@pytest.fixture(scope="module")
def full_disk_store(tmp_path_factory):
    """(blob directory, listener port, main-port-style BlobApp port) of one store served by a
    process that cannot write a file past FILE_LIMIT."""
    directory = tmp_path_factory.mktemp("full") / "blobs"
    proc = subprocess.Popen([sys.executable, "-c", SERVE_WITH_FILE_LIMIT, str(directory),
                             str(FILE_LIMIT)], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        ports = json.loads(proc.stdout.readline())
        yield directory, *ports
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait(10)


def settled_files(directory, expected: set[str]) -> set[str]:
    """The directory's files once they are `expected` or after 10 s (an aborted upload's temp
    file goes once its write threads are done with it)."""
    deadline = time.monotonic() + 10
    while set(os.listdir(directory)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return set(os.listdir(directory))


@pytest.mark.parametrize("server", ["listener", "main port"])
def test_a_full_disk_refuses_uploads_with_507_and_keeps_serving(full_disk_store, server):
    """Blobs over the file limit are refused 507 naming the cause (a PUT written on the
    request's thread, a large streamed POST written by the pipeline, a batch), nothing of
    them is left, and the same client goes on storing and fetching blobs that fit. Before,
    the listener cut the connection (the client saw a reset and retried it as network
    trouble) and the main port answered a bare 500."""
    directory, listener, main = full_disk_store
    port = listener if server == "listener" else main
    rng = np.random.default_rng(len(server))
    fits = [rng.integers(-99, 99, 100_000 + i, dtype=np.int8) for i in range(3)]
    too_big = [rng.integers(-99, 99, 600_000, dtype=np.int8),  # PUT, written by check()
               rng.integers(-99, 99, 3 << 18, dtype=np.int32)]  # 3 MiB: streamed POST
    client = BlobClient(f"http://127.0.0.1:{port}/blobs", 16 << 20, timeout=20)
    try:
        before = set(os.listdir(directory))
        first = client.put_array(fits[0])
        for array in too_big:
            with pytest.raises(BlobError, match="507 .*could not write it: File too large"):
                client.put_array(array)
        with pytest.raises(BlobError, match="507 .*could not write it"):
            client.put_many([[encode_array(fits[1])], [encode_array(too_big[0])]])
        last = client.put_array(fits[2])  # the connection and the store still serve
        np.testing.assert_array_equal(client.get_array(first), fits[0])
        np.testing.assert_array_equal(client.get_array(last), fits[2])
    finally:
        client.close()
    stored = before | {first.hex(), last.hex()}
    assert settled_files(directory, stored) == stored  # no temp file, nothing too big
    assert first == blake3.blake3(encode_array(fits[0])).digest()


class HostileStore:
    """A raw-socket HTTP server on 127.0.0.1 that answers one request with `head` and then
    `body_bytes` of body (sent until the client closes, or `body_bytes` is reached); `sent`
    counts the body bytes the kernel took. With `hold`, the connection then stays open until
    the client closes it (a reply that stalls)."""

    def __init__(self, head: bytes, body_bytes: int, hold: bool = False) -> None:
        self.head, self.body_bytes, self.hold, self.sent = head, body_bytes, hold, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/blobs"
        self.thread = threading.Thread(target=self._answer, daemon=True)
        self.thread.start()

    def _answer(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(20)
            conn.recv(1 << 20)  # the request (a small one: its body comes with it)
            conn.sendall(self.head)
            piece = b"x" * (1 << 20)
            try:
                while self.sent < self.body_bytes:
                    conn.sendall(piece)
                    self.sent += len(piece)
                while self.hold and conn.recv(1 << 16):
                    pass
            except OSError:
                pass  # the client closed (or 20 s passed)

    def close(self) -> None:
        self.listener.close()
        self.thread.join(30)


REQUESTS = {
    "get": lambda client: client.get(b"\x07" * 32),
    "put": lambda client: client.put(encode_array(np.arange(5, dtype=np.int8))),
    "put_many": lambda client: client.put_many([[encode_array(np.ones(3, np.int16))]]),
}


@pytest.mark.parametrize("request_kind", list(REQUESTS))
def test_an_endless_reply_is_refused_after_a_bounded_read(request_kind):
    """A store answering with an error whose body never ends (no Content-Length, until the
    connection closes): the client reads at most 64 KiB (REPLY_BYTES) and closes. Before, it read
    the whole 64 MiB the server sent into memory (an endless one without bound)."""
    store = HostileStore(b"HTTP/1.1 500 Oops\r\nContent-Type: text/plain\r\n"
                         b"Connection: close\r\n\r\n", body_bytes=64 << 20)
    client = BlobClient(store.url, 1 << 20, timeout=20)
    try:
        with pytest.raises(BlobError, match="500 with a reply over 65536 bytes"):
            REQUESTS[request_kind](client)
    finally:
        client.close()
        store.close()
    assert store.sent < 32 << 20  # the client stopped reading (socket buffers hold the rest)


@pytest.mark.parametrize("request_kind", list(REQUESTS))
def test_a_huge_declared_reply_is_refused_unread(request_kind):
    """A reply declaring 8 GiB (and sending a few bytes, then nothing): refused from its
    Content-Length at once. Before, the client allocated for the whole declared length and
    waited for it until its socket timed out."""
    store = HostileStore(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n{\"error\": " % (8 << 30), body_bytes=0,
                         hold=True)
    client = BlobClient(store.url, 1 << 20, timeout=5)
    try:
        with pytest.raises(BlobError, match="400 with a reply over 65536 bytes"):
            REQUESTS[request_kind](client)
    finally:
        client.close()
        store.close()


@pytest.fixture(scope="module", params=BLOB_SERVERS)
def node(tmp_path_factory, request):
    """A node per blob server under test (its listener, or /blobs on its main port)."""
    with blob_node(tmp_path_factory.mktemp("chain") / "data", request.param, 4) as proc:
        yield proc


def raw_exchange(port: int, raw: bytes) -> tuple[int, bytes, bool]:
    """One raw request on a fresh connection: (status, body, whether the server closed the
    connection after it); status 0 if it closed without a reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        reader = sock.makefile("rb")
        status_line = reader.readline()
        if not status_line:
            return 0, b"", True
        headers = {}
        while (line := reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = reader.read(int(headers.get("content-length", 0)))
        closed = headers.get("connection") == "close"
        return int(status_line.split()[1]), body, closed


def test_a_content_length_of_thousands_of_digits(node):
    """A Content-Length with 4400 leading zeros is a valid length: the blob is stored (before,
    int() refused more than 4300 digits: the listener's connection thread died with a
    traceback and no reply, the main port answered 500). 5000 nines are refused 400 and the
    connection closed (the listener's thread died the same way)."""
    blob = encode_array(np.arange(10, dtype=np.int16))
    id_hex = blake3.blake3(blob).hexdigest()
    status, body, _ = raw_exchange(node.blob_port, (
        f"PUT /blobs/0x{id_hex} HTTP/1.1\r\nHost: x\r\n"
        f"Content-Length: {'0' * 4400}{len(blob)}\r\n\r\n").encode() + blob)
    assert status == 200, (status, body)
    assert json.loads(body) == {"id": "0x" + id_hex, "size": len(blob)}
    assert (node.data_dir / "blobs" / id_hex).read_bytes() == blob
    status, body, closed = raw_exchange(node.blob_port, (
        f"PUT /blobs/0x{'00' * 32} HTTP/1.1\r\nHost: x\r\n"
        f"Content-Length: {'9' * 5000}\r\n\r\n").encode())
    assert status == 400 and closed, (status, body)
    if node.blob_port != node.port:  # the listener says why; uvicorn answers its own text
        assert "Content-Length over 20 digits" in json.loads(body)["error"]


def test_a_download_without_a_usable_content_length_is_refused():
    """A store answering 200 with a Content-Length that is no number: BlobError naming it and
    the connection closed (before, a bare ValueError from int())."""
    store = HostileStore(b"HTTP/1.1 200 OK\r\nContent-Length: 12abc\r\n\r\n", body_bytes=0,
                         hold=True)
    client = BlobClient(store.url, 1 << 20, timeout=5)
    try:
        with pytest.raises(BlobError, match="no usable Content-Length .'12abc'"):
            client.get(b"\x07" * 32)
    finally:
        client.close()
        store.close()
