"""The worker's HTTP API: health, status, jobs, recent blocks, Prometheus metrics, the
dashboard page, and token-protected admin actions. The OpenAPI schema is at /openapi.json;
FastAPI's HTML docs pages are off (they load their scripts from a CDN)."""

from __future__ import annotations

import ipaddress
import secrets
import socket
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol, TypeVar

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from web3.exceptions import Web3RPCError

from node.market import TxReverted, is_transient, node_refusal
from node.metrics import NodeMetrics
from node.redact import redacted

DASHBOARD = Path(__file__).with_name("dashboard.html")
T = TypeVar("T")
# /blocks requests that may wait on the chain node at once. Each holds one of the API's
# worker threads (40) until the node answers or web3 gives up (60 s): a dashboard asking
# every second while the node hangs took them all, and /health, /status and /metrics
# stopped answering too.
CHAIN_READERS = 4
# on every answer: no page of this API may be framed by another site, nor an answer read as
# another type than it says (a JSON error echoing a request as HTML)
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY"}


def _host_name(host_header: str) -> str:
    """The name in a Host header, without port or brackets, lower case, no final dot."""
    if host_header.startswith("["):
        name = host_header[1:].partition("]")[0]
    else:
        name = host_header.rsplit(":", 1)[0]
    return name.lower().rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _rebindable(address: str) -> bool:
    """Whether `address` is one a web page reaches under its own, rebound DNS name to read
    what it could not: a loopback, private or link-local address (a container's bridge
    address behind a port published on 127.0.0.1, a LAN worker). An IPv4 connection to a
    dual-stack socket comes as an IPv4-mapped IPv6 address (::ffff:127.0.0.1), judged as
    the IPv4 one."""
    if not _is_ip(address):
        return False
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_private or ip.is_link_local


def _names_this_machine(server: tuple | None, host_header: str | None,
                        allowed: frozenset[str]) -> bool:
    """False for a request that came in on a loopback, private or link-local address but
    names a host of the DNS: a web page whose domain was rebound to that address (DNS
    rebinding), which the browser then lets read this API (and try admin tokens) as its own
    site. Such a domain has a dot; this machine is named by an address, localhost (or
    *.localhost), the host name, another name without a dot (/etc/hosts), or a name the
    operator allows (`allowed`; "*" allows any)."""
    if "*" in allowed or not server or not host_header or not _rebindable(server[0]):
        return True
    name = _host_name(host_header)
    return ("." not in name or name.endswith(".localhost") or _is_ip(name)
            or name == socket.gethostname().lower() or name in allowed)


def _on_chain(action: Callable[[], T]) -> T:
    """`action()`, which reads or writes the chain: a revert answers 409 with the contract's
    reason, a transaction the node refuses (too little ETH for its gas) 409 with the node's
    reason, an unreachable chain node 503 (none is this node's bug, a 500)."""
    try:
        return action()
    except TxReverted as err:
        reason = getattr(err.__cause__, "message", None) or str(err)
        raise HTTPException(409, f"the chain refused: {reason.removeprefix('execution reverted: ')}"
                            ) from err
    except Web3RPCError as err:
        raise HTTPException(409, node_refusal(err)) from err
    except Exception as err:
        if not is_transient(err):
            raise
        raise HTTPException(503, "the chain node cannot be reached; try again") from err


class NodeView(Protocol):
    """What the API needs from a worker (implemented by node.worker.Worker)."""

    metrics: NodeMetrics

    def status(self) -> dict: ...
    def job_list(self) -> list[dict]: ...
    def recent_blocks(self, count: int) -> list[dict]: ...
    def request_stop(self) -> None: ...
    def request_withdraw(self) -> dict: ...


def create_app(node: NodeView, admin_token: str | None,
               allowed_hosts: Iterable[str] = ()) -> FastAPI:
    """The API for `node`; admin routes answer 403 unless `Authorization: Bearer <admin_token>`.
    `allowed_hosts`: DNS names (any case, a port ignored) this API answers to besides this
    machine's own; "*": any."""
    app = FastAPI(title="needle-net worker", version="0.1.0", docs_url=None, redoc_url=None)
    allowed = frozenset(_host_name(name.strip()) for name in allowed_hosts) - {""}
    chain_readers = threading.BoundedSemaphore(CHAIN_READERS)

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable) -> Response:
        """403 for a request naming another host on a loopback, private or link-local
        connection; SECURITY_HEADERS on every answer."""
        host = request.headers.get("host")
        if _names_this_machine(request.scope.get("server"), host, allowed):
            response = await call_next(request)
        else:
            response = JSONResponse(status_code=403, content={
                "detail": f"refused: Host {host!r} is not this machine (DNS rebinding?); "
                          "open the API as http://127.0.0.1:<port> or http://localhost:<port>, "
                          "or allow the name: worker up --api-allowed-hosts NAME "
                          "(NEEDLE_NET_API_ALLOWED_HOSTS)"})
        response.headers.update(SECURITY_HEADERS)
        return response

    def require_admin(authorization: str | None) -> None:
        """403 unless `authorization` is `Bearer <admin_token>`: the scheme in any case (HTTP
        auth schemes are case-insensitive), the token compared in constant time as the bytes
        sent (the header arrives decoded as Latin-1; a token typed with non-ASCII characters
        is sent as UTF-8, as the token file is read)."""
        if not admin_token:
            raise HTTPException(403, "admin routes are off: this node has no admin token")
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode("latin-1"), admin_token.encode()
        ):
            raise HTTPException(403, "admin token missing or wrong")

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    @app.get("/status")
    def status() -> dict:
        return node.status()

    @app.get("/jobs")
    def jobs() -> list[dict]:
        """The node's jobs, their `detail` (an error's text) without URL credentials."""
        return [{**job, "detail": redacted(job["detail"])} if job.get("detail") else job
                for job in node.job_list()]

    @app.get("/blocks")
    def blocks(count: int = 10) -> list[dict]:
        """503 at once past CHAIN_READERS requests waiting on the chain node, so that a slow
        node cannot take every thread the other routes answer on."""
        if not chain_readers.acquire(blocking=False):
            raise HTTPException(503, "the chain node is slow to answer; try again")
        try:
            return _on_chain(lambda: node.recent_blocks(max(1, min(count, 50))))
        finally:
            chain_readers.release()

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(node.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    def dashboard() -> str:
        return DASHBOARD.read_text()

    @app.post("/admin/stop")
    def stop(authorization: str | None = Header(default=None)) -> dict:
        require_admin(authorization)
        node.request_stop()
        return {"stopping": True}

    @app.post("/admin/withdraw")
    def withdraw(authorization: str | None = Header(default=None)) -> dict:
        require_admin(authorization)
        return _on_chain(node.request_withdraw)

    return app
