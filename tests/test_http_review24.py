"""The node's and the worker's HTTP servers under hostile clients, with real sockets on
127.0.0.1 against uvicorn serving the real apps in this process (so that timeouts can be
short and the node's long-poll waiters counted): request heads that never end or never
finish, long polls whose clients go away, JSON-RPC bodies that stop half-way."""
import socket
from collections.abc import Iterator

import pytest
from helpers import wait_for
from test_blob_review import FakeNode, asgi_server

import chain.blobserver
from chain.blobserver import UVICORN_HEAD_LIMIT, BoundedHttpProtocol
from chain.node import Node, NodeConfig
from chain.rpc import create_app as node_app
from node.api import create_app as worker_app

pytestmark = pytest.mark.timeout(60)
LONG_POLLS = 40


def serving(app):
    """`app` under uvicorn with the protocol the node and the worker are to serve with, on a
    free port of 127.0.0.1 (yielded)."""
    return asgi_server(app, log_level="critical", http=BoundedHttpProtocol)


@pytest.fixture(scope="module")
def chain_node(tmp_path_factory) -> Iterator[Node]:
    node = Node(NodeConfig(tmp_path_factory.mktemp("chain") / "data", block_time=0,
                           decode_process=False))
    node.start()
    yield node
    node.stop()


@pytest.fixture(params=("chain node", "worker API"))
def app(request, chain_node):
    return node_app(chain_node) if request.param == "chain node" else worker_app(FakeNode(),
                                                                                 "token")


def closed_by_server(sock: socket.socket) -> bytes | None:
    """What the server sent before it closed `sock` (None if it is still open after 10 s)."""
    sock.settimeout(10)
    received = b""
    try:
        while data := sock.recv(65536):
            received += data
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass  # closed with our bytes unread: its reply may be lost with them
    return received


def test_an_endless_header_is_refused_within_a_bounded_size(app):
    """uvicorn's parser kept an endless header line in memory: 200 MiB of one header grew a
    node process by 225 MB and the connection stayed open. Now the server closes it (431)
    after at most the head limit and one read, and other clients are answered."""
    with serving(app) as port, socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /info HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        step, sent = b"a" * (64 << 10), 0
        try:
            while sent < 64 << 20:
                sock.sendall(step)
                sent += len(step)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = closed_by_server(sock)
        assert reply is not None, f"{sent} bytes of one header line and still open"
        assert reply == b"" or reply.startswith(b"HTTP/1.1 431 ")
        assert sent < 64 << 20
        with socket.create_connection(("127.0.0.1", port), timeout=10) as other:
            other.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert other.makefile("rb").readline().split()[1] == b"200"


@pytest.mark.parametrize("pieces", [1, 3], ids=["one read", "three reads"])
def test_a_head_over_the_limit_sent_at_once_is_refused(app, pieces):
    """A whole head over the limit in one read was parsed and served (200) before the
    count could refuse it: only heads that outgrew a read were."""
    with serving(app) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = (b"GET /openapi.json HTTP/1.1\r\nHost: x\r\nX-Big: "
                + b"a" * (UVICORN_HEAD_LIMIT + 100) + b"\r\n\r\n")
        cut = len(head) // pieces
        for i in range(pieces):
            sock.sendall(head[i * cut: None if i == pieces - 1 else (i + 1) * cut])
        reply = closed_by_server(sock)
        assert reply is not None and reply.startswith(b"HTTP/1.1 431 "), reply


def test_a_head_at_the_limit_is_served(app):
    with serving(app) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        filler = b"X-Filler: " + b"a" * (UVICORN_HEAD_LIMIT - 200) + b"\r\n"
        sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + filler
                     + b"\r\n")
        assert sock.makefile("rb").readline().split()[1] == b"200"


def test_heads_that_never_finish_are_closed(app, monkeypatch):
    """A connection that sends nothing, or part of a head and then nothing (slowloris), was
    held for good: uvicorn times out only idle keep-alive connections between requests."""
    monkeypatch.setattr(chain.blobserver, "HEAD_TIMEOUT", 0.5)
    with serving(app) as port:
        silent = socket.create_connection(("127.0.0.1", port))
        partial = socket.create_connection(("127.0.0.1", port))
        partial.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        kept_alive = socket.create_connection(("127.0.0.1", port))  # a second request trickles
        kept_alive.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n")
        assert kept_alive.recv(12) == b"HTTP/1.1 200"
        kept_alive.sendall(b"GET /hea")
        for sock in (silent, partial, kept_alive):
            with sock:
                reply = closed_by_server(sock)
                assert reply is not None, "an unfinished head held its connection"
                assert b"408 Request Timeout" in reply or sock is not partial


def test_a_long_poll_leaves_no_waiter_when_its_client_goes(chain_node):
    """The long poll waited out its timeout (up to 60 s) for a client that was gone: clients
    that opened and dropped long polls piled up waiters, each checked at every block."""
    app = node_app(chain_node)
    far = chain_node.head().block_number + 1000
    with serving(app) as port:
        polls = [socket.create_connection(("127.0.0.1", port)) for _ in range(LONG_POLLS)]
        for sock in polls:
            sock.sendall(f"GET /wait?block={far}&timeout=60 HTTP/1.1\r\nHost: x\r\n\r\n"
                         .encode())
        wait_for(lambda: len(app.waiters) == LONG_POLLS, 10, "every long poll waiting")
        for sock in polls:
            sock.close()
        wait_for(lambda: not app.waiters, 10, "the waiters of closed long polls released")
        # a long poll whose client stays is answered as before
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(f"GET /wait?block={far}&timeout=0.2 HTTP/1.1\r\nHost: x\r\n\r\n"
                         .encode())
            assert sock.recv(12) == b"HTTP/1.1 200"


def test_a_json_rpc_body_that_stops_is_dropped(chain_node):
    """uvicorn bounds no body in time: a JSON-RPC request that stopped mid-body held its
    connection and the bytes so far (up to 64 MiB) for good."""
    app = node_app(chain_node)
    app.body_timeout = 0.5
    with serving(app) as port, socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{\"jsonrpc\": \"2.0\", ")
        reply = closed_by_server(sock)
        assert reply is not None, "a stalled JSON-RPC body held its connection"
        assert reply.startswith(b"HTTP/1.1 408 ") and b"no body bytes" in reply


def test_chain_up_and_a_worker_bound_their_request_heads(node, tmp_path):
    """The bound holds where it is wired: a real `chain up` process and a worker's API."""
    from urllib.parse import urlsplit

    from helpers import run_worker, stop_worker

    from chain.devnet import dev_account
    from node.worker import Worker, WorkerConfig

    worker = Worker(WorkerConfig(rpc_url=node.url, data_dir=tmp_path, stake_wei=10**18,
                                 api_port=0), dev_account(3))
    thread = run_worker(worker)
    try:
        wait_for(lambda: worker.status()["stake_wei"] > 0, 30, "the worker never started")
        for port in (urlsplit(node.url).port, worker._api_socket.getsockname()[1]):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\nX-Long: "
                             + b"a" * (2 * UVICORN_HEAD_LIMIT))
                reply = closed_by_server(sock)
                assert reply is not None and (reply == b"" or reply.startswith(b"HTTP/1.1 431 "))
    finally:
        stop_worker(worker, thread)
