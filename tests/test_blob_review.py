"""The blob store's and the worker API's HTTP surfaces probed as a hostile or careless client
would, against real servers on 127.0.0.1: a node process (its blob listener and `/blobs` on
its main port), and in-process uvicorn / `BlobServer` instances where a test needs a short
timeout. Corrupt headers (magic, dtype, dims numpy cannot hold, reserved bytes), malformed ids
and paths, wrong methods, missing or odd Content-Length, bodies over the limit refused before
they are read, duplicate and concurrent uploads, stalled uploads dropped after a bounded time,
blobs that survive a restart and a kill; then the admin token, the Prometheus exposition and
the dashboard (self-contained, wei amounts exact)."""
import http.client
import json
import os
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from urllib.parse import urlsplit

import blake3
import httpx
import numpy as np
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

import chain.blobserver
from chain.blobhttp import BlobApp
from chain.blobs import BlobStore, decode_array, encode_array
from chain.blobserver import BlobServer
from chain.launch import NodeProcess
from node.api import create_app
from node.metrics import NodeMetrics

pytestmark = pytest.mark.timeout(60)
LIMIT_MB = 4
LIMIT = LIMIT_MB << 20
PORTS = ("listener", "main port")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chain")
    with NodeProcess(directory / "data", block_time=0,
                     extra_args=("--max-blob-mb", str(LIMIT_MB))) as proc:
        proc.listener = urlsplit(httpx.get(f"{proc.url}/info").json()["blob_url"]).port
        yield proc


@pytest.fixture(params=PORTS)
def port(node, request) -> int:
    return node.listener if request.param == "listener" else node.port


def files(directory) -> list[str]:
    return sorted(os.listdir(directory))


def settled_files(directory, expected: list[str]) -> list[str]:
    """The directory's files once they are `expected` or after 10 s: an aborted upload's temp
    file goes when its write threads are done with it."""
    deadline = time.monotonic() + 10
    while files(directory) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return files(directory)


def read_response(reader, head: bool = False) -> tuple[int, dict[str, str], bytes]:
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    length = 0 if head else int(headers.get("content-length", 0))
    return status, headers, reader.read(length)


def exchange(port: int, raw: bytes, head: bool = False) -> tuple[int, dict, bytes]:
    """One raw request on a fresh connection: (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(raw)
        return read_response(sock.makefile("rb"), head)


def refused_and_closed(port: int, raw: bytes) -> tuple[int, bytes]:
    """(status, body) of one raw request that the server must answer and then close the
    connection on (TimeoutError after 5 s if it keeps it open)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(raw)
        reader = sock.makefile("rb")
        status, _, body = read_response(reader)
        assert reader.read(1) == b"", "connection kept open"
        return status, body


