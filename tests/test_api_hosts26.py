"""The worker's HTTP API, session 26, with real HTTP to real servers: the DNS-rebinding
guard on private and link-local addresses (a compose container behind a published
127.0.0.1 port, a LAN worker) and on a dual-stack socket, names the operator allows
(`worker up --api-allowed-hosts`, $NEEDLE_NET_API_ALLOWED_HOSTS), no HTML docs pages that
load third-party scripts, and job details that do not show an RPC URL's credentials."""
from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn
from helpers import wait_for
from test_blob_review import FakeNode, asgi_server

from chain.devnet import dev_account
from chain.launch import free_port
from node import keys
from node.api import create_app

pytestmark = pytest.mark.timeout(180)
REBOUND = "evil.example.com"  # an attacker's domain, resolved to the worker's address
NEEDLE_NET = str(Path(sys.executable).parent / "needle-net")


def _private_addresses() -> list[str]:
    """This machine's private and link-local addresses (`ip -o addr`); an IPv6 link-local
    one with its interface (`fe80::1%eth0`)."""
    try:
        shown = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True,
                               timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for fields in (line.split() for line in shown.splitlines()):
        device, address = fields[1], fields[3].split("/")[0]
        ip = ipaddress.ip_address(address)
        if ip.is_loopback or not (ip.is_private or ip.is_link_local):
            continue
        found.append(f"{address}%{device}" if ip.version == 6 and ip.is_link_local else address)
    return found


def _reporting_server(app, address: str):
    """`app`, seeing every request as arrived on `address` (ASGI scope["server"]): for an
    address of a kind this machine has none of."""
    async def wrapped(scope, receive, send):
        if scope["type"] == "http":
            scope = {**scope, "server": (address, scope["server"][1])}
        await app(scope, receive, send)
    return wrapped


