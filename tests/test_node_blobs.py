"""The blob transfer path against a real node process, through both of its blob servers
(the listener `/info` advertises, `chain/blobserver.py`, and `/blobs` on the main port,
`chain/blobhttp.py`'s BlobApp): arrays of every blob dtype and layout round-trip bit for bit
(numpy is the reference), and oversized, forged, truncated or corrupt blobs are refused with
the same clear errors and leave nothing behind."""
import http.client
import json

import blake3
import numpy as np
import pytest
from helpers import BLOB_SERVERS, blob_node

from chain.blobhttp import HASH_THREADS, BlobClient, BlobCutOff, BlobError, BlobNotFound
from chain.blobs import encode_array

pytestmark = pytest.mark.timeout(60)
LIMIT_MB = 4


@pytest.fixture(scope="module", params=BLOB_SERVERS)
def node(tmp_path_factory, request):
    """A node per blob server under test (each starts with an empty store)."""
    with blob_node(tmp_path_factory.mktemp("chain") / "data", request.param, LIMIT_MB) as proc:
        yield proc


@pytest.fixture(scope="module")
def blob_port(node) -> int:
    return node.blob_port


@pytest.fixture(scope="module")
def blobs(blob_port):
    client = BlobClient(f"http://127.0.0.1:{blob_port}/blobs", LIMIT_MB << 20)
    yield client
    client.close()


def stored_files(node):
    return sorted(p.name for p in (node.data_dir / "blobs").iterdir())


@pytest.mark.parametrize("array", [
    np.random.default_rng(0).standard_normal((3, 1000, 300)).astype(np.float32),  # 3.6 MB
    np.arange(60, dtype=">i4").reshape(3, 4, 5),  # big-endian: stored little-endian
    np.arange(24, dtype=np.int64).reshape(4, 6).T,  # not contiguous
    np.array([-128, 0, 127], np.int8),
    np.zeros((0, 5), np.int16),
], ids=["f32-3.6MB", "i4-big-endian", "i8-transposed", "i8", "i16-empty"])
def test_arrays_round_trip_bit_for_bit(blobs, array):
    id_ = blobs.put_array(array)
    assert id_ == blake3.blake3(encode_array(array)).digest()  # the id names the bytes
    back = blobs.get_array(id_)
    assert back.dtype == array.dtype.newbyteorder("<") and back.shape == array.shape
    np.testing.assert_array_equal(back, array)
    assert blobs.has(id_) and blobs.put_array(array) == id_  # again: idempotent


def test_downloads_own_their_buffers(blobs):
    """Each download lands in memory of its own: arrays (and raw bytes) fetched earlier keep
    their values while later downloads of the same sizes (3 MiB, 64 KiB) fill new buffers;
    no result is a view of another."""
    rng = np.random.default_rng(5)
    for shape in ((3, 1 << 18), (1 << 14,)):
        arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
        ids = blobs.put_arrays(arrays)
        raw = bytes(blobs.get(ids[0]))
        fetched = [blobs.get_array(id_) for id_ in ids]
        fetched += [blobs.get_array(id_) for id_ in ids]
        for i, back in enumerate(fetched):
            np.testing.assert_array_equal(back, arrays[i % 3])
            assert back.flags.writeable and back.flags.c_contiguous
        for earlier, later in zip(fetched, fetched[1:], strict=False):
            assert not np.shares_memory(earlier, later)
        fetched[0][...] = 0  # writing one result changes no other
        np.testing.assert_array_equal(fetched[3], arrays[0])
        assert raw == encode_array(arrays[0])


