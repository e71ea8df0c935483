"""The blob transfer path (`chain/blobhttp.py`) against a real node process: arrays of every
blob dtype and layout round-trip bit for bit (numpy is the reference), and oversized,
forged, truncated or corrupt blobs are refused with a clear error and leave nothing behind."""
import hashlib
import http.client

import numpy as np
import pytest

from chain.blobhttp import BlobClient, BlobError, BlobNotFound
from chain.blobs import encode_array
from chain.launch import NodeProcess

pytestmark = pytest.mark.timeout(60)
LIMIT_MB = 4


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    data = tmp_path_factory.mktemp("chain") / "data"
    with NodeProcess(data, block_time=0, extra_args=("--max-blob-mb", str(LIMIT_MB))) as proc:
        yield proc


@pytest.fixture(scope="module")
def blobs(node):
    client = BlobClient(f"{node.url}/blobs", LIMIT_MB << 20)
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
    assert id_ == hashlib.sha256(encode_array(array)).digest()  # the id names the bytes
    back = blobs.get_array(id_)
    assert back.dtype == array.dtype.newbyteorder("<") and back.shape == array.shape
    np.testing.assert_array_equal(back, array)
    assert blobs.has(id_) and blobs.put_array(array) == id_  # again: idempotent


def test_oversized_blobs_are_refused_on_both_ends(node, blobs):
    big = np.zeros((LIMIT_MB << 18) + 1, np.float32)  # 4 bytes over the node's limit
    before = stored_files(node)
    with pytest.raises(BlobError, match="exceeds"):
        blobs.put_array(big)  # refused by the client before sending
    unlimited = BlobClient(f"{node.url}/blobs", 1 << 30)
    with pytest.raises(BlobError, match="413"):
        unlimited.put_array(big)  # refused by the node from Content-Length
    small = BlobClient(f"{node.url}/blobs", 1000)
    id_ = unlimited.put_array(np.ones(400, np.float32))
    with pytest.raises(BlobError, match="exceeds the 1000-byte limit"):
        small.get(id_)  # the announced size is over this client's limit: nothing read
    ones = np.ones(3, np.int32)
    np.testing.assert_array_equal(small.get_array(unlimited.put_array(ones)), ones)
    unlimited.close()
    small.close()
    assert set(stored_files(node)) - set(before) == {id_.hex(), hashlib.sha256(
        encode_array(ones)).hexdigest()}  # no temp files left


def test_forged_truncated_and_corrupt_blobs(node, blobs):
    data = encode_array(np.arange(12, dtype=np.float32).reshape(3, 4))
    before = stored_files(node)
    conn = http.client.HTTPConnection("127.0.0.1", node.port)

    def put(id_hex: str, body: bytes) -> tuple[int, bytes]:
        conn.request("PUT", f"/blobs/0x{id_hex}", body)
        response = conn.getresponse()
        return response.status, response.read()

    status, body = put(hashlib.sha256(data + b"x").hexdigest(), data)
    assert status == 400 and b"sha256 of the body" in body
    truncated = data[:-4]
    status, body = put(hashlib.sha256(truncated).hexdigest(), truncated)
    assert status == 400 and b"needs 48" in body
    status, body = put(hashlib.sha256(b"NOPE").hexdigest(), b"NOPE")
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