@contextmanager
def _served(app, host: str) -> Iterator[int]:
    """`app` served by uvicorn on a thread, on a free port of `host` (IPv4 or IPv6; `::`
    dual-stack), the port yielded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = socket.getaddrinfo(host, 0, family, socket.SOCK_STREAM)[0][4]  # fe80::1%eth0 too
    listening = socket.create_server(address, family=family, dualstack_ipv6=host == "::")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, "uvicorn")
    try:
        yield listening.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        listening.close()


def _binds(host: str) -> bool:
    try:
        socket.create_server((host, 0), family=socket.AF_INET6, dualstack_ipv6=True).close()
    except OSError:
        return False
    return True


def _get(address: str, port: int, host: str | None, path: str = "/status") -> tuple[int, str]:
    """(status, body) of `GET path` sent to address:port with header `Host: host` (none if
    None), over a plain socket: any address (link-local with its interface), any Host."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    target = socket.getaddrinfo(address, port, family, socket.SOCK_STREAM)[0][4]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(target)
        head = f"GET {path} HTTP/1.1\r\n" + (f"Host: {host}\r\n" if host is not None else "")
        sock.sendall((head + "Connection: close\r\n\r\n").encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status_line, _, rest = reply.decode().partition("\r\n")
    return int(status_line.split()[1]), rest.partition("\r\n\r\n")[2]


def _literal(address: str, port: int) -> str:
    """address:port as a Host header names it."""
    bare = address.split("%")[0]
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def _private_servers(app) -> list[tuple[str, object]]:
    """(address to connect to, app to serve there) for each private address of this machine,
    or the compose case (a container's bridge address) reported to `app` on 127.0.0.1."""
    found = _private_addresses()
    if found:
        return [(address, app) for address in found]
    return [("127.0.0.1", _reporting_server(app, "172.17.0.2"))]


def test_a_rebound_name_is_refused_on_private_and_link_local_addresses():
    """Before, only loopback connections were checked: under compose the published
    127.0.0.1 port reaches the container on its bridge address (172.x), and a LAN browser
    can be rebound to a worker at 192.168.x, and `Host: evil.example.com` got 200. Now the
    refusal names the option that allows a real DNS name; this machine's names still work."""
    for address, app in _private_servers(create_app(FakeNode(), None)):
        with _served(app, address) as port:
            for host in (f"{REBOUND}:{port}", REBOUND, "EVIL.example.COM."):
                status, body = _get(address, port, host)
                assert status == 403, (address, host, body)
                assert "--api-allowed-hosts" in body and "NEEDLE_NET_API_ALLOWED_HOSTS" in body
            for host in (_literal(address, port), f"worker:{port}", "dash.localhost",
                         f"{socket.gethostname()}:{port}", None):
                status, body = _get(address, port, host)
                assert status == 200 and '"address"' in body, (address, host, body)


def test_a_loopback_connection_to_a_dual_stack_socket_is_checked():
    """`--api-host ::` takes IPv4 connections as IPv4-mapped IPv6 addresses
    (::ffff:127.0.0.1), which `is_loopback` does not call loopback: before, such a
    connection was never checked."""
    if not socket.has_ipv6 or not _binds("::"):
        pytest.skip("this machine has no IPv6 socket")
    ipv4 = [a for a in _private_addresses() if ":" not in a]  # ::ffff:192.168.x.y
    with _served(create_app(FakeNode(), None), "::") as port:
        for address in ("127.0.0.1", "::1", *ipv4):
            assert _get(address, port, f"{REBOUND}:{port}")[0] == 403, address
            assert _get(address, port, f"localhost:{port}")[0] == 200, address


def test_any_name_is_served_on_a_public_address():
    """A public address is reached by any page directly, rebinding or not: there the API
    answers any name (this machine has no public address: the ASGI scope reports one)."""
    for public in ("8.8.8.8", "2001:4860:4860::8888", "::ffff:8.8.8.8"):
        app = _reporting_server(create_app(FakeNode(), None), public)
        with _served(app, "127.0.0.1") as port:
            assert _get("127.0.0.1", port, f"gpu-box.example:{port}")[0] == 200, public
    private = _reporting_server(create_app(FakeNode(), None), "::ffff:10.0.0.7")
    with _served(private, "127.0.0.1") as port:
        assert _get("127.0.0.1", port, f"gpu-box.example:{port}")[0] == 403


def test_allowed_names_are_served_in_any_case_and_star_turns_the_check_off():
    """Names the operator allows (any case, a final dot, a port, spaces after commas) are
    served; other DNS names, a parent domain of an allowed one included, are not."""
    allowed = [" Worker.Example.COM", "gpu.lan.:8600", ""]
    for address, app in [("127.0.0.1", create_app(FakeNode(), None, allowed)),
                         *_private_servers(create_app(FakeNode(), None, allowed))]:
        with _served(app, address) as port:
            for host in (f"worker.example.com:{port}", "WORKER.EXAMPLE.com.", "gpu.lan"):
                assert _get(address, port, host)[0] == 200, (address, host)
            for host in (f"{REBOUND}:{port}", "example.com", "x.worker.example.com"):
                assert _get(address, port, host)[0] == 403, (address, host)
    for address, app in [("127.0.0.1", create_app(FakeNode(), None, ["*"])),
                         *_private_servers(create_app(FakeNode(), None, ["*"]))]:
        with _served(app, address) as port:
            assert _get(address, port, f"{REBOUND}:{port}")[0] == 200, address


def _answers(port: int) -> bool:
    try:
        return _get("127.0.0.1", port, None, "/health")[0] == 200
    except OSError:
        return False


def test_worker_up_takes_allowed_names_from_its_environment(node, tmp_path):
    """`needle-net worker up` with $NEEDLE_NET_API_ALLOWED_HOSTS (as compose passes it) and a
    funded key: its API answers the allowed name and still refuses others."""
    data_dir = tmp_path / "worker"
    data_dir.mkdir()
    keys.save_keystore(dev_account(15), data_dir / "key.json", "pw", iterations=2048)
    port = free_port()
    env = {**os.environ, "NEEDLE_NET_PASSWORD": "pw",
           "NEEDLE_NET_API_ALLOWED_HOSTS": "gpu1.example.net, other.example.net"}
    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [NEEDLE_NET, "worker", "up", "--rpc-url", node.url, "--data-dir", str(data_dir),
         "--api-port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _answers(port) or worker.poll() is not None, 90, "the worker's API")
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()
        assert _get("127.0.0.1", port, f"GPU1.example.net:{port}")[0] == 200
        assert _get("127.0.0.1", port, f"{REBOUND}:{port}")[0] == 403
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(10)
        log.close()


def test_the_html_docs_pages_are_off_and_the_schema_stays():
    """/docs and /redoc loaded their scripts from a CDN: blank on an offline worker, and
    third-party code on the API's origin. The OpenAPI schema is still served."""
    with asgi_server(create_app(FakeNode(), None)) as port:
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            status, body = _get("127.0.0.1", port, None, path)
            assert status == 404 and "jsdelivr" not in body, path
        status, body = _get("127.0.0.1", port, None, "/openapi.json")
        assert status == 200 and '"/status"' in body and '"/jobs"' in body


class CredentialedNode(FakeNode):
    """A node whose jobs failed with errors naming its RPC URL, credentials included."""

    DETAILS = [
        ("HTTPStatusError: Client error '401 Unauthorized' for url "
         "'https://alice:s3cr%40t@rpc.example.com:8545/v3/KEY0123abcd/blobs/0xab?apikey=Q42'\n"
         "For more information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/401",
         "HTTPStatusError: Client error '401 Unauthorized' for url "
         "'https://***@rpc.example.com:8545/***'\n"
         "For more information check: https://developer.mozilla.org/***"),
        ("ConnectionError: cannot reach http://bob:pw@[fd00::5]:8545?token=T0K3N and "
         "HTTP://user@host.example/ (twice)",
         "ConnectionError: cannot reach http://***@[fd00::5]:8545?*** and "
         "HTTP://***@host.example/ (twice)"),
        ("ValueError: operands do not match the job", "ValueError: operands do not match the job"),
        ("OSError: http://chain:8545 unreachable", "OSError: http://chain:8545 unreachable"),
        ("", ""),
    ]

    def job_list(self) -> list[dict]:
        return [{"job_id": i, "batch": 1, "m": 2, "k": 3, "n": 4, "stage": "error",
                 "fee_wei": 1, "seconds": None, "detail": raw}
                for i, (raw, _) in enumerate(self.DETAILS)]


def test_job_details_do_not_show_rpc_credentials():
    """A web3/httpx error names the URL it failed on, and an RPC URL may hold credentials
    (user:password@, ?apikey=, a path token such as Infura's /v3/<key>): /jobs showed them
    to anyone who reads the API. Now they are `***`; scheme, host and port stay."""
    import json

    node = CredentialedNode()
    with asgi_server(create_app(node, None)) as port:
        status, body = _get("127.0.0.1", port, None, "/jobs")
    assert status == 200
    jobs = json.loads(body)
    assert [job["detail"] for job in jobs] == [shown for _, shown in node.DETAILS]
    assert [{k: v for k, v in job.items() if k != "detail"} for job in jobs] == [
        {k: v for k, v in job.items() if k != "detail"} for job in node.job_list()]
    for secret in ("alice", "s3cr", "KEY0123", "Q42", "bob", "T0K3N", "user@"):
        assert secret not in body, secret
