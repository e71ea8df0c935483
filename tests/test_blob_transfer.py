"""The pipelined blob transfer: `BlobWriter` hashing and writing on threads, through the
page cache or with O_DIRECT (against the blake3 package and the bytes themselves), and large uploads
hashed while sent (`POST` framing, the id after the bytes) through a real node process,
by its blob listener and by its main port: round trips bit for bit, a wrong or missing
trailing hash or a cut connection stores nothing and leaves no temp file; a blob the store
already has stops being sent once its hash is known. Then the listener's HTTP/1.1 itself
(`chain/blobserver.py`, a real server on 127.0.0.1): keep-alive and pipelined requests,
`Expect: 100-continue`, refused requests with the connection kept or closed as they must
be, shutdown in the middle of an upload, and how `chain up` picks and advertises its port.
Last, downloads of recent uploads from memory: only after the pool has buffers at hand,
never for a refused or cut upload, evicted by bytes, a blob being sent kept until its sends
are done (checked by overwriting the files on disk, so only memory can give the bytes)."""
import http.client
import json
import mmap
import os
import socket
import subprocess
import sys
import time
from concurrent import futures
from urllib.parse import urlsplit

import blake3
import httpx
import numpy as np
import pytest
from helpers import BLOB_SERVERS, blob_node

from chain.blobhttp import BlobClient, _AlreadyStored, _HashedFrame
from chain.blobs import PIPELINE_BYTES, BlobStore, encode_array
from chain.blobserver import BlobServer, blob_url
from chain.launch import NodeProcess, free_port
from node.devnet import Devnet

pytestmark = pytest.mark.timeout(60)
LIMIT_MB = 24


def files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def wait_for_temp_file(directory) -> None:
    """Until an upload's temp file exists (bounded), while its client still holds the
    connection: a cut checked before the upload began would find no temp file to remove."""
    deadline = time.monotonic() + 30
    while not any(f.startswith(".tmp") for f in files(directory)) and \
            time.monotonic() < deadline:
        time.sleep(0.01)
    assert any(f.startswith(".tmp") for f in files(directory))


def wait_for_files(directory, expected: list[str]) -> list[str]:
    """An aborted upload's temp file is removed once the node sees the abort, on its write
    thread: wait (bounded). Seen taking ~5 s under uvicorn's h11 protocol (no httptools)
    on a loaded 16-core machine, hence the generous bound."""
    deadline = time.monotonic() + 30
    while files(directory) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return files(directory)


