"""Which blob store `BlobClient` reaches: the node's advertised blob port, or /blobs on its
main port when that port cannot be used, over real servers on 127.0.0.1.

/info advertises the blob listener at the host the client used, so what answers there may be
no listener of this node (a compose port mapping, another devnet, any HTTP server) or nothing
at all behind a firewall that drops packets. The client must then fall back to the main
port's /blobs, with the data intact, instead of waiting out its whole timeout or sending the
operands to another store; with the node's own listener it must keep using the listener."""
import asyncio
import http.client
import http.server
import socket
import threading
from collections import Counter
from concurrent import futures
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from helpers import FlakyProxy, blob_node, http_server

from chain.blobhttp import BlobApp, BlobClient
from chain.blobs import BlobStore, blob_id, encode_array
from chain.blobserver import BlobServer, listen

pytestmark = pytest.mark.timeout(90)
LIMIT_MB = 16
TIMEOUT = 15.0  # the clients' read timeout: a client that waits it out fails the test


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A node process: `port` its main port, `blob_port` the listener /info advertises."""
    with blob_node(tmp_path_factory.mktemp("route") / "data", "listener", LIMIT_MB) as proc:
        yield proc


def stored(directory: Path) -> set[str]:
    return {p.name for p in Path(directory).iterdir() if not p.name.startswith(".")}


def operands(seed: int) -> list[np.ndarray]:
    """Arrays sent in one batch (small) and alone, hashed while sent (over STREAM_BYTES)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((7, 5)).astype(np.float32),
            rng.integers(-100, 100, 300, dtype=np.int16),
            rng.standard_normal((512, 700)).astype(np.float32)]


def round_trip(client: BlobClient, seed: int) -> list[bytes]:
    """Upload arrays (batched and streamed) and a raw blob, download each, compare exactly;
    the ids, which must be the blobs' own hashes."""
    arrays = operands(seed)
    ids = client.put_arrays(arrays, threads=2)
    raw = encode_array(np.arange(1000, dtype=np.int64) * seed)
    ids.append(client.put(raw))
    assert ids == [blob_id(encode_array(a)) for a in arrays] + [blob_id(raw)]
    for id_, array in zip(ids, arrays, strict=False):
        got = client.get_array(id_)
        assert got.dtype == array.dtype
        np.testing.assert_array_equal(got, array)
    assert bytes(client.get(ids[-1])) == raw
    return ids


def bounded(call, seconds: float = 60):
    """`call()` on a thread, waited for at most `seconds` (a hang fails, not blocks, the test)."""
    with futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(call).result(timeout=seconds)