def test_oversized_blobs_are_refused_on_both_ends(node, blob_port, blobs):
    big = np.zeros((LIMIT_MB << 18) + 1, np.float32)  # 4 bytes over the node's limit
    before = stored_files(node)
    with pytest.raises(BlobError, match="exceeds"):
        blobs.put_array(big)  # refused by the client before sending
    unlimited = BlobClient(f"http://127.0.0.1:{blob_port}/blobs", 1 << 30)
    with pytest.raises(BlobError, match="413"):
        unlimited.put_array(big)  # refused by the node from Content-Length
    small = BlobClient(f"http://127.0.0.1:{blob_port}/blobs", 1000)
    id_ = unlimited.put_array(np.ones(400, np.float32))
    with pytest.raises(BlobError, match="exceeds the 1000-byte limit"):
        small.get(id_)  # the announced size is over this client's limit: nothing read
    ones = np.ones(3, np.int32)
    np.testing.assert_array_equal(small.get_array(unlimited.put_array(ones)), ones)
    unlimited.close()
    small.close()
    assert set(stored_files(node)) - set(before) == {id_.hex(), blake3.blake3(
        encode_array(ones)).hexdigest()}  # no temp files left


def test_forged_truncated_and_corrupt_blobs(node, blob_port, blobs):
    data = encode_array(np.arange(12, dtype=np.float32).reshape(3, 4))
    before = stored_files(node)
    conn = http.client.HTTPConnection("127.0.0.1", blob_port)

    def put(id_hex: str, body: bytes) -> tuple[int, bytes]:
        conn.request("PUT", f"/blobs/0x{id_hex}", body)
        response = conn.getresponse()
        return response.status, response.read()

    status, body = put(blake3.blake3(data + b"x").hexdigest(), data)
    assert status == 400 and b"BLAKE3 of the body" in body
    truncated = data[:-4]
    status, body = put(blake3.blake3(truncated).hexdigest(), truncated)
    assert status == 400 and b"needs 48" in body
    status, body = put(blake3.blake3(b"NOPE").hexdigest(), b"NOPE")
    assert status == 400 and b"shorter than" in body
    status, _ = put("12", data)
    assert status == 400
    assert stored_files(node) == before  # nothing stored, no temp file left

    with pytest.raises(BlobNotFound):
        blobs.get(b"\x07" * 32)
    id_ = blobs.put(data)
    (node.data_dir / "blobs" / id_.hex()).write_bytes(data[:-4] + b"\0\0\0\0")
    with pytest.raises(BlobError, match="different hash"):
        blobs.get(id_)
    ones = np.ones(2, np.int8)
    np.testing.assert_array_equal(blobs.get_array(blobs.put(encode_array(ones))), ones)
    # the same keep-alive connection still works after a refused blob


def test_batched_uploads_round_trip_and_match_single_puts(node, blobs):
    """put_arrays batches small arrays (several per POST, one group commit) and sends large
    ones alone; every id is the BLAKE3 of numpy's encoding and every array comes back."""
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((n, 7)).astype(np.float32) for n in range(1, 300)]
    arrays.insert(150, rng.standard_normal((600, 600)).astype(np.float32))  # 1.4 MB: alone
    arrays.append(np.zeros((0, 3), np.int16))
    arrays.append(arrays[0])  # a duplicate in the same batch is stored once
    ids = blobs.put_arrays(arrays)
    assert ids == [blake3.blake3(encode_array(a)).digest() for a in arrays]
    for id_, array in zip(ids, arrays, strict=True):
        np.testing.assert_array_equal(blobs.get_array(id_), array)
    assert not [f for f in stored_files(node) if f.startswith(".tmp")]


def test_an_array_given_twice_is_uploaded_once(blob_port):
    """A batch of products sharing one B names that array once per product: its bytes go to
    the store once (small ones batched, large ones alone), and every position gets its id."""
    client = BlobClient(f"http://127.0.0.1:{blob_port}/blobs", LIMIT_MB << 20)
    sent = []
    put_many, put_array = client.put_many, client.put_array
    client.put_many = lambda blobs: sent.extend(["small"] * len(blobs)) or put_many(blobs)
    client.put_array = lambda array: sent.append("large") or put_array(array)
    shared_small, shared_large = np.arange(12, dtype=np.float32), np.ones((600, 600), np.float32)
    arrays = [shared_small, np.zeros(3, np.int8), shared_large, shared_small, shared_large,
              shared_small.copy()]  # an equal copy is another object: sent again (harmless)
    assert client.put_arrays(arrays, threads=2) == [
        blake3.blake3(encode_array(a)).digest() for a in arrays]
    assert sorted(sent) == ["large", "small", "small", "small"]
    client.close()