@pytest.mark.parametrize("mib", [0.25, 3, 21])
def test_writer_in_uneven_chunks_matches_blake3(tmp_path, mib):
    """Chunks of uneven sizes (below, at and across the pipeline step): the stored file is
    the bytes written and its id their BLAKE3 (the blake3 package over the whole blob)."""
    rng = np.random.default_rng(int(mib * 4))
    blob = encode_array(rng.integers(0, 255, int(mib * 2**20), dtype=np.uint8).view(np.int8))
    store = BlobStore(tmp_path, max_bytes=LIMIT_MB << 20)
    writer = store.writer(len(blob))
    view, start = memoryview(blob), 0
    while start < len(blob):
        step = int(rng.integers(1, 3 * PIPELINE_BYTES // 2))
        writer.write(view[start:start + step])
        start += step
    id_ = writer.commit(blake3.blake3(blob).digest())
    store.sync_directory()
    assert (tmp_path / id_.hex()).read_bytes() == blob
    assert files(tmp_path) == [id_.hex()]


def test_writer_refuses_a_wrong_hash_and_an_abort_leaves_nothing(tmp_path):
    blob = encode_array(np.arange(3 << 20, dtype=np.int32))  # 12 MiB: a pipelined writer
    store = BlobStore(tmp_path, max_bytes=LIMIT_MB << 20)
    writer = store.writer(len(blob))
    writer.write(blob)
    with pytest.raises(ValueError, match="BLAKE3 of the body is 0x" +
                       blake3.blake3(blob).hexdigest()):
        writer.commit(blake3.blake3(b"another blob").digest())
    half = store.writer()
    half.write(memoryview(blob)[:5 << 20])
    half.abort()  # mid-upload, steps still running
    assert wait_for_files(tmp_path, []) == []
    with pytest.raises(ValueError, match="exceeds"):
        store.writer().write(bytes((LIMIT_MB << 20) + 1))
    assert wait_for_files(tmp_path, []) == []


def test_a_failed_write_fails_the_upload_and_stores_nothing(tmp_path):
    """A write step that fails (the disk is full: /dev/full) is raised by the receiver's
    backlog check and again by check(); nothing is stored."""
    blob = encode_array(np.arange(1 << 20, dtype=np.int32))  # 4 MiB: one pipelined step
    store = BlobStore(tmp_path, max_bytes=LIMIT_MB << 20)
    writer = store.writer(len(blob))
    os.close(writer.fd)
    writer.fd = os.open("/dev/full", os.O_WRONLY)
    writer.write(blob)
    futures.wait(writer.in_flight[0][:2])
    with pytest.raises(OSError, match="No space left"):
        writer.lagging()
    with pytest.raises(OSError, match="No space left"):
        writer.check(blake3.blake3(blob).digest())
    assert wait_for_files(tmp_path, []) == []


@pytest.mark.parametrize("lead", [0, 8])
def test_writer_with_aligned_buffers_writes_them_direct(tmp_path, lead):
    """Page-aligned 1 MiB buffers (the listener's) then an odd tail: written with O_DIRECT
    where the filesystem allows it (the tail through the page cache), the file is the bytes
    and the id their BLAKE3. With an 8-byte chunk first (unaligned file offsets after it)
    everything goes through the page cache, same result."""
    rng = np.random.default_rng(lead)
    blob = encode_array(rng.standard_normal(((3 << 20) + 1234) // 4).astype(np.float32))
    store = BlobStore(tmp_path, max_bytes=LIMIT_MB << 20)
    writer = store.writer(len(blob))
    pieces = [blob[:lead]] if lead else []
    for start in range(lead, len(blob), 1 << 20):
        buffer = mmap.mmap(-1, 1 << 20)  # page aligned, like the listener's pool buffers
        piece = blob[start:start + (1 << 20)]
        buffer[:len(piece)] = piece
        pieces.append(memoryview(buffer)[:len(piece)])
    for piece in pieces:
        writer.write(piece)
    writer.finish()
    assert (writer.direct_fd >= 0) == (lead == 0 and store.direct_io)
    assert writer.settled == len(blob)
    id_ = writer.commit(blake3.blake3(blob).digest())
    store.sync_directory()
    assert (tmp_path / id_.hex()).read_bytes() == blob
    assert files(tmp_path) == [id_.hex()]


def test_writer_declared_more_than_came_stores_exactly_the_blob(tmp_path):
    """The declared size is allocated up front so that the write steps in flight land inside
    the file; a body shorter than declared (which still hashes to its id) is stored as its
    own bytes, not padded to the allocation."""
    blob = encode_array(np.random.default_rng(7).standard_normal(3 << 18).astype(np.float32))
    store = BlobStore(tmp_path, max_bytes=LIMIT_MB << 20)
    writer = store.writer(len(blob) + (3 << 20) + 5)
    for start in range(0, len(blob), 1 << 20):
        buffer = mmap.mmap(-1, 1 << 20)
        piece = blob[start:start + (1 << 20)]
        buffer[:len(piece)] = piece
        writer.write(memoryview(buffer)[:len(piece)])
    id_ = writer.commit(blake3.blake3(blob).digest())
    assert (tmp_path / id_.hex()).read_bytes() == blob


@pytest.fixture(scope="module", params=BLOB_SERVERS)
def node(tmp_path_factory, request):
    """A node per blob server under test; `node.blob_port` is that server's port."""
    with blob_node(tmp_path_factory.mktemp("chain") / "data", request.param, LIMIT_MB) as proc:
        yield proc


def test_large_blobs_round_trip_hashed_while_sent(node):
    """A 21 MiB array (several read chunks, pipeline steps and write-backs) and arrays around
    the streaming threshold go up hashed while sent and come back bit for bit; the id is
    the BLAKE3 of numpy's encoding."""
    client = BlobClient(f"http://127.0.0.1:{node.blob_port}/blobs", LIMIT_MB << 20)
    rng = np.random.default_rng(2)
    for n in ((21 << 20) // 4, (1 << 18) - 3, 1 << 18):  # 21 MiB, just below and at 1 MiB
        array = rng.standard_normal(n).astype(np.float32)
        id_ = client.put_array(array)
        assert id_ == blake3.blake3(encode_array(array)).digest()
        np.testing.assert_array_equal(client.get_array(id_), array)
        assert client.put_array(array) == id_  # again: the node keeps one copy
    client.close()
    directory = node.data_dir / "blobs"  # a repeated upload cut short: its temp file goes
    stored = sorted(f for f in files(directory) if not f.startswith(".tmp"))
    assert wait_for_files(directory, stored) == stored


def test_streamed_upload_with_wrong_or_cut_trailer_stores_nothing(node):
    blob = encode_array(np.random.default_rng(3).standard_normal(3 << 18).astype(np.float32))
    directory = node.data_dir / "blobs"
    before = files(directory)
    framed = len(blob).to_bytes(8, "little") + blob

    def post(body: bytes) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", node.blob_port)
        conn.request("POST", "/blobs/", body)
        response = conn.getresponse()
        result = response.status, json.loads(response.read())
        conn.close()
        return result

    status, reply = post(framed + blake3.blake3(blob + b"!").digest())
    assert status == 400 and "BLAKE3 of the body is 0x" + blake3.blake3(blob).hexdigest() \
        in reply["error"]
    status, reply = post(framed + blake3.blake3(blob).digest()[:31])
    assert status == 400 and "ends inside blob 0" in reply["error"]
    with socket.create_connection(("127.0.0.1", node.blob_port)) as sock:  # cut mid-blob
        sock.sendall(b"POST /blobs/ HTTP/1.1\r\nHost: x\r\nContent-Length: "
                     + str(len(framed) + 32).encode() + b"\r\n\r\n" + framed[:2 << 20])
        wait_for_temp_file(directory)
    assert wait_for_files(directory, before) == before
    status, reply = post(framed + blake3.blake3(blob).digest())
    assert status == 200 and reply["ids"] == ["0x" + blake3.blake3(blob).hexdigest()]
    assert (directory / blake3.blake3(blob).hexdigest()).read_bytes() == blob


def test_a_blob_the_store_has_stops_being_sent(node):
    """Once the hash thread has the id and the store says it has the blob, the frame stops
    before its next step; put_array then returns the id at once, and the connection it
    closed mid-body is reopened for the next request."""
    client = BlobClient(f"http://127.0.0.1:{node.blob_port}/blobs", LIMIT_MB << 20)
    array = np.random.default_rng(4).standard_normal((21 << 20) // 4).astype(np.float32)
    id_ = client.put_array(array)
    blob = memoryview(encode_array(array))
    frame = _HashedFrame([blob], len(blob), client._hash_pool(), client.has)
    steps = iter(frame)
    next(steps), next(steps)  # the length and the first step
    for _ in range(200):
        if frame.asking is not None and frame.asking.done():
            break
        time.sleep(0.01)
    with pytest.raises(_AlreadyStored):
        next(steps)
    assert frame.id == id_
    assert client.put_array(array) == id_
    np.testing.assert_array_equal(client.get_array(id_), array)
    client.close()
    directory = node.data_dir / "blobs"
    assert not [f for f in wait_for_files(directory, sorted(
        f for f in files(directory) if not f.startswith(".tmp"))) if f.startswith(".tmp")]


# -- the listener's HTTP/1.1 ---------------------------------------------------------------

@pytest.fixture
def listener(tmp_path):
    store = BlobStore(tmp_path / "blobs", max_bytes=LIMIT_MB << 20)
    with BlobServer(store) as server:
        yield server


def read_response(reader, head: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One response from a socket's reader (status, headers, body)."""
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    length = 0 if head or status == 100 else int(headers.get("content-length", 0))
    return status, headers, reader.read(length)


def test_listener_keep_alive_pipelining_and_100_continue(listener):
    blob = encode_array(np.random.default_rng(5).standard_normal(300_001).astype(np.float32))
    id_hex = blake3.blake3(blob).hexdigest()
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        reader = sock.makefile("rb")
        sock.sendall(f"PUT /blobs/0x{id_hex} HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     f"Content-Length: {len(blob)}\r\n\r\n".encode())
        assert read_response(reader)[0] == 100  # the size is accepted: now the body
        sock.sendall(blob)
        status, _, body = read_response(reader)
        assert status == 200 and json.loads(body) == {"id": "0x" + id_hex, "size": len(blob)}
        missing = "0x" + "07" * 32
        sock.sendall(f"GET /blobs/0x{id_hex} HTTP/1.1\r\n\r\nHEAD /blobs/0x{id_hex} HTTP/1.1"
                     f"\r\n\r\nGET /blobs/{missing}?x=1 HTTP/1.1\r\n\r\n".encode())
        status, headers, body = read_response(reader)
        assert status == 200 and body == blob
        assert headers["content-type"] == "application/octet-stream"
        status, headers, body = read_response(reader, head=True)
        assert status == 200 and int(headers["content-length"]) == len(blob) and body == b""
        status, _, body = read_response(reader)
        assert status == 404 and json.loads(body)["error"] == f"blob {missing} not found"
    assert files(listener.store.directory) == [id_hex]


def test_listener_batch_of_large_blobs(listener):
    """Several pipelined blobs in one `POST` (receive buffers shared between them, given
    back as each writer is done with them): all stored bit for bit."""
    rng = np.random.default_rng(6)
    blobs = [encode_array(rng.standard_normal(n).astype(np.float32))
             for n in (3 << 18, 5, (5 << 18) + 3)]
    body = b"".join(len(b).to_bytes(8, "little") + b + blake3.blake3(b).digest()
                    for b in blobs)
    conn = http.client.HTTPConnection("127.0.0.1", listener.port)
    conn.request("POST", "/blobs/", body)
    response = conn.getresponse()
    ids = ["0x" + blake3.blake3(b).hexdigest() for b in blobs]
    assert (response.status, json.loads(response.read())) == (200, {"ids": ids})
    conn.close()
    for id_, blob in zip(ids, blobs, strict=True):
        assert (listener.store.directory / id_[2:]).read_bytes() == blob


def test_listener_concurrent_large_downloads_read_ahead(listener):
    """Large downloads (O_DIRECT reads running ahead of the sends on shared reader threads)
    of sizes around the read step, 8 at once on separate connections and twice each, come
    back bit for bit: no read lands in another download's buffer."""
    rng = np.random.default_rng(9)
    sizes = [(1 << 20) - 32, 1 << 20, (3 << 20) + 4096, (5 << 20) + 7]
    blobs = [encode_array(rng.integers(0, 255, n, dtype=np.uint8).view(np.int8))
             for n in sizes]
    client = BlobClient(f"http://127.0.0.1:{listener.port}/blobs", LIMIT_MB << 20)
    ids = [client.put(blob) for blob in blobs]
    with futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: bytes(client.get(ids[i % 4])), range(16)))
    assert [g == blobs[i % 4] for i, g in enumerate(got)] == [True] * 16
    client.close()


def test_listener_refusals_keep_or_close_the_connection(listener):
    """A refused body is read and dropped so the connection serves the next request; a
    client waiting for `100 Continue` is refused at once and the connection closed; what the
    listener cannot parse is answered 400 and closed. Nothing is stored."""
    too_big = (LIMIT_MB << 20) + 1
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        reader = sock.makefile("rb")
        sock.sendall(f"PUT /blobs/0x{'00' * 32} HTTP/1.1\r\nContent-Length: {too_big}\r\n\r\n"
                     .encode() + bytes(too_big))
        status, headers, body = read_response(reader)
        assert status == 413 and "exceeds the" in json.loads(body)["error"]
        assert "connection" not in headers
        for request, expected in ((f"DELETE /blobs/0x{'00' * 32}", 405), ("GET /other", 404),
                                  ("GET /blobs/12", 400), (f"HEAD /blobs/0x{'00' * 32}", 404)):
            sock.sendall(f"{request} HTTP/1.1\r\n\r\n".encode())
            assert read_response(reader, head=request.startswith("HEAD"))[0] == expected
        sock.sendall(b"POST /blobs/ HTTP/1.1\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
        status, headers, body = read_response(reader)
        assert status == 200 and json.loads(body) == {"ids": []}
        assert headers["connection"] == "close" and reader.read() == b""  # closed
    for request, message in (
            (f"PUT /blobs/0x{'00' * 32} HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: "
             f"{too_big}\r\n\r\n", "exceeds the"),
            ("POST /blobs/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", "chunked"),
            ("GET /blobs/ HTTP/1.1\r\nContent-Length: -3\r\n\r\n", "negative"),
            ("BREW /blobs\r\n\r\n", "bad request line")):
        with socket.create_connection(("127.0.0.1", listener.port)) as sock:
            reader = sock.makefile("rb")
            sock.sendall(request.encode())
            status, _, body = read_response(reader)
            assert status in (400, 413) and message in json.loads(body)["error"]
            assert reader.read() == b""  # closed without waiting for a body
    assert files(listener.store.directory) == []


def test_listener_close_mid_upload_stores_nothing(tmp_path):
    store = BlobStore(tmp_path / "blobs", max_bytes=LIMIT_MB << 20)
    server = BlobServer(store).start()
    blob = encode_array(np.arange(3 << 18, dtype=np.int32))  # 3 MiB: pipelined, direct
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(f"PUT /blobs/0x{blake3.blake3(blob).hexdigest()} HTTP/1.1\r\n"
                     f"Content-Length: {len(blob)}\r\n\r\n".encode() + blob[:2 << 20])
        wait_for_temp_file(store.directory)
        server.close()
        assert sock.recv(100) == b""  # cut
    assert wait_for_files(store.directory, []) == []
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


def test_chain_up_blob_port_and_the_advertised_url(tmp_path):
    """`--blob-port` is honoured and `/info` advertises it at the host the client used; by
    default the listener takes the HTTP port + 1, or any free port when that is taken."""
    blob_port = free_port()
    with NodeProcess(tmp_path / "a", block_time=0,
                     extra_args=("--blob-port", str(blob_port))) as node:
        for host in ("127.0.0.1", "localhost"):
            info = httpx.get(f"http://{host}:{node.port}/info").json()
            assert info["blob_url"] == f"http://{host}:{blob_port}/blobs"
        client = BlobClient(info["blob_url"], LIMIT_MB << 20)
        ones = np.ones(5, np.int16)
        np.testing.assert_array_equal(client.get_array(client.put_array(ones)), ones)
        client.close()
        assert f"blobs http://127.0.0.1:{blob_port}/blobs" in node.log_path.read_text()
    port = free_port()
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", port + 1))
        except OSError:
            pass  # taken by someone else: the same case
        with NodeProcess(tmp_path / "b", block_time=0, port=port) as node:
            url = httpx.get(f"{node.url}/info").json()["blob_url"]
            assert urlsplit(url).port not in (port, port + 1)
            assert httpx.head(f"{url}/0x{'00' * 32}").status_code == 404
        # a port given explicitly is not replaced: taken, the node does not start
        result = subprocess.run([sys.executable, "-m", "chain", "up", "--data-dir",
                                 str(tmp_path / "c"), "--port", str(free_port()),
                                 "--blob-port", str(port + 1)],
                                capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "Address already in use" in result.stderr + result.stdout


def test_chain_up_blob_cache_option(tmp_path):
    """`chain up --blob-cache-mb 0` serves every download from the disk; with the default
    the latest uploads (here the second, once the pool has grown) come from memory. Each
    blob's file is overwritten after its upload: what a download returns says where from."""
    rng = np.random.default_rng(12)
    for cache_mb, from_memory in ((0, False), (None, True)):
        extra = ("--max-blob-mb", str(LIMIT_MB)) + (
            ("--blob-cache-mb", str(cache_mb)) if cache_mb is not None else ())
        with NodeProcess(tmp_path / f"cache-{cache_mb}", block_time=0, extra_args=extra) as node:
            url = httpx.get(f"{node.url}/info").json()["blob_url"]
            client = BlobClient(url, LIMIT_MB << 20)
            store = BlobStore(node.data_dir / "blobs", LIMIT_MB << 20)
            served = []
            for _ in range(3):  # a cold listener keeps the first upload on disk only
                blob = encode_array(rng.standard_normal(3 << 18).astype(np.float32))
                id_hex = client.put(blob).hex()
                overwrite_on_disk(store, id_hex)
                served.append(raw_get(urlsplit(url).port, id_hex) == blob)
                time.sleep(0.5)  # the pool grows on a thread of its own meanwhile
            client.close()
            assert served[-1] is from_memory and (any(served) is from_memory)
            assert f"recent uploads cached: {256 if cache_mb is None else 0} MiB" in \
                node.log_path.read_text()


def test_devnet_passes_its_blob_port(tmp_path):
    blob_port = free_port()
    with Devnet(tmp_path, blob_port=blob_port) as net:
        net.start_chain()
        info = httpx.get(f"{net.rpc_url}/info").json()
        assert info["blob_url"] == f"http://127.0.0.1:{blob_port}/blobs"


def test_listener_on_ipv6_and_its_advertised_url(tmp_path):
    """`chain up --host ::1` (as uvicorn takes it): the listener binds IPv6 and /info's
    blob_url brackets the address."""
    with BlobServer(BlobStore(tmp_path), "::1") as server:
        url = blob_url("http://[::1]:8545", server.port)
        assert url == f"http://[::1]:{server.port}/blobs"
        client = BlobClient(url, LIMIT_MB << 20)
        ones = np.ones(4, np.int8)
        np.testing.assert_array_equal(client.get_array(client.put_array(ones)), ones)
        client.close()
    assert blob_url("http://node.example:8545", None) == "http://node.example:8545/blobs"


def test_client_falls_back_when_nothing_listens_at_the_blob_url(listener):
    """A blob port that is not reachable (not published, firewalled): with a fallback URL
    the client moves there for good; without one the refusal is raised."""
    closed = f"http://127.0.0.1:{free_port()}/blobs"
    with pytest.raises(ConnectionRefusedError):
        BlobClient(closed, LIMIT_MB << 20).has(b"\0" * 32)
    client = BlobClient(closed, LIMIT_MB << 20,
                        fallback_url=f"http://127.0.0.1:{listener.port}/blobs")
    arrays = [np.arange(k, dtype=np.int64) for k in (3, 300_000)]  # batched, streamed
    ids = client.put_arrays(arrays, threads=2)
    assert client.connections is client.fallback
    for id_, array in zip(ids, arrays, strict=True):
        np.testing.assert_array_equal(client.get_array(id_), array)
    client.close()
    assert sorted(files(listener.store.directory)) == sorted(id_.hex() for id_ in ids)


def test_chain_client_reaches_blobs_through_the_rpc_port_when_the_blob_port_is_unpublished(
        tmp_path):
    """Like a compose network seen from the host: only the RPC port is forwarded (here to
    127.0.0.2, where the node's blob port has no listener), /info advertises the blob port at
    the host the client used, and the client falls back to /blobs on the RPC port."""
    from chain.client import ChainClient

    with NodeProcess(tmp_path / "data", block_time=0) as node, \
            socket.create_server(("127.0.0.2", 0)) as front:
        front.settimeout(0.2)

        def pipe(src: socket.socket, dst: socket.socket) -> None:
            with src, dst:
                while data := src.recv(1 << 16):
                    dst.sendall(data)
                dst.shutdown(socket.SHUT_WR)

        def forward(stop_at: float) -> None:
            while time.monotonic() < stop_at and front.fileno() != -1:  # bounded
                try:
                    conn, _ = front.accept()
                except (TimeoutError, OSError):
                    continue
                conn.settimeout(None)
                back = socket.create_connection(("127.0.0.1", node.port))
                for a, b in ((conn, back), (back, conn)):
                    pool.submit(pipe, a, b)

        with futures.ThreadPoolExecutor(16) as pool:
            done = pool.submit(forward, time.monotonic() + 30)
            url = f"http://127.0.0.2:{front.getsockname()[1]}"
            client = ChainClient(url)
            assert urlsplit(client.info["blob_url"]).hostname == "127.0.0.2"
            assert urlsplit(client.info["blob_url"]).port != front.getsockname()[1]
            array = np.arange(50_000, dtype=np.float32).reshape(250, 200)
            id_ = client.put_blob(array)
            assert client.blobs.connections is client.blobs.fallback
            np.testing.assert_array_equal(client.blobs.get_array(id_), array)
            assert id_.hex() in files(node.data_dir / "blobs")
            client.close()
            front.close()
            done.result(timeout=35)


# -- downloads of recent uploads from memory -----------------------------------------------

def request(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    """(status, body) of one request on a connection of its own."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    try:
        conn.request(method, path, body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def raw_get(port: int, id_hex: str) -> bytes:
    status, body = request(port, "GET", f"/blobs/0x{id_hex}")
    assert status == 200, body
    return body


def overwrite_on_disk(store: BlobStore, id_hex: str) -> None:
    """Replace a stored blob's file by other bytes of its size: a download that returns the
    uploaded bytes after this did not read the disk."""
    path = store.directory / id_hex
    path.write_bytes(bytes(path.stat().st_size))


def settle(server: BlobServer, idle: int = 0) -> None:
    """Wait (bounded) until the pool's background growth is over and `idle` bytes of its
    buffers are at hand (`server.pool.grow` first when asked for more than it has)."""
    if server.pool.idle_bytes() < idle:
        server.pool.grow(idle)
    deadline = time.monotonic() + 20
    while (server.pool.growing or server.pool.idle_bytes() < idle) and \
            time.monotonic() < deadline:
        time.sleep(0.01)
    assert not server.pool.growing and server.pool.idle_bytes() >= idle


def test_a_cold_listener_grows_its_pool_before_it_caches(tmp_path):
    """With no idle buffers the first large upload is not cached (it would fault in fresh
    memory while it receives); the pool grows on a thread of its own, and the next upload is
    kept and served from memory."""
    store = BlobStore(tmp_path / "blobs", max_bytes=LIMIT_MB << 20)
    rng = np.random.default_rng(10)
    first, second = (encode_array(rng.standard_normal(3 << 18).astype(np.float32))
                     for _ in range(2))
    with BlobServer(store, recent_bytes=8 << 20) as server:
        client = BlobClient(f"http://127.0.0.1:{server.port}/blobs", LIMIT_MB << 20)
        client.put(first)
        assert list(server.recent.blobs) == [] and server.recent.held == 0
        settle(server)
        assert server.pool.idle_bytes() >= 5 << 20  # the upload's size and two buffers
        id_ = client.put(second)
        assert list(server.recent.blobs) == [id_]
        overwrite_on_disk(store, id_.hex())
        assert bytes(client.get(id_)) == second
        client.close()


def test_recent_uploads_are_served_from_memory_and_evicted_by_bytes(tmp_path):
    """Streamed uploads (`POST`, the client's way) and a large `PUT` (its partial last buffer
    copied) are kept up to the byte bound, least recently used evicted first; a cached blob
    comes back bit for bit (BLAKE3 checked by the client) without reading the disk, an
    evicted one from its file; the memory held always matches the blobs cached."""
    store = BlobStore(tmp_path / "blobs", max_bytes=LIMIT_MB << 20)
    rng = np.random.default_rng(11)
    blobs = [encode_array(rng.standard_normal(n).astype(np.float32))
             for n in (3 << 18, (3 << 18) + 77, 1 << 19)]  # 3 MiB, 3 MiB + 308 B, 2 MiB
    ids = [blake3.blake3(b).hexdigest() for b in blobs]
    with BlobServer(store, recent_bytes=8 << 20) as server:
        settle(server, 16 << 20)
        client = BlobClient(f"http://127.0.0.1:{server.port}/blobs", LIMIT_MB << 20)
        client.put(blobs[0])
        assert request(server.port, "PUT", f"/blobs/0x{ids[1]}", blobs[1])[0] == 200
        recent = server.recent
        assert list(recent.blobs) == [bytes.fromhex(i) for i in ids[:2]]
        assert recent.held == sum(b.nbytes for b in recent.blobs.values()) <= 8 << 20
        overwrite_on_disk(store, ids[0])
        assert bytes(client.get(bytes.fromhex(ids[0]))) == blobs[0]  # from memory
        client.put(blobs[2])  # over the bound: evicts the least recently used, blob 1
        assert list(recent.blobs) == [bytes.fromhex(i) for i in (ids[0], ids[2])]
        assert recent.held == sum(b.nbytes for b in recent.blobs.values()) <= 8 << 20
        assert bytes(client.get(bytes.fromhex(ids[1]))) == blobs[1]  # from disk
        overwrite_on_disk(store, ids[2])
        assert raw_get(server.port, ids[2]) == blobs[2]
        client.close()


def test_refused_and_cut_uploads_are_never_cached(tmp_path):
    """An upload whose id does not check out, a batch of several blobs and a connection cut
    mid-body leave nothing cached and no memory reserved; a download of the refused id is
    404, not the refused bytes."""
    store = BlobStore(tmp_path / "blobs", max_bytes=LIMIT_MB << 20)
    blob = encode_array(np.random.default_rng(12).standard_normal(3 << 18).astype(np.float32))
    forged = blake3.blake3(blob + b"!").hexdigest()
    framed = len(blob).to_bytes(8, "little") + blob
    with BlobServer(store, recent_bytes=16 << 20) as server:
        settle(server, 16 << 20)
        assert request(server.port, "POST", "/blobs/", framed + bytes.fromhex(forged))[0] == 400
        assert request(server.port, "PUT", f"/blobs/0x{forged}", blob)[0] == 400
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /blobs/ HTTP/1.1\r\nContent-Length: "
                         + str(len(framed) + 32).encode() + b"\r\n\r\n" + framed[:2 << 20])
            wait_for_temp_file(store.directory)
        assert wait_for_files(store.directory, []) == []
        deadline = time.monotonic() + 10  # the cut connection's thread lets go (bounded)
        while server.recent.held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (server.recent.held, list(server.recent.blobs)) == (0, [])
        assert request(server.port, "GET", f"/blobs/0x{forged}")[0] == 404
        pair = [blob, encode_array(np.arange(5, dtype=np.int8))]
        body = b"".join(len(b).to_bytes(8, "little") + b + blake3.blake3(b).digest()
                        for b in pair)
        assert request(server.port, "POST", "/blobs/", body)[0] == 200
        assert (server.recent.held, list(server.recent.blobs)) == (0, [])
        settle(server)
        # the check: this one is cached
        assert request(server.port, "POST", "/blobs/", framed + blake3.blake3(blob).digest()
                       )[0] == 200
        assert list(server.recent.blobs) == [blake3.blake3(blob).digest()]


def test_concurrent_downloads_of_a_cached_blob_while_it_is_evicted(tmp_path):
    """Four downloads of one cached blob stalled mid-send (small receive windows) while
    uploads evict it and take memory: a blob being sent keeps its buffers until its last
    send, so every download completes bit for bit; then the memory held is the cache's."""
    store = BlobStore(tmp_path / "blobs", max_bytes=LIMIT_MB << 20)
    rng = np.random.default_rng(13)
    first = encode_array(rng.standard_normal(5 << 18).astype(np.float32))  # 5 MiB
    others = [encode_array(rng.standard_normal(5 << 18).astype(np.float32)) for _ in range(3)]
    with BlobServer(store, recent_bytes=6 << 20) as server:
        settle(server, 16 << 20)
        client = BlobClient(f"http://127.0.0.1:{server.port}/blobs", LIMIT_MB << 20)
        id_ = client.put(first)
        assert list(server.recent.blobs) == [id_]
        downloads = []
        for _ in range(4):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(f"GET /blobs/0x{id_.hex()} HTTP/1.1\r\n\r\n".encode())
            reader = sock.makefile("rb")
            while reader.readline() not in (b"\r\n", b""):
                pass
            downloads.append((sock, reader, reader.read(1 << 16)))
        assert server.recent.blobs[id_].readers == 4  # all four sends under way
        assert [client.put(b) for b in others] == [blake3.blake3(b).digest() for b in others]
        assert id_ not in server.recent.blobs
        for sock, reader, start in downloads:
            assert start + reader.read(len(first) - len(start)) == first
            sock.close()
        deadline = time.monotonic() + 10  # the last send's thread lets go (bounded)
        while server.recent.held != sum(b.nbytes for b in server.recent.blobs.values()) and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.recent.held == sum(b.nbytes for b in server.recent.blobs.values())
        with futures.ThreadPoolExecutor(8) as pool:  # and from disk, eight at once
            assert all(g == first for g in pool.map(lambda _: bytes(client.get(id_)), range(8)))
        client.close()
