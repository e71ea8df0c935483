"""The worker's HTTP API: health, status, jobs, recent blocks, Prometheus metrics, the
dashboard page, and token-protected admin actions. OpenAPI docs come with FastAPI at /docs."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from fastapi import FastAPI, Header, HTTPException
from fastapi.responses import HTMLResponse, Response
from web3.exceptions import Web3RPCError

from node.market import TxReverted, is_transient, node_refusal
from node.metrics import NodeMetrics

DASHBOARD = Path(__file__).with_name("dashboard.html")
T = TypeVar("T")
# /blocks requests that may wait on the chain node at once. Each holds one of the API's
# worker threads (40) until the node answers or web3 gives up (60 s): a dashboard asking
# every second while the node hangs took them all, and /health, /status and /metrics
# stopped answering too.
CHAIN_READERS = 4


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


def create_app(node: NodeView, admin_token: str | None) -> FastAPI:
    """The API for `node`; admin routes answer 403 unless `Authorization: Bearer <admin_token>`."""
    app = FastAPI(title="needle-net worker", version="0.1.0")
    chain_readers = threading.BoundedSemaphore(CHAIN_READERS)

    def require_admin(authorization: str | None) -> None:
        """403 unless `authorization` is `Bearer <admin_token>`: the scheme in any case (HTTP
        auth schemes are case-insensitive), the token compared in constant time."""
        if not admin_token:
            raise HTTPException(403, "admin routes are off: this node has no admin token")
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), admin_token.encode()
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
        return node.job_list()

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