def put(port: int, id_hex: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("PUT", f"/blobs/0x{id_hex}", body)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def header(code: int, dims: tuple[int, ...], reserved: bytes = b"\0\0",
           magic: bytes = b"NNB1") -> bytes:
    return magic + bytes([code, len(dims)]) + reserved + struct.pack(f"<{len(dims)}Q", *dims)


# -- the blob servers -----------------------------------------------------------------------

@pytest.mark.parametrize("body, message", [
    (header(0, (1,), magic=b"NNB2") + bytes(4), "bad blob magic"),
    (header(9, (1,)) + bytes(4), "unknown blob dtype code 9"),
    (b"NNB1\x00\x09\x00\x00" + bytes(72), "9 dims"),
    (header(0, (2,)) + bytes(4), "blob data is 4 bytes but shape (2,)"),
    (header(0, (0, 2**64 - 3)), "too large for an array"),  # -3 as a u64, empty data
    (header(1, (0, 2**40, 2**40)), "too large for an array"),
    (header(0, (1,), reserved=b"\xff\x00") + bytes(4), "bytes 6-7 must be zero"),
    (b"NNB1\x00\x02\x00\x00" + bytes(8), "truncated inside its dims"),
    (b"", "shorter than the 8-byte header"),
], ids=["magic", "dtype", "ndim", "shape", "negative-dim", "huge-dims", "reserved", "dims",
        "empty"])
def test_corrupt_blobs_are_refused_and_leave_nothing(node, port, body, message):
    """Each blob hashes to its id, so only its format can refuse it: 400 naming the fault,
    nothing stored. Before, shapes numpy cannot hold (a zero dim beside a huge one) and
    non-zero reserved header bytes were stored: blobs no reader could decode."""
    directory = node.data_dir / "blobs"
    before = files(directory)
    status, reply = put(port, blake3.blake3(body).hexdigest(), body)
    assert status == 400 and message in reply["error"], reply
    assert settled_files(directory, before) == before
    if "bytes 6-7" not in message:  # checked on upload only: stored blobs decode as before
        with pytest.raises(ValueError, match=re.escape(message)):
            decode_array(body)


def test_an_empty_array_with_other_dims_is_still_a_blob(port):
    array = np.zeros((0, 1 << 20, 3), np.int16)
    blob = encode_array(array)
    assert put(port, blake3.blake3(blob).hexdigest(), blob)[0] == 200
    assert decode_array(blob).shape == array.shape


def test_ids_paths_and_methods(node, port):
    """Malformed ids are 400, a nested or dotted path is no route (404; before it served the
    blob under another URL, and `%20` inside an id was skipped by bytes.fromhex), unknown ids
    404, a wrong method 405 with its Allow header, a Range header is ignored (the whole
    blob, 200)."""
    blob = encode_array(np.arange(7, dtype=np.int32))
    id_hex = blake3.blake3(blob).hexdigest()
    assert put(port, id_hex, blob)[0] == 200
    for path, expected, message in (
            ("/blobs/0x12", (400,), "must be 32 bytes"),
            ("/blobs/0xzz", (400,), "is not hex"),
            (f"/blobs/0x{id_hex[:10]}%20{id_hex[10:]}", (400,), "is not hex"),
            (f"/blobs/x/0x{id_hex}", (404,), "no route"),
            (f"/blobs/../0x{id_hex}", (404,), "no route"),
            (f"/blobs/..%2f0x{id_hex}", (400, 404), ""),  # the listener does not %-decode
            ("/blobs/0x" + "07" * 32, (404,), "not found")):
        status, _, body = exchange(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert status in expected and message in json.loads(body)["error"], (path, body)
    status, headers, body = exchange(port, f"HEAD /blobs/0x{'07' * 32} HTTP/1.1\r\n\r\n"
                                        .encode(), head=True)
    assert status == 404 and body == b"" and int(headers["content-length"]) > 0
    for method in ("DELETE", "PATCH", "POST"):
        status, headers, body = exchange(port, f"{method} /blobs/0x{id_hex} HTTP/1.1\r\n"
                                            "Content-Length: 0\r\n\r\n".encode())
        assert status == 405 and headers["allow"] == "GET, HEAD, PUT", (method, headers)
        assert method in json.loads(body)["error"]
    status, _, body = exchange(port, f"GET /blobs/0x{id_hex} HTTP/1.1\r\nRange: bytes=0-3"
                                  "\r\n\r\n".encode())
    assert (status, body) == (200, blob)
    assert (node.data_dir / "blobs" / id_hex).read_bytes() == blob


def test_uploads_without_a_usable_length(node, port):
    """No Content-Length (and no chunked body) is 411 and the connection closed: before, the
    body was taken as empty (refused as a 0-byte blob, or a batch of none acknowledged) and
    the bytes sent after parsed as the next request. A Content-Length that is not plain
    digits, or two that differ, is 400 and closed (the listener took `+25` and `2_5` as 25)."""
    blob = encode_array(np.arange(9, dtype=np.int8))
    id_hex = blake3.blake3(blob).hexdigest()
    directory = node.data_dir / "blobs"
    before = files(directory)
    for request in (f"PUT /blobs/0x{id_hex}", "POST /blobs/"):
        status, body = refused_and_closed(port, f"{request} HTTP/1.1\r\nHost: x\r\n\r\n"
                                          .encode())
        assert status == 411 and "Content-Length" in json.loads(body)["error"]
    for lengths in ([f"+{len(blob)}"], [f"{len(blob) // 10}_{len(blob) % 10}"],
                    ["4", str(len(blob))]):
        fields = "".join(f"Content-Length: {n}\r\n" for n in lengths)
        status, _ = refused_and_closed(port, f"PUT /blobs/0x{id_hex} HTTP/1.1\r\nHost: x\r\n"
                                       f"{fields}\r\n".encode())
        assert status == 400, lengths
    assert settled_files(directory, before) == before


def test_bodies_over_the_limit_are_refused_before_they_are_read(node, port):
    """A declared size over the limit is answered 413 from the headers alone (no body byte
    sent here, and no `100 Continue` for a client that waits for one); nothing is written."""
    directory = node.data_dir / "blobs"
    before = files(directory)
    for request, declared in ((f"PUT /blobs/0x{'00' * 32}", LIMIT + 1),
                              ("POST /blobs/", LIMIT + (1 << 20))):
        for expect in ("", "Expect: 100-continue\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(f"{request} HTTP/1.1\r\nHost: x\r\n{expect}Content-Length: "
                             f"{declared}\r\n\r\n".encode())
                status, _, body = read_response(sock.makefile("rb"))
                assert status == 413 and "exceeds the" in json.loads(body)["error"]
    assert files(directory) == before


def test_a_chunked_body_over_the_limit_closes_the_connection(node):
    """The main port takes chunked bodies: one over the limit is refused once the limit is
    passed (the writer's temp file removed) and the connection closed, since uvicorn would
    otherwise read and drop a body that may never end. The listener refuses chunked bodies
    outright."""
    directory = node.data_dir / "blobs"
    before = files(directory)
    piece = 256 << 10
    with socket.create_connection(("127.0.0.1", node.port), timeout=5) as sock:
        sock.sendall(f"PUT /blobs/0x{'00' * 32} HTTP/1.1\r\nHost: x\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        for _ in range(LIMIT // piece):
            sock.sendall(b"%x\r\n" % piece + bytes(piece) + b"\r\n")
        sock.sendall(b"1\r\n\0\r\n")  # one byte over, and the body not ended
        reader = sock.makefile("rb")
        status, headers, body = read_response(reader)
        assert status == 413 and "exceeds the" in json.loads(body)["error"]
        assert headers["connection"] == "close" and reader.read(1) == b""
    assert settled_files(directory, before) == before
    status, body = refused_and_closed(node.listener, b"PUT /blobs/0x" + b"00" * 32 +
                                      b" HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert status == 400 and b"chunked" in body


def test_duplicate_and_concurrent_uploads(node, port):
    """The same blob uploaded 8 times at once and again after, beside 8 others: every upload
    acknowledged with its id, one file per blob, no temp file left."""
    rng = np.random.default_rng(port)
    same = encode_array(rng.standard_normal(40_000).astype(np.float32))
    others = [encode_array(rng.standard_normal(30_000 + i).astype(np.float32))
              for i in range(8)]
    blobs = [same] * 8 + others
    with futures.ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda b: put(port, blake3.blake3(b).hexdigest(), b), blobs))
    assert replies == [(200, {"id": "0x" + blake3.blake3(b).hexdigest(), "size": len(b)})
                       for b in blobs]
    assert put(port, blake3.blake3(same).hexdigest(), same)[0] == 200
    directory = node.data_dir / "blobs"
    stored = [f for f in files(directory) if not f.startswith(".tmp")]
    assert settled_files(directory, stored) == stored
    for blob in blobs:
        assert (directory / blake3.blake3(blob).hexdigest()).read_bytes() == blob


@contextmanager
def asgi_server(app, host: str = "127.0.0.1", **options) -> Iterator[int]:
    """`app` served by uvicorn on a thread, on a free port of `host` (yielded); `options`
    for uvicorn.Config (its protocol, say)."""
    sock = socket.create_server((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, **{"log_level": "warning", **options}))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def stall_and_check(port: int, directory, reply_expected: bool) -> None:
    """A PUT and a POST that stop mid-body: another upload goes through meanwhile, then each
    stalled one is dropped (408 and closed, or closed) within 5 s, its temp file removed."""
    blob = encode_array(np.arange(300_000, dtype=np.float32))  # 1.2 MB: a pipelined writer
    framed = len(blob).to_bytes(8, "little") + blob + blake3.blake3(blob).digest()
    stalled = []
    for request, body in ((f"PUT /blobs/0x{blake3.blake3(blob).hexdigest()}", blob),
                          ("POST /blobs/", framed)):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(f"{request} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body[:len(body) // 2])
        stalled.append(sock)
    other = encode_array(np.arange(5, dtype=np.int64))
    assert put(port, blake3.blake3(other).hexdigest(), other)[0] == 200  # not wedged
    started = time.monotonic()
    for sock in stalled:
        with sock:
            reader = sock.makefile("rb")
            if reply_expected:
                status, headers, body = read_response(reader)
                assert status == 408 and "no body bytes" in json.loads(body)["error"]
                assert headers["connection"] == "close"
            assert reader.read(1) == b""
    assert time.monotonic() - started < 5
    assert settled_files(directory, [blake3.blake3(other).hexdigest()]) == [
        blake3.blake3(other).hexdigest()]


def test_a_stalled_upload_on_the_main_port_is_dropped(tmp_path):
    """uvicorn bounds no request body in time; BlobApp waits `body_timeout` for each piece
    (before, a client that stopped sending without closing held its temp file and connection
    for good)."""
    store = BlobStore(tmp_path / "blobs", max_bytes=LIMIT)
    with asgi_server(BlobApp(store, body_timeout=1.0)) as port:
        stall_and_check(port, store.directory, reply_expected=True)


def test_a_stalled_upload_on_the_listener_is_dropped(tmp_path, monkeypatch):
    monkeypatch.setattr(chain.blobserver, "IDLE_TIMEOUT", 1.0)
    store = BlobStore(tmp_path / "blobs", max_bytes=LIMIT)
    with BlobServer(store) as server:
        stall_and_check(server.port, store.directory, reply_expected=False)


def blob_port(proc: NodeProcess) -> int:
    """The blob listener's port as the node advertises it now: port + 1 by default, but any
    free port where a client socket happened to hold that one, so a restart may move it."""
    return urlsplit(httpx.get(f"{proc.url}/info").json()["blob_url"]).port


def test_blobs_survive_a_restart_and_a_kill_mid_upload(tmp_path):
    """Acknowledged blobs (by either server, single and batched) come back bit for bit after
    a stop and after a SIGKILL; an upload cut by the kill is no blob afterwards, and its
    temp file is gone once the node is back."""
    rng = np.random.default_rng(21)
    blobs = [encode_array(rng.standard_normal(n).astype(np.float32)) for n in (100, 300_000)]
    batch = [encode_array(np.arange(k, dtype=np.int16)) for k in (3, 4)]
    cut = encode_array(rng.standard_normal(3 << 18).astype(np.float32))
    proc = NodeProcess(tmp_path / "data", block_time=0,
                       extra_args=("--max-blob-mb", str(LIMIT_MB))).start()
    try:
        listener = blob_port(proc)
        for blob, port in zip(blobs, (listener, proc.port), strict=True):
            assert put(port, blake3.blake3(blob).hexdigest(), blob)[0] == 200
        body = b"".join(len(b).to_bytes(8, "little") + b + blake3.blake3(b).digest()
                        for b in batch)
        assert httpx.post(f"{proc.url}/blobs/", content=body).json()["ids"] == [
            "0x" + blake3.blake3(b).hexdigest() for b in batch]
        proc.stop()
        with socket.socket() as squatter:  # the default port taken: the listener moves
            squatter.bind(("127.0.0.1", proc.port + 1))
            proc.start()
        assert blob_port(proc) != proc.port + 1
        with socket.create_connection(("127.0.0.1", blob_port(proc)), timeout=5) as sock:
            sock.sendall(f"PUT /blobs/0x{blake3.blake3(cut).hexdigest()} HTTP/1.1\r\n"
                         f"Content-Length: {len(cut)}\r\n\r\n".encode() + cut[:2 << 20])
            deadline = time.monotonic() + 10
            while not any(f.startswith(".tmp") for f in files(proc.data_dir / "blobs")) and \
                    time.monotonic() < deadline:
                time.sleep(0.01)
            assert any(f.startswith(".tmp") for f in files(proc.data_dir / "blobs"))
            proc.proc.send_signal(signal.SIGKILL)
            proc.proc.wait(10)
        proc.start()
        assert not any(f.startswith(".tmp") for f in files(proc.data_dir / "blobs"))
        for blob in blobs + batch:
            path = f"/blobs/0x{blake3.blake3(blob).hexdigest()}"
            for port in (blob_port(proc), proc.port):
                status, _, got = exchange(port, f"GET {path} HTTP/1.1\r\n\r\n".encode())
                assert (status, got) == (200, blob)
        status, _, _ = exchange(proc.port, f"HEAD /blobs/0x{blake3.blake3(cut).hexdigest()}"
                                   " HTTP/1.1\r\n\r\n".encode(), head=True)
        assert status == 404
        assert blake3.blake3(cut).hexdigest() not in files(proc.data_dir / "blobs")
    finally:
        proc.stop()


# -- the worker API -------------------------------------------------------------------------

BIG_WEI = 12345678901234567891  # past 2^53: a double would print 12345678901234567000


class FakeNode:
    """What the API reads from a worker (node.api.NodeView), with real metrics."""

    def __init__(self) -> None:
        self.metrics = NodeMetrics()
        self.stopped = False

    def status(self) -> dict:
        return {"address": "0x" + "ab" * 20, "device": "cpu", "in_flight": 0, "completed": 1,
                "failed": 0, "earned_wei": BIG_WEI, "stake_wei": 10**18 + 1}

    def job_list(self) -> list[dict]:
        return [{"job_id": 3, "batch": 1, "m": 2, "k": 3, "n": 4, "stage": "verified",
                 "fee_wei": BIG_WEI, "seconds": None}]

    def recent_blocks(self, count: int) -> list[dict]:
        return [{"number": 5, "hash": "0x" + "cd" * 32, "transactions": 1,
                 "timestamp": 1_700_000_000}]

    def request_stop(self) -> None:
        self.stopped = True

    def request_withdraw(self) -> dict:
        return {"requested": True}


def test_admin_token(monkeypatch):
    """Missing, wrong, prefixed or suffixed tokens are 403; the right one passes with the
    scheme in any case (before, `bearer` was refused as a wrong token); every comparison is
    secrets.compare_digest (constant time); without a token the routes are off, and say so."""
    compared = []

    def compare(a, b):
        compared.append((a, b))
        return real(a, b)

    real = secrets.compare_digest
    monkeypatch.setattr(secrets, "compare_digest", compare)
    node = FakeNode()
    with asgi_server(create_app(node, "s3cret-token")) as port:
        url = f"http://127.0.0.1:{port}/admin/stop"
        for value in (None, "", "Bearer", "Bearer wrong", "Bearer s3cret-toke",
                      "Bearer s3cret-token2", "Basic s3cret-token", "s3cret-token"):
            headers = {} if value is None else {"Authorization": value}
            response = httpx.post(url, headers=headers)
            assert response.status_code == 403 and "missing or wrong" in response.text, value
        assert not node.stopped
        assert httpx.get(url).status_code == 405
        for scheme in ("Bearer", "bearer", "BEARER"):
            response = httpx.post(url, headers={"Authorization": f"{scheme} s3cret-token"})
            assert response.json() == {"stopping": True}
        assert node.stopped and (b"s3cret-token", b"s3cret-token") in compared
        assert all(b == b"s3cret-token" for _, b in compared)
    with asgi_server(create_app(FakeNode(), None)) as port:
        response = httpx.post(f"http://127.0.0.1:{port}/admin/withdraw",
                              headers={"Authorization": "Bearer None"})
        assert response.status_code == 403 and "no admin token" in response.text


def test_metrics_are_valid_prometheus_text():
    """Every family has HELP and TYPE, every sample a number (no NaN), label values with
    quotes, backslashes and newlines escaped so that they parse back exactly."""
    node = FakeNode()
    node.metrics.jobs.labels("verified").inc(3)
    node.metrics.jobs.labels('we"ird\\ label\n').inc()
    node.metrics.stage_latency.labels("fetch").observe(0.2)
    node.metrics.earned.inc(BIG_WEI)
    with asgi_server(create_app(node, None)) as port:
        response = httpx.get(f"http://127.0.0.1:{port}/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {"needle_jobs", "needle_stage_seconds", "needle_earned_wei", "needle_stake_wei",
            "needle_jobs_in_flight", "needle_chain_errors", "needle_flops"} <= set(families)
    typed = re.findall(r"^# TYPE (\S+) ", text, re.M)
    assert typed == re.findall(r"^# HELP (\S+) ", text, re.M) and typed
    for line in text.splitlines():
        if line and not line.startswith("#"):
            value = float(line.rsplit(" ", 1)[1])
            assert value == value, line  # not NaN
    outcomes = {s.labels["outcome"]: s.value for s in families["needle_jobs"].samples
                if s.name == "needle_jobs_total"}
    assert outcomes == {"verified": 3.0, 'we"ird\\ label\n': 1.0}
    assert families["needle_earned_wei"].samples[0].value == float(BIG_WEI)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install -y chromium)")
def test_dashboard_is_self_contained_and_shows_exact_wei(tmp_path):
    """The page fetches nothing but its own API (no favicon, no external resource: a
    Content-Security-Policy says so) and shows wei amounts past 2^53 digit for digit (before,
    JSON.parse rounded them to doubles)."""
    from websockets.sync.client import connect

    with asgi_server(create_app(FakeNode(), None)) as port:
        html = httpx.get(f"http://127.0.0.1:{port}/").text
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|@import|url\(""", html)
        assert "Content-Security-Policy" in html
        process = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
             "--remote-debugging-port=0", f"--user-data-dir={tmp_path}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            port_file = tmp_path / "DevToolsActivePort"
            deadline = time.monotonic() + 20
            while not (port_file.exists() and port_file.read_text().strip()):
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.05)
            debug = int(port_file.read_text().split()[0])
            target = next(t for t in httpx.get(f"http://127.0.0.1:{debug}/json/list").json()
                          if t["type"] == "page")
            with connect(target["webSocketDebuggerUrl"], max_size=None) as ws:
                requested, ids = [], iter(range(1, 1000))

                def call(method: str, **params):
                    id_ = next(ids)
                    ws.send(json.dumps({"id": id_, "method": method, "params": params}))
                    while True:
                        message = json.loads(ws.recv(timeout=10))
                        if message.get("method") == "Network.requestWillBeSent":
                            requested.append(message["params"]["request"]["url"])
                        if message.get("id") == id_:
                            return message["result"]

                call("Network.enable")
                call("Page.navigate", url=f"http://127.0.0.1:{port}/")
                shown = {}
                deadline = time.monotonic() + 15
                while shown.get("earned") != str(BIG_WEI) and time.monotonic() < deadline:
                    time.sleep(0.1)
                    shown = json.loads(call("Runtime.evaluate", returnByValue=True, expression=(
                        "JSON.stringify({earned: document.getElementById('earned').textContent,"
                        " stake: document.getElementById('stake').textContent, fee: document."
                        "querySelector('#jobs tbody tr')?.cells[3].textContent})"))["result"]
                        ["value"])
        finally:
            process.terminate()
            process.wait(10)
    assert shown == {"earned": str(BIG_WEI), "stake": str(10**18 + 1), "fee": str(BIG_WEI)}
    assert requested and all(url.startswith(f"http://127.0.0.1:{port}/") or
                             url.startswith("data:") for url in requested), requested
    assert not [url for url in requested if url.endswith("/favicon.ico")]