def test_batch_with_forged_truncated_or_oversized_blobs(node, blob_port):
    """Each blob of a batch is checked against the id that follows it: a forged one is
    refused by index while the others are stored; a truncated or oversized batch stores
    nothing and leaves no temp file."""
    good = [encode_array(np.arange(k, dtype=np.int32)) for k in (5, 6)]
    forged = encode_array(np.arange(7, dtype=np.int32))

    def frame(blob: bytes, id_: bytes) -> bytes:
        return len(blob).to_bytes(8, "little") + blob + id_

    def post(body: bytes, length: int | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", blob_port)
        conn.putrequest("POST", "/blobs/")
        conn.putheader("Content-Length", str(len(body) if length is None else length))
        conn.endheaders()
        conn.send(body)
        response = conn.getresponse()
        result = response.status, json.loads(response.read())
        conn.close()
        return result

    before = stored_files(node)
    body = frame(good[0], blake3.blake3(good[0]).digest()) + \
        frame(forged, blake3.blake3(b"other").digest()) + \
        frame(good[1], blake3.blake3(good[1]).digest())
    status, reply = post(body)
    assert status == 400 and "blob 1 (0x" in reply["error"] and "BLAKE3" in reply["error"]
    assert reply["stored"] == ["0x" + blake3.blake3(g).hexdigest() for g in good]
    assert set(stored_files(node)) - set(before) == {blake3.blake3(g).hexdigest() for g in good}

    before = stored_files(node)
    status, reply = post(body[:-10])
    assert status == 400 and "ends inside blob 2" in reply["error"]
    status, reply = post((LIMIT_MB << 21).to_bytes(8, "little"))  # declares 8 MB
    assert status == 413 and "blob 0" in reply["error"]
    status, reply = post(b"", length=LIMIT_MB << 22)
    assert status == 413
    assert stored_files(node) == before  # nothing stored, no temp file left


def test_batched_uploads_reuse_their_connections(blob_port):
    """put_arrays runs its requests on the client's own pool: repeated calls reuse the same
    keep-alive connections instead of opening (and holding) new ones (2 upload threads, and
    the hash threads' connections for their HEADs; a pool per call would open 2 per call)."""
    client = BlobClient(f"http://127.0.0.1:{blob_port}/blobs", LIMIT_MB << 20)
    arrays = [np.full((600, 600), k, np.float32) for k in range(4)]  # 1.4 MB: one request each
    for round_ in range(8):
        shifted = [a + round_ for a in arrays]
        assert client.put_arrays(shifted, threads=2) == [
            blake3.blake3(encode_array(a)).digest() for a in shifted]
    assert len(client.connections._all) <= 2 + HASH_THREADS < 2 * 8
    client.close()


def test_a_download_cut_off_midway_is_network_trouble_worth_retrying():
    """A store that sends half a blob and closes (restarting, say): a BlobError that
    is_transient did not count, so a worker's held job gave up at once instead of retrying
    until its deadline."""
    import socket
    import threading

    from node.market import is_transient

    blob = encode_array(np.arange(1000, dtype=np.float32))
    server = socket.create_server(("127.0.0.1", 0))

    def answer_half() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(blob)
                         + blob[:len(blob) // 2])
    thread = threading.Thread(target=answer_half, daemon=True)
    thread.start()
    client = BlobClient(f"http://127.0.0.1:{server.getsockname()[1]}/blobs", 1 << 20)
    try:
        with pytest.raises(BlobCutOff, match="connection closed after") as cut:
            client.get(blake3.blake3(blob).digest())
    finally:
        client.close()
        server.close()
        thread.join(5)
    assert isinstance(cut.value, BlobError) and is_transient(cut.value)