class Forwarder:
    """A TCP port on `host` piping each connection to 127.0.0.1:`target`, counting the
    connections and the bytes sent towards the target; `close()` cuts them all."""

    def __init__(self, target: int, host: str = "127.0.0.1") -> None:
        self.target = target
        self.server = socket.create_server((host, 0))
        self.server.settimeout(0.1)
        self.port = self.server.getsockname()[1]
        self.connections = self.upstream = 0
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.closed = False
        self.acceptor = threading.Thread(target=self._accept, daemon=True)
        self.acceptor.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.server.accept()
            except (TimeoutError, OSError):
                continue
            conn.settimeout(None)
            back = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:
                self.connections += 1
                self.sockets += [conn, back]
            threading.Thread(target=self._pipe, args=(conn, back, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(back, conn, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if upstream:
                    with self.lock:
                        self.upstream += len(data)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # cut by close()

    def close(self) -> None:
        self.closed = True
        self.acceptor.join()
        self.server.close()
        with self.lock:
            for sock in self.sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()


def blackhole(port: int = 0) -> tuple[socket.socket, socket.socket]:
    """A port where a connect gets no answer, as behind a firewall that drops packets: a
    listener that never accepts, its one-connection backlog taken (the kernel then drops
    further SYNs). (listener, the connection filling it)."""
    listener = socket.create_server(("127.0.0.1", port), backlog=0)
    filler = socket.create_connection(listener.getsockname())
    return listener, filler


def test_the_nodes_own_listener_is_used_and_checked_once(node):
    """The normal case: the advertised listener is the main port's store, so the blobs go
    there; the main port sees one small request (the check), for all the blobs."""
    fast, main = Forwarder(node.blob_port), Forwarder(node.port)
    try:
        client = BlobClient(f"http://127.0.0.1:{fast.port}/blobs", LIMIT_MB << 20, TIMEOUT,
                            fallback_url=f"http://127.0.0.1:{main.port}/blobs")
        ids = bounded(lambda: round_trip(client, 1) + round_trip(client, 2))
        assert client.connections is not client.fallback
        client.close()
        payload = sum(a.nbytes for a in operands(1) + operands(2))
        assert fast.upstream > payload
        assert main.connections == 1 and main.upstream < 512
        assert {id_.hex() for id_ in ids} <= stored(node.data_dir / "blobs")
    finally:
        fast.close()
        main.close()


def test_both_blob_servers_name_the_same_store_on_every_reply(node, tmp_path):
    """The listener and /blobs on the main port send one store name on every reply (found,
    not found, refused, no route); another store's listener sends another."""
    zero = "/blobs/0x" + "00" * 32
    names = set()
    for port in (node.blob_port, node.port):
        for method, path in (("HEAD", zero), ("GET", zero), ("GET", "/blobs/0xnothex"),
                             ("DELETE", zero), ("PUT", zero), ("GET", "/blobs/a/b")):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
            conn.request(method, path, b"x" if method == "PUT" else None)
            response = conn.getresponse()
            response.read()
            conn.close()
            assert response.status in (400, 404, 405), (port, method, path)
            names.add(response.getheader("x-blob-store"))
    assert len(names) == 1 and None not in names
    with BlobServer(BlobStore(tmp_path, LIMIT_MB << 20)) as other:
        conn = http.client.HTTPConnection("127.0.0.1", other.port, timeout=TIMEOUT)
        conn.request("HEAD", zero)
        assert conn.getresponse().getheader("x-blob-store") not in names | {None}
        conn.close()


class DecoyHandler(http.server.SimpleHTTPRequestHandler):
    """A plain file server (an empty directory), recording each request's method."""

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok:
            self.server.methods[self.command] += 1
        return ok

    def log_message(self, *args) -> None:
        pass


def test_a_plain_http_server_on_the_advertised_port(node, tmp_path):
    """Something else answers HTTP at the advertised port (not this node's listener): the
    client checks it once (a HEAD), sends it no blob and uses the main port. Before, the
    upload went to the decoy, which refused it (501), and the submit failed."""
    with http_server(lambda *a: DecoyHandler(*a, directory=str(tmp_path))) as decoy:
        decoy.methods = Counter()
        client = BlobClient(f"http://127.0.0.1:{decoy.server_port}/blobs", LIMIT_MB << 20,
                            TIMEOUT, fallback_url=f"{node.url}/blobs")
        ids = bounded(lambda: round_trip(client, 3))
        assert client.connections is client.fallback
        client.close()
        assert decoy.methods == {"HEAD": 1}
        assert {id_.hex() for id_ in ids} <= stored(node.data_dir / "blobs")


def test_another_nodes_blob_store_behind_the_advertised_address(node, tmp_path):
    """The compose case, end to end: the client reaches the node's main port at 127.0.0.2
    (forwarded), /info advertises 127.0.0.2:<listener port>, and there another store's blob
    listener answers (another devnet). The blobs must land in this node's store, where its
    workers fetch them, and none in the other; before, they all went to the other store."""
    from chain.client import ChainClient

    other = BlobServer(BlobStore(tmp_path / "other", LIMIT_MB << 20), "127.0.0.2",
                       node.blob_port).start()
    front = Forwarder(node.port, host="127.0.0.2")
    try:
        client = ChainClient(f"http://127.0.0.2:{front.port}", timeout=TIMEOUT)
        assert client.info["blob_url"] == f"http://127.0.0.2:{node.blob_port}/blobs"
        arrays = operands(4)

        def submit_and_fetch() -> list[bytes]:
            ids = [client.put_blob(array) for array in arrays]
            for id_, array in zip(ids, arrays, strict=True):
                np.testing.assert_array_equal(client.blobs.get_array(id_), array)
            return ids

        ids = bounded(submit_and_fetch)
        assert stored(tmp_path / "other") == set()
        assert {id_.hex() for id_ in ids} <= stored(node.data_dir / "blobs")
        assert client.blobs.connections is client.blobs.fallback
        client.close()
    finally:
        front.close()
        other.close()


def test_a_firewalled_blob_port_falls_back_after_a_short_connect_timeout(node):
    """The advertised port drops packets (a remote node with only its main port open):
    the connect gives up after the client's connect timeout and the main port serves the
    blobs. Before, the first upload waited out the whole read timeout and raised
    TimeoutError, never falling back."""
    listener, filler = blackhole()
    try:
        client = BlobClient(f"http://127.0.0.1:{listener.getsockname()[1]}/blobs",
                            LIMIT_MB << 20, TIMEOUT, fallback_url=f"{node.url}/blobs")
        ids = bounded(lambda: round_trip(client, 5))
        assert client.connections is client.fallback
        client.close()
        assert {id_.hex() for id_ in ids} <= stored(node.data_dir / "blobs")
    finally:
        filler.close()
        listener.close()


def test_an_unreachable_blob_address_falls_back(node):
    """A connect that fails with "network is unreachable" (Linux refuses TCP to the broadcast
    address so, without sending anything) is no refusal, but the port is just as unusable:
    the main port serves the blobs. Before, the OSError was raised."""
    client = BlobClient("http://255.255.255.255:8546/blobs", LIMIT_MB << 20, TIMEOUT,
                        fallback_url=f"{node.url}/blobs")
    ids = bounded(lambda: round_trip(client, 9))
    assert {id_.hex() for id_ in ids} <= stored(node.data_dir / "blobs")
    assert client.connections is client.fallback
    client.close()


def test_a_blob_port_firewalled_while_in_use_falls_back(node):
    """The listener worked and was checked; then its port drops packets (a firewall rule
    added, the node moved): the client's next connect gives up after the connect timeout
    and the transfers go on through the main port, data intact."""
    fast = Forwarder(node.blob_port)
    client = BlobClient(f"http://127.0.0.1:{fast.port}/blobs", LIMIT_MB << 20, TIMEOUT,
                        fallback_url=f"{node.url}/blobs")
    hole = None
    try:
        before = bounded(lambda: round_trip(client, 6))
        assert client.connections is not client.fallback
        fast.close()  # cuts the client's keep-alive connections: it must connect again
        hole = blackhole(fast.port)
        after = bounded(lambda: round_trip(client, 7))
        assert client.connections is client.fallback
        assert [np.asarray(client.get_array(id_)).tobytes() for id_ in before[:3]] == \
            [a.tobytes() for a in operands(6)]
        assert {id_.hex() for id_ in before + after} <= stored(node.data_dir / "blobs")
    finally:
        client.close()
        if hole is not None:
            for sock in hole:
                sock.close()


def test_an_older_node_without_store_names_is_served_through_its_main_port(tmp_path):
    """An older node names no store on its replies: the client cannot tell whether the
    advertised port is its listener, so it uses the main port's /blobs, and that works."""
    store = BlobStore(tmp_path / "blobs", LIMIT_MB << 20)
    app, seen = BlobApp(store), Counter()

    async def older_main_port(scope, receive, send) -> None:
        async def unnamed(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [
                    (k, v) for k, v in message["headers"] if k != b"x-blob-store"]}
            await send(message)
        if scope["type"] == "http":
            seen[scope["method"]] += 1
        await app(scope, receive, unnamed)

    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(older_main_port, log_level="critical"))
    serving = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    serving.start()
    listener = BlobServer(store).start()
    try:
        client = BlobClient(f"http://127.0.0.1:{listener.port}/blobs", LIMIT_MB << 20,
                            TIMEOUT, fallback_url=f"http://127.0.0.1:{sock.getsockname()[1]}"
                                                  "/blobs")
        ids = bounded(lambda: round_trip(client, 8))
        assert seen["GET"] == len(ids) and seen["POST"] >= 2  # a batch, a streamed one
        assert client.connections is client.fallback
        client.close()
        assert {id_.hex() for id_ in ids} <= stored(store.directory)
    finally:
        listener.close()
        server.should_exit = True
        serving.join(10)
        sock.close()


def test_a_main_port_answering_503_to_the_check_is_asked_again(node):
    """A 503 (a proxy or the node restarting) to the main port's check was taken as an older
    node's answer: every blob went through the main port for good. It is asked again with
    the next request, and the node's own listener is then used."""
    proxy = FlakyProxy(f"http://127.0.0.1:{node.port}/blobs", failures=1)
    try:
        client = BlobClient(f"http://127.0.0.1:{node.blob_port}/blobs", LIMIT_MB << 20,
                            TIMEOUT, fallback_url=proxy.url)
        raw = encode_array(np.arange(100, dtype=np.int64))
        with pytest.raises(ConnectionError, match="503"):
            client.put(raw)
        assert bounded(lambda: client.put(raw)) == blob_id(raw)
        assert client.connections is not client.fallback
        assert proxy.requests == 2  # the two checks; the blob went to the listener
        assert bytes(client.get(blob_id(raw))) == raw
        client.close()
    finally:
        proxy.close()


def test_a_listen_socket_gets_tcp_nodelay_on_every_connection_asyncio_accepts():
    """`listen` made its socket with create_server, protocol number 0: asyncio (so uvicorn:
    the node's JSON-RPC, a worker's API) sets TCP_NODELAY only on IPPROTO_TCP sockets, and
    each keep-alive reply's body waited for a delayed ACK (44 ms per eth_blockNumber here,
    0.5 ms with it)."""

    async def nodelay_of_an_accepted_connection() -> int:
        accepted = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer):
            accepted.set_result(writer.get_extra_info("socket").getsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=listen("127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(nodelay_of_an_accepted_connection()) != 0
