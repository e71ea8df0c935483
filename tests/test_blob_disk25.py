"""The blob store on a filling disk, `chain info`'s node URL option, and the wording of a
transaction refused for too little gas, against real servers on 127.0.0.1.

A chain node's blob store shares the data dir's disk with the chain's database: anyone who
reaches the node can upload blobs, and a disk filled with them stopped the database
committing blocks. An upload that would leave less than the store's free-space reserve must
be refused 507 by both blob servers (the listener, `chain/blobserver.py`, and `BlobApp` on
the main port), before its body is read when its length is declared and as it arrives when
not, naming the reserve and leaving nothing on disk. The disk is not filled here: the reserve
is set with a wide margin above or below the file system's free space, measured just before
each upload."""
import http.client
import json
import os
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from eth_account import Account
from typer.testing import CliRunner

from chain.admission import TxRejected, decode_transaction
from chain.blobhttp import BlobApp, BlobClient, BlobError
from chain.blobs import BlobStore, BlobStoreFull, encode_array, free_bytes
from chain.blobserver import BlobServer
from chain.cli import app as chain_app
from chain.launch import NodeProcess
from chain.params import CHAIN_ID

pytestmark = pytest.mark.timeout(120)
MARGIN = 256 << 20  # between the reserve and the free space: far above the disk's drift
DECLARED = 10 * MARGIN // 4  # a body declared (never sent) that would cross the reserve
SERVERS = ("listener", "main port")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(store, {server: port}) of one store served by both blob servers in this process."""
    import uvicorn

    store = BlobStore(tmp_path_factory.mktemp("disk") / "blobs", max_bytes=DECLARED + (1 << 20),
                      reserve_bytes=0)
    listener = BlobServer(store).start()
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(BlobApp(store), log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield store, {"listener": listener.port, "main port": sock.getsockname()[1]}
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()


def files(store: BlobStore) -> set[str]:
    """The store's files once no temp file is left (an aborted upload's goes once its write
    threads are done), or after 10 s."""
    deadline = time.monotonic() + 10
    while any(n.startswith(".tmp-") for n in os.listdir(store.directory)) and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    return set(os.listdir(store.directory))


def operands(seed: int) -> list[np.ndarray]:
    """A blob sent by PUT, one streamed by POST (3 MiB), and two for a batch."""
    rng = np.random.default_rng(seed)
    return [rng.integers(-99, 99, 50_000, dtype=np.int8),
            rng.integers(-99, 99, 3 << 18, dtype=np.int32),
            rng.integers(-99, 99, 1000, dtype=np.int16),
            rng.integers(-99, 99, 2000, dtype=np.int16)]


def upload(client: BlobClient, arrays: list[np.ndarray]) -> list[bytes]:
    return [client.put_array(arrays[0]), client.put_array(arrays[1]),
            *client.put_many([[encode_array(a)] for a in arrays[2:]])]


@pytest.mark.parametrize("server", SERVERS)
def test_uploads_past_the_free_space_reserve_are_refused_507(served, server):
    """With the reserve above the free space, a PUT, a streamed POST and a batch are each
    refused 507 naming the reserve, and nothing of them is left on disk; with it below, the
    same client stores them all (the connection still serves). Before, nothing bounded the
    store: the uploads filled the disk the chain's database needs."""
    store, ports = served
    arrays = operands(len(server))
    client = BlobClient(f"http://127.0.0.1:{ports[server]}/blobs", store.max_bytes, timeout=30)
    try:
        before = files(store)
        store.reserve_bytes = free_bytes(store.directory) + MARGIN
        refusals = [lambda: client.put_array(arrays[0]), lambda: client.put_array(arrays[1]),
                    lambda: client.put_many([[encode_array(a)] for a in arrays[2:]])]
        for refused in refusals:
            with pytest.raises(BlobError, match="507 .*free-space reserve reached.*"
                                                "chain up --blob-reserve-mb"):
                refused()
        assert files(store) == before
        store.reserve_bytes = free_bytes(store.directory) - MARGIN
        ids = upload(client, arrays)
        for id_, array in zip(ids, arrays, strict=True):
            np.testing.assert_array_equal(client.get_array(id_), array)
    finally:
        store.reserve_bytes = 0
        client.close()
    assert files(store) == before | {id_.hex() for id_ in ids}


