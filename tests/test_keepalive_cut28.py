"""An answer whose body is cut off mid-read (here a socket timeout; a Ctrl-C in the read
takes the same path) closes its keep-alive connection: the thread's next request goes out
once, on a fresh connection. Before, the JSON-RPC provider, the long poll and blob downloads
read the body outside the connection's guard; the next request went out first on the old
connection, behind the rest of the answer, then again on a new one (an upload behind an
unread download waited for the socket's timeout). A real server on 127.0.0.1 records which
connection carried each request."""
import socket
import threading

import pytest

from chain.blobhttp import BlobClient
from chain.client import KeepAliveProvider

pytestmark = pytest.mark.timeout(60)
STALL = b"stall"


class StallingServer:
    """Answers each request with 200 and a short body (none to a HEAD), except a GET or one
    whose body holds `stall`: that answer declares 1000 bytes, sends 10, and the connection
    then waits for the next request. `seen` lists (connection number, request line, body) in
    arrival order."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen: list[tuple[int, bytes, bytes]] = []
        self.threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn, len(self.threads)),
                                      daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        try:
            self._answer(conn, number)
        except ConnectionResetError:
            pass  # the client closed a connection it had not read to the end
        finally:
            conn.close()

    def _answer(self, conn: socket.socket, number: int) -> None:
        pending = b""
        while True:
            while b"\r\n\r\n" not in pending:
                more = conn.recv(65536)
                if not more:
                    return
                pending += more
            head, pending = pending.split(b"\r\n\r\n", 1)
            lines = head.split(b"\r\n")
            length = next((int(v) for k, _, v in (h.partition(b":") for h in lines[1:])
                           if k.strip().lower() == b"content-length"), 0)
            while len(pending) < length:
                more = conn.recv(65536)
                if not more:
                    return
                pending += more
            body, pending = pending[:length], pending[length:]
            self.seen.append((number, lines[0], body))
            if STALL in body or lines[0].startswith(b"GET "):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
            elif lines[0].startswith(b"HEAD "):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 2\r\n\r\n{}")

    def requests(self) -> list[tuple[int, bytes, bytes]]:
        """`seen` once every connection the client opened has ended (it closed them all)."""
        for thread in self.threads:
            thread.join(10)
        return self.seen

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def server():
    served = StallingServer()
    yield served
    served.close()


def test_a_json_rpc_answer_cut_mid_body_leaves_no_request_on_its_connection(server):
    provider = KeepAliveProvider(server.url, timeout=0.5)
    with pytest.raises(TimeoutError):
        provider._make_request("eth_stall", b'{"method": "eth_stall"}')
    assert provider._make_request("eth_next", b'{"method": "eth_next"}') == b"{}"
    provider.connections.close()
    assert [(n, body) for n, _, body in server.requests()] == \
        [(0, b'{"method": "eth_stall"}'), (1, b'{"method": "eth_next"}')]


def test_a_blob_download_cut_mid_body_leaves_no_request_on_its_connection(server):
    blobs = BlobClient(f"{server.url}/blobs", max_bytes=1 << 20, timeout=0.5)
    with pytest.raises(TimeoutError):
        blobs.get(bytes(32))
    assert blobs.has(bytes(32)) is True
    blobs.close()
    assert [(n, line.split()[0]) for n, line, _ in server.requests()] == \
        [(0, b"GET"), (1, b"HEAD")]
