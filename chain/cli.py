"""`chain` command line: run a node, list the dev accounts, query a node's /info."""
from __future__ import annotations

import errno
import json
import logging
import signal
import socket
from enum import Enum
from pathlib import Path
from typing import Annotated, NoReturn

import typer
import uvicorn

from chain.blobs import DEFAULT_MAX_BLOB_BYTES
from chain.blobserver import UVICORN_MAX_CONNECTIONS
from chain.params import CHAIN_ID, DEV_ACCOUNT_BALANCE, DEV_ACCOUNT_COUNT, MARKET_ADDRESS

LogLevel = Enum("LogLevel", {name: name for name in (  # uvicorn.config.LOG_LEVELS
    "critical", "error", "warning", "info", "debug", "trace")})
app = typer.Typer(help="needle-net proof-of-useful-work chain (py-evm).", no_args_is_help=True)


@app.command()
def up(
    ctx: typer.Context,
    data_dir: Annotated[Path, typer.Option(help="Chain database and blob store.")] = Path(
        "chain-data"),
    host: Annotated[str, typer.Option(help="Interface for JSON-RPC and blobs.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port; 0: any free port.", min=0,
                                      max=65535)] = 8545,
    blob_port: Annotated[int | None, typer.Option(
        help="Port of the blob listener (advertised as blob_url in /info; /blobs on the HTTP "
             "port works too, slower). Default: the HTTP port + 1, or any free port if that "
             "one is taken; 0: any free port.", show_default=False, min=0, max=65535)] = None,
    block_time: Annotated[float, typer.Option(
        help="Seal a block at least this often (s, at most a day); 0: never seal empty "
             "blocks.", min=0, max=86400)] = 1.0,
    seal_on_pending: Annotated[bool, typer.Option(
        help="Seal as soon as transactions are pending.")] = True,
    max_blob_mb: Annotated[int, typer.Option(help="Largest accepted blob, MiB.", min=1)] = (
        DEFAULT_MAX_BLOB_BYTES >> 20),
    blob_cache_mb: Annotated[int, typer.Option(
        help="Memory for the latest large uploads, whose downloads (workers fetching the "
             "operands just uploaded) are then sent without a disk read, MiB; 0: off.",
        min=0)] = 256,
    blob_reserve_mb: Annotated[int | None, typer.Option(
        help="Free space kept on the data dir's disk for the chain database: an upload that "
             "would leave less is refused (507), MiB. Default: 1 GiB or 5 % of the disk, "
             "whichever is more; 0: no reserve.", show_default=False, min=0)] = None,
    max_connections: Annotated[int, typer.Option(
        help="JSON-RPC connections open at once, half of them from one address; more are "
             "answered 503 and closed (a worker or a client holds about 20).", min=2)
    ] = UVICORN_MAX_CONNECTIONS,
    log_level: Annotated[LogLevel, typer.Option(help="Python/uvicorn log level.",
                                                case_sensitive=False)] = LogLevel.warning,
) -> None:
    """Start a node: JSON-RPC at http://HOST:PORT/, node info at /info, blobs at
    http://HOST:BLOB_PORT/blobs (and at /blobs). Refuses to start, before it opens the
    database, when a port is taken or another node holds the data dir."""
    from eth_utils import to_checksum_address

    from chain.blobserver import BlobServer, bounded_http
    from chain.db import DataDirError
    from chain.node import Node, NodeConfig
    from chain.rpc import create_app

    log_level = log_level.value
    logging.basicConfig(level=uvicorn.config.LOG_LEVELS[log_level])  # "trace" is uvicorn's
    rpc_listener, blob_listener = _listeners(host, port, blob_port)
    try:
        node = Node(NodeConfig(data_dir=data_dir, block_time=block_time,
                               seal_on_pending=seal_on_pending,
                               max_blob_bytes=max_blob_mb * 2**20,
                               blob_reserve_bytes=None if blob_reserve_mb is None
                               else blob_reserve_mb << 20))
    except (DataDirError, OSError) as exc:  # OSError: a file where a folder should be, ...
        rpc_listener.close()
        blob_listener.close()
        _fail(str(exc) if isinstance(exc, DataDirError) else f"data dir {data_dir}: {exc}")
    typer.echo(f"chain id {CHAIN_ID}, head #{node.head().block_number}, data dir {data_dir}")
    typer.echo(f"market contract {to_checksum_address(MARKET_ADDRESS)}")
    from chain.devnet import dev_accounts

    # the command as invoked: `needle-net chain ...`, or `chain ...` (python -m chain)
    typer.echo(f"dev accounts (public test mnemonic, see `{ctx.parent.command_path} accounts "
               "--keys`):")
    for i, account in enumerate(dev_accounts(5)):
        typer.echo(f"  {i} {account.address}")
    blobs = BlobServer(node.blobs, recent_bytes=blob_cache_mb << 20, listener=blob_listener)
    rpc_port = rpc_listener.getsockname()[1]
    typer.echo(f"JSON-RPC http://{host}:{rpc_port}/  blobs http://{host}:{blobs.port}/blobs "
               f"(recent uploads cached: {blob_cache_mb} MiB, "
               f"{node.blobs.reserve_bytes >> 20} MiB of disk kept free)")
    app = create_app(node)
    app.fallback.state.blob_port = blobs.port  # /info advertises it as blob_url
    server = NodeServer(uvicorn.Config(app, host=host, port=rpc_port, log_level=log_level,
                                       http=bounded_http(max_connections),
                                       timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    node.start()
    blobs.start()
    # uvicorn catches SIGTERM, shuts down, then raises it again for the handler it found:
    # the default one ended the process before node.stop() sealed what it had accepted
    previous = signal.signal(signal.SIGTERM, exit_on_signal)
    try:
        server.run(sockets=[rpc_listener])
    finally:
        blobs.close()
        node.stop()
        signal.signal(signal.SIGTERM, previous)


# Seconds a stopping node's server waits for requests in progress (a blob upload on the
# main port, say) once its long polls are answered; then it cuts them. `docker stop` waits
# 10 s before it kills, and node.stop() still has to seal what was admitted.
SHUTDOWN_GRACE_S = 5


class NodeServer(uvicorn.Server):
    """uvicorn's server, whose shutdown first answers the node's long polls: it waits for
    every request in progress, and a long poll may last MAX_WAIT_S."""

    async def shutdown(self, sockets=None) -> None:
        self.config.app.answer_waiters()
        await super().shutdown(sockets)


def exit_on_signal(signum: int, _frame) -> None:
    """Leave through the `finally` blocks (exit status 128 + signum, as a shell reports)."""
    raise SystemExit(128 + signum)


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _listeners(host: str, port: int, blob_port: int | None) -> tuple[socket.socket,
                                                                      socket.socket]:
    """The JSON-RPC and blob listeners, bound before the node touches its data dir, so that
    a port in use stops the start before anything is opened. The blob port is by default
    `port` + 1, or any free port if that one is taken."""
    from chain.blobserver import listen

    if blob_port and blob_port == port:  # else "blob port P is in use", by the node itself
        _fail(f"--blob-port must differ from --port ({port})")
    rpc = _listen(host, port, "port")
    if blob_port is not None:
        try:
            return rpc, _listen(host, blob_port, "blob port")
        except typer.Exit:
            rpc.close()
            raise
    try:
        return rpc, listen(host, port + 1 if 0 < port < 65535 else 0)
    except OSError:
        return rpc, listen(host, 0)


def _listen(host: str, port: int, option: str) -> socket.socket:
    """A socket listening on host:port, or a one-line error naming the `option`."""
    from chain.blobserver import listen

    try:
        return listen(host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            _fail(f"{option} {port} is in use on {host}: {exc.strerror}")
        _fail(f"cannot listen on {host}:{port} ({option}): {exc.strerror}")


@app.command()
def accounts(
    count: Annotated[int, typer.Option(help="How many to list.", min=0)] = DEV_ACCOUNT_COUNT,
    keys: Annotated[bool, typer.Option(help="Also print private keys.")] = False,
) -> None:
    """Dev accounts from the public test mnemonic (local dev network only)."""
    from chain.devnet import DEV_MNEMONIC, dev_accounts

    typer.echo(f"mnemonic (PUBLIC, dev network only): {DEV_MNEMONIC}")
    for i, account in enumerate(dev_accounts(count)):
        funded = DEV_ACCOUNT_BALANCE // 10**18 if i < DEV_ACCOUNT_COUNT else 0
        line = f"{i:3d} {account.address} {funded} ETH"
        typer.echo(line + (f" {account.key.hex()}" if keys else ""))


@app.command()
def verify(
    data_dir: Annotated[Path, typer.Option(help="A node's data directory.")] = Path(
        "chain-data"),
) -> None:
    """Re-execute every stored block from genesis, re-running each Freivalds check."""
    from eth_utils import ValidationError

    from chain.db import DataDirError
    from chain.precompile import CheckUnavailable
    from chain.replay import verify_data_dir

    try:
        head = verify_data_dir(data_dir)
    except (DataDirError, CheckUnavailable) as exc:
        _fail(str(exc))
    except ValidationError as exc:
        typer.echo(f"INVALID: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"blocks 1..{head} re-executed: every seal and verification holds")


@app.command()
def info(
    rpc_url: Annotated[str, typer.Option(
        "--rpc-url", "--url", envvar="NEEDLE_NET_RPC",
        help="Chain node URL.")] = "http://127.0.0.1:8545",
) -> None:
    """Print a running node's /info (chain id, contract address, blob URL...)."""
    import httpx

    from chain.client import NotAChainNode, node_info

    url = rpc_url.rstrip("/")
    try:
        with httpx.Client(timeout=10) as http:
            data = node_info(http, url)
    except NotAChainNode as exc:
        _fail(str(exc))
    except httpx.HTTPError as exc:
        _fail(f"cannot reach the chain node at {url}/info: {exc}")
    data.pop("abi", None)
    typer.echo(json.dumps(data, indent=2))
