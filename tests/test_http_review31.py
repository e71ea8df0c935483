"""HTTP surfaces, from a review (session 31), against real servers on 127.0.0.1: a state
override's nonce of 2^64 or more is a bad parameter (it was an internal error), a blob
request head trickling in is answered 408 at the head timeout (it held its thread for as
long as bytes kept coming), and a method blobs do not take is 405 before the id is read."""
import json
import socket
import time

import httpx
import pytest
from helpers import BLOB_SERVERS, blob_node

import chain.blobserver as blobserver
from chain.blobs import BlobStore
from chain.blobserver import BlobServer

pytestmark = pytest.mark.timeout(120)


def _rpc(node, method: str, *params) -> dict:
    return httpx.post(node.url, json={"jsonrpc": "2.0", "id": 1, "method": method,
                                      "params": list(params)}, timeout=30).json()


@pytest.mark.parametrize("method", ["eth_call", "eth_estimateGas"])
def test_a_state_override_nonce_of_2_to_the_64_is_a_bad_parameter(node, method):
    target = "0x" + "00" * 19 + "01"
    call = {"from": "0x" + "11" * 20, "to": target}
    top = _rpc(node, method, call, "latest", {target: {"nonce": hex(2**64 - 1)}})
    assert "result" in top, top  # the largest nonce an account can hold
    over = _rpc(node, method, call, "latest", {target: {"nonce": hex(2**64)}})
    assert over["error"]["code"] == -32602, over
    assert "nonce must be below 2**64" in over["error"]["message"], over


def test_a_blob_head_trickling_in_is_answered_408_at_the_head_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(blobserver, "HEAD_TIMEOUT", 1.5)
    with BlobServer(BlobStore(tmp_path / "blobs", max_bytes=1 << 20)) as server, \
            socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        start = time.monotonic()
        answer = b""
        for byte in b"GET /blobs/0x" + b"00" * 32:  # never the blank line
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # closed after its answer
                break
            sock.settimeout(0.25)
            try:
                if answer := sock.recv(4096):
                    break
            except TimeoutError:
                continue
        sock.settimeout(10)
        answer += b"".join(iter(lambda: sock.recv(4096), b""))
        status = answer.split(b"\r\n", 1)[0]
        assert status == b"HTTP/1.1 408 Request Timeout", answer
        assert "not received in 1.5 s" in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert time.monotonic() - start < 10  # bounded by the head timeout, not the idle one


@pytest.mark.parametrize("served_by", BLOB_SERVERS)
def test_a_method_blobs_do_not_take_is_405_whatever_the_path(tmp_path, served_by):
    with blob_node(tmp_path / "data", served_by, 1) as proc:
        base = f"http://127.0.0.1:{proc.blob_port}/blobs/"
        for method, path in (("DELETE", ""), ("DELETE", "12"), ("PATCH", "0x" + "00" * 32)):
            response = httpx.request(method, base + path, timeout=30)
            assert response.status_code == 405, (method, path, response.text)
            assert response.headers["allow"] == "GET, HEAD, PUT"
        assert httpx.get(base + "12", timeout=30).status_code == 400  # a GET's id is read