def raw_reply(port: int, head: bytes) -> tuple[int, dict]:
    """Send a request's line and headers only (`Expect: 100-continue`: the body waits for
    the server's go-ahead) and read the reply: its status and JSON body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        reply = b""
        while b"\r\n\r\n" not in reply:
            more = sock.recv(65536)
            assert more, f"connection closed without a reply: {reply!r}"
            reply += more
        headers, _, body = reply.partition(b"\r\n\r\n")
        status = int(headers.split(b" ", 2)[1])
        length = next(int(line.split(b":")[1]) for line in headers.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += sock.recv(65536)
        return status, json.loads(body)


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("method", ["PUT", "POST"])
def test_a_declared_body_that_would_cross_the_reserve_is_refused_before_it_is_sent(
        served, server, method):
    """The free space is above the reserve, but not by the declared body's length: the
    upload is refused 507 at once, before any body byte is sent (the client waits for `100
    Continue`), no temp file made. Before, the body was taken whatever the disk held."""
    store, ports = served
    path = "/blobs/0x" + "11" * 32 if method == "PUT" else "/blobs/"
    head = (f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {DECLARED}\r\n"
            "expect: 100-continue\r\n\r\n").encode()
    before = files(store)
    store.reserve_bytes = free_bytes(store.directory) - DECLARED + MARGIN
    try:
        status, body = raw_reply(ports[server], head)
    finally:
        store.reserve_bytes = 0
    assert status == 507, body
    assert "free-space reserve reached" in body["error"], body
    assert files(store) == before


def test_a_chunked_upload_is_refused_as_it_arrives(served):
    """An upload without a declared length (chunked, only the main port takes one) is
    checked as its bytes arrive: refused 507 naming the reserve, no temp file left."""
    store, ports = served
    before = files(store)
    store.reserve_bytes = free_bytes(store.directory) + MARGIN
    blob = encode_array(np.arange(1000, dtype=np.int32))
    sock = socket.create_connection(("127.0.0.1", ports["main port"]), timeout=30)
    try:  # the first chunk only, then the answer: the rest, sent after the refusal, could
        # meet a closed connection (a broken pipe under load)
        sock.sendall(f"PUT /blobs/0x{'22' * 32} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode()
                     + b"%x\r\n" % 100 + blob[:100] + b"\r\n")
        response = http.client.HTTPResponse(sock)
        response.begin()
        body = json.loads(response.read())
    finally:
        store.reserve_bytes = 0
        sock.close()
    assert response.status == 507, body
    assert "free-space reserve reached" in body["error"]
    assert files(store) == before


def test_a_body_of_undeclared_length_is_refused_once_it_reaches_the_reserve(tmp_path):
    """Bytes of an upload whose length was not declared are checked as they come: the first
    are written, the one that reaches the reserve is refused, and the temp file goes."""
    store = BlobStore(tmp_path, max_bytes=8 * MARGIN)
    writer = store.writer()
    chunk = bytes(1 << 20)
    store.reserve_bytes = free_bytes(tmp_path) - MARGIN // 8
    with pytest.raises(BlobStoreFull, match=r"reserve reached: [1-9]\d* more bytes"):
        for _ in range(MARGIN // len(chunk)):
            writer.write(chunk)
    assert writer.size > len(chunk)
    assert files(store) == set()


def test_uploads_in_progress_count_against_the_reserve(tmp_path):
    """Concurrent uploads cannot all pass against the same free space: the bytes an upload
    in progress declared are claimed until it ends (stored or dropped). Two bodies of
    DECLARED bytes with room for one and a half: the second is refused while the first is
    open, taken once it is dropped."""
    store = BlobStore(tmp_path, max_bytes=DECLARED)
    store.reserve_bytes = free_bytes(tmp_path) - DECLARED - DECLARED // 2
    first = store.writer(DECLARED)
    with pytest.raises(BlobStoreFull, match="free-space reserve reached"):
        store.writer(DECLARED)
    first.abort()
    store.writer(DECLARED).abort()
    assert os.listdir(tmp_path) == [] and store.claimed == 0


def test_chain_up_sets_the_reserve_of_both_blob_servers(tmp_path):
    """`chain up --blob-reserve-mb`: a reserve larger than any disk refuses every upload, on
    the listener /info advertises and on the main port."""
    with NodeProcess(tmp_path / "chain", block_time=0,
                     extra_args=("--blob-reserve-mb", str(1 << 40))) as node:
        listener = httpx.get(f"{node.url}/info").json()["blob_url"]
        for url in (listener, f"{node.url}/blobs"):
            client = BlobClient(url, 1 << 20, timeout=30)
            try:
                with pytest.raises(BlobError, match="507 .*free-space reserve reached"):
                    client.put_array(np.ones(10, np.int8))
            finally:
                client.close()


def test_chain_info_takes_the_rpc_url_as_every_command_does(tmp_path):
    """`chain info` reads `--rpc-url` and $NEEDLE_NET_RPC as the other commands do (it took
    only `--url` and ignored the variable, so it asked 127.0.0.1:8545); `--url` still works."""
    runner = CliRunner()
    with NodeProcess(tmp_path / "chain", block_time=0) as node:
        for args, env in ((["--rpc-url", node.url], {}), ([], {"NEEDLE_NET_RPC": node.url}),
                          (["--url", node.url], {})):
            result = runner.invoke(chain_app, ["info", *args], env=env)
            assert result.exit_code == 0, (args, env, result.output)
            assert json.loads(result.output)["chain_id"] == CHAIN_ID


def signed(tx_type: int, gas: int) -> bytes:
    tx = {"to": "0x" + "33" * 20, "value": 1, "gas": gas, "nonce": 0, "chainId": CHAIN_ID}
    if tx_type == 2:
        tx |= {"maxFeePerGas": 10**10, "maxPriorityFeePerGas": 1}
    else:
        tx |= {"gasPrice": 10**10} | ({"accessList": []} if tx_type == 1 else {})
    return Account.sign_transaction(tx, Account.create().key).raw_transaction


@pytest.mark.parametrize("tx_type", [0, 1, 2])
def test_a_transaction_below_intrinsic_gas_is_refused_in_geths_words(tx_type, tmp_path):
    """Every transaction type below its intrinsic gas (21000 for a plain transfer) is
    refused by the node as geth words it; legacy and type 1 were py-evm's "invalid
    transaction: Insufficient gas" (from decoding), type 2 got geth's wording (admission)."""
    from chain.node import Node, NodeConfig

    node = Node(NodeConfig(tmp_path / "data", decode_process=False))
    try:
        with pytest.raises(TxRejected, match=r"^intrinsic gas too low: 20999 < 21000$"):
            node.admit(signed(tx_type, 20_999))
    finally:
        node.stop()
    assert decode_transaction(signed(tx_type, 21_000)).gas == 21_000
