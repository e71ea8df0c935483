"""The pipelined blob transfer: `BlobWriter` hashing and writing on threads (against hashlib
and the bytes themselves), and large uploads hashed while sent (`POST` framing, the sha256
after the bytes) through a real node process: round trips bit for bit, a wrong or missing
trailing hash or a cut connection stores nothing and leaves no temp file; a blob the store
already has stops being sent once its hash is known."""
import hashlib
import http.client
import json
import os
import socket
import time
from concurrent import futures

import numpy as np
import pytest

from chain.blobhttp import BlobClient, _AlreadyStored, _HashedFrame
from chain.blobs import PIPELINE_BYTES, BlobStore, encode_array
from chain.launch import NodeProcess

pytestmark = pytest.mark.timeout(60)
LIMIT_MB = 24


def files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def wait_for_files(directory, expected: list[str]) -> list[str]:
    """An aborted upload's temp file is removed once the node sees the abort, on its write
    thread: wait (bounded). Seen taking ~5 s under uvicorn's h11 protocol (no httptools)
    on a loaded 16-core machine, hence the generous bound."""
    deadline = time.monotonic() + 30
    while files(directory) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return files(directory)


@pytest.mark.parametrize("mib", [0.25, 3, 21])
def test_writer_in_uneven_chunks_matches_hashlib(tmp_path, mib):
    """Chunks of uneven sizes (below, at and across the pipeline step): the stored file is
    the bytes written and its id their sha256 (hashlib over the whole blob)."""
    rng = np.random.default_rng(int(mib * 4))
    blob = encode_array(rng.integers(0, 255, int(mib * 2**20), dtype=np.uint8).view(np.int8))
    store = BlobStore(tmp_path, max_bytes=LIMIT_MB << 20)
    writer = store.writer(len(blob))
    view, start = memoryview(blob), 0
    while start < len(blob):
        step = int(rng.integers(1, 3 * PIPELINE_BYTES // 2))
        writer.write(view[start:start + step])
        start += step
    id_ = writer.commit(hashlib.sha256(blob).digest())
    store.sync_directory()
    assert (tmp_path / id_.hex()).read_bytes() == blob
    assert files(tmp_path) == [id_.hex()]


def test_writer_refuses_a_wrong_hash_and_an_abort_leaves_nothing(tmp_path):
    blob = encode_array(np.arange(3 << 20, dtype=np.int32))  # 12 MiB: a pipelined writer
    store = BlobStore(tmp_path, max_bytes=LIMIT_MB << 20)
    writer = store.writer(len(blob))
    writer.write(blob)
    with pytest.raises(ValueError, match="sha256 of the body is 0x" +
                       hashlib.sha256(blob).hexdigest()):
        writer.commit(hashlib.sha256(b"another blob").digest())
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
        writer.check(hashlib.sha256(blob).digest())
    assert wait_for_files(tmp_path, []) == []


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    data = tmp_path_factory.mktemp("chain") / "data"
    with NodeProcess(data, block_time=0, extra_args=("--max-blob-mb", str(LIMIT_MB))) as proc:
        yield proc


def test_large_blobs_round_trip_hashed_while_sent(node):
    """A 21 MiB array (several read chunks, pipeline steps and write-backs) and arrays around
    the streaming threshold go up hashed while sent and come back bit for bit; the id is
    the sha256 of numpy's encoding."""
    client = BlobClient(f"{node.url}/blobs", LIMIT_MB << 20)
    rng = np.random.default_rng(2)
    for n in ((21 << 20) // 4, (1 << 18) - 3, 1 << 18):  # 21 MiB, just below and at 1 MiB
        array = rng.standard_normal(n).astype(np.float32)
        id_ = client.put_array(array)
        assert id_ == hashlib.sha256(encode_array(array)).digest()
        np.testing.assert_array_equal(client.get_array(id_), array)
        assert client.put_array(array) == id_  # again: the node keeps one copy
    client.close()
    assert not [f for f in files(node.data_dir / "blobs") if f.startswith(".tmp")]


def test_streamed_upload_with_wrong_or_cut_trailer_stores_nothing(node):
    blob = encode_array(np.random.default_rng(3).standard_normal(3 << 18).astype(np.float32))
    directory = node.data_dir / "blobs"
    before = files(directory)
    framed = len(blob).to_bytes(8, "little") + blob

    def post(body: bytes) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", node.port)
        conn.request("POST", "/blobs/", body)
        response = conn.getresponse()
        result = response.status, json.loads(response.read())
        conn.close()
        return result

    status, reply = post(framed + hashlib.sha256(blob + b"!").digest())
    assert status == 400 and "sha256 of the body is 0x" + hashlib.sha256(blob).hexdigest() \
        in reply["error"]
    status, reply = post(framed + hashlib.sha256(blob).digest()[:31])
    assert status == 400 and "ends inside blob 0" in reply["error"]
    with socket.create_connection(("127.0.0.1", node.port)) as sock:  # cut mid-blob
        sock.sendall(b"POST /blobs/ HTTP/1.1\r\nHost: x\r\nContent-Length: "
                     + str(len(framed) + 32).encode() + b"\r\n\r\n" + framed[:2 << 20])
    assert wait_for_files(directory, before) == before
    status, reply = post(framed + hashlib.sha256(blob).digest())
    assert status == 200 and reply["ids"] == ["0x" + hashlib.sha256(blob).hexdigest()]
    assert (directory / hashlib.sha256(blob).hexdigest()).read_bytes() == blob


def test_a_blob_the_store_has_stops_being_sent(node):
    """Once the hash thread has the id and the store says it has the blob, the frame stops
    before its next step; put_array then returns the id at once, and the connection it
    closed mid-body is reopened for the next request."""
    client = BlobClient(f"{node.url}/blobs", LIMIT_MB << 20)
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
