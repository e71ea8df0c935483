"""`needle-net`: run a dev network, chain node or worker; submit jobs; manage keys and stake."""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import signal
import stat
import sys
import threading
import tokenize
from collections.abc import Collection, Iterable, Iterator, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import numpy as np
import typer
from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table
from typer.core import TyperGroup

from chain.cli import app as chain_app
from chain.cli import exit_on_signal
from node import keys
from node.redact import redacted

if TYPE_CHECKING:
    from chain.client import ChainClient
    from node.market import Job, Market

DEFAULT_RPC = "http://127.0.0.1:8545"
ETHER = 10**18
TRANSFER_GAS = 21_000
MAX_WEI = 2**256 - 1  # the EVM's largest value


class _ErrorLines(TyperGroup):
    """Ends every command (`chain` ones too) that hits a user's mistake or an unreachable
    node with one `error:` line instead of a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Exception as err:
            message = _user_error(err)
            if message is None:
                raise
            _fail(message)


app = typer.Typer(
    name="needle-net", no_args_is_help=True, rich_markup_mode="rich", cls=_ErrorLines,
    help="needle-net: verified remote matmuls on a proof-of-useful-work chain.",
)
devnet_app = typer.Typer(no_args_is_help=True, help="A local dev network (chain + workers).")
worker_app = typer.Typer(no_args_is_help=True, help="Run a worker node.")
keys_app = typer.Typer(no_args_is_help=True, help="Encrypted keystores.")
app.add_typer(chain_app, name="chain", help="Run or inspect a chain node.")
app.add_typer(devnet_app, name="devnet")
app.add_typer(worker_app, name="worker")
app.add_typer(keys_app, name="keys")
console = Console(soft_wrap=True)  # no line broken at 80 columns: a pipe, grep, a log

RpcUrl = Annotated[str, typer.Option("--rpc-url", envvar="NEEDLE_NET_RPC", help="Chain node URL.")]
Keystore = Annotated[Path | None, typer.Option(
    "--keystore", help="Encrypted key file; default: the public dev account 0 (dev network only).")]
PasswordFile = Annotated[Path | None, typer.Option(
    "--password-file", help=f"Keystore password file; default: ${keys.PASSWORD_ENV}.")]
Force = Annotated[bool, typer.Option("--force", help="Overwrite OUTPUT if it exists.")]


def _account(keystore: Path | None, password_file: Path | None):
    if keystore is None:
        from chain.devnet import dev_account

        return dev_account(0)
    if not keystore.is_file():  # said first: asking for a password hid a mistyped path
        raise keys.KeystoreError(f"keystore {keystore} does not exist or is not a file")
    return keys.load_keystore(keystore, keys.read_password(password_file))


def _fail(message: str, code: int = 1) -> None:
    """One error line and exit `code`; URL credentials (user:password@, a query's key) left
    out, since terminal output ends up in tickets and chats."""
    console.print(f"[red]error:[/red] {escape(redacted(message, paths=False))}", soft_wrap=True)
    raise typer.Exit(code)


def _user_error(err: Exception) -> str | None:
    """The one-line message for an error that is the user's or the network's, not a bug:
    a keystore that does not open, a node that cannot be reached or refuses, a revert."""
    import httpx
    from web3.exceptions import Web3RPCError

    from chain.client import NotAChainNode
    from node.devnet import DevnetError
    from node.market import TxReverted, is_transient, node_refusal

    if isinstance(err, keys.KeystoreError | DevnetError | NotAChainNode):
        return str(err)
    if isinstance(err, TxReverted):
        return _revert_reason(err)
    if isinstance(err, httpx.HTTPStatusError):
        return (f"{err.request.url} answered HTTP {err.response.status_code}: not a needle-net "
                "chain node?")
    if isinstance(err, httpx.InvalidURL | httpx.UnsupportedProtocol):
        return f"not a chain node URL: {err}"
    if is_transient(err):
        where = f" at {err.request.url}" if isinstance(err, httpx.RequestError) else ""
        return f"cannot reach the chain node{where}: {err}"
    if isinstance(err, Web3RPCError):
        return node_refusal(err)
    return None


def _revert_reason(err: Exception) -> str:
    """The contract's own reason for a revert (`stake below minStake`), without the raw
    revert data web3 attaches."""
    from web3.exceptions import ContractLogicError

    cause = err.__cause__
    if isinstance(cause, ContractLogicError) and cause.message:
        return cause.message.removeprefix("execution reverted: ")
    return str(err)


def _ether(text: str | Decimal) -> Decimal:
    """An amount of ETH as typed, exactly: parsed as a float, `1.1` became
    1.100000000000000128 ETH on chain and `1.0000000000000000001` silently 1."""
    if isinstance(text, Decimal):
        return text
    try:
        return Decimal(str(text).strip())
    except InvalidOperation:
        raise typer.BadParameter(f"{text!r} is not a number of ETH") from None


def _wei(amount: Decimal, what: str, allow_zero: bool = False) -> int:
    """ETH as wei, exactly; refusing NaN, infinity, amounts the chain cannot take, and
    digits below 1 wei (1e-18 ETH), which would be rounded away."""
    if not amount.is_finite() or amount < 0 or (amount == 0 and not allow_zero):
        _fail(f"{what} must be {'zero or more' if allow_zero else 'positive'} (ETH, finite), "
              f"got {amount}")
    if amount == 0:
        return 0
    # exponents are checked before any digits are expanded (1e999999999, 1e-999999999)
    if amount.adjusted() > len(str(MAX_WEI)) - 18:
        _fail(f"{what} is more ETH than the chain can hold, got {amount}")
    if amount.adjusted() < -18:
        _fail(f"{what} has digits below 1 wei (1e-18 ETH), got {amount}")
    _, digits, exponent = amount.as_tuple()
    coefficient, shift = int("".join(map(str, digits))), exponent + 18
    wei, below_one_wei = (coefficient * 10**shift, 0) if shift >= 0 else \
        divmod(coefficient, 10**-shift)
    if below_one_wei:
        _fail(f"{what} has digits below 1 wei (1e-18 ETH), got {amount}")
    if wei > MAX_WEI:
        _fail(f"{what} is more ETH than the chain can hold, got {amount}")
    return wei


def _eth(wei: int, decimals: int = 0) -> str:
    """Wei as ETH in exact decimal digits (`1.1`, not `1.1e+00` or a rounded `1.23457e+06`),
    with at least `decimals` of them after the point."""
    whole, fraction = divmod(wei, ETHER)
    digits = f"{fraction:018d}".rstrip("0").ljust(decimals, "0")
    return f"{whole}.{digits}" if digits else str(whole)


def print_table(console: Console, headers: Sequence[str], rows: Iterable[Sequence[str]],
                whole: Collection[str]) -> None:
    """Print a table whose cells fold rather than end in `…` (at 80 columns, a pipe or a
    log, `jobs` showed a worker as `0x70997970C51812dc3…`), but for the columns headed
    `whole` (addresses, URLs), whose cells stay on one line each: folded, an address was
    not found by `needle-net jobs | grep ADDRESS`. Where those columns alone are wider than
    the console, the table runs past its edge rather than being cut."""
    table = Table(*(Column(header, overflow="fold") for header in headers))
    for row in rows:
        table.add_row(*row)
    for column in table.columns:
        if column.header in whole:  # the other columns give way first
            column.no_wrap = True
            column.min_width = max(map(cell_len, column.cells), default=None)
    console.print(table, crop=False)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[list[int]]:
    """Have SIGTERM (`timeout`, `kill`, a supervisor stopping the job) interrupt like Ctrl-C,
    so that the client cancels its open job and the fee comes back: before, the process
    died at once and left the fee in an open job. The list yielded fills when SIGTERM came.
    Only the main thread can set a handler; elsewhere SIGTERM stays as it was."""
    terminated: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield terminated
        return

    def interrupt(signum: int, _frame) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield terminated
    finally:
        signal.signal(signal.SIGTERM, previous)


def _require_positive(value: float, option: str, unit: str) -> None:
    """Refuse NaN, infinity, zero and negative values of a numeric option."""
    if not (math.isfinite(value) and value > 0):
        _fail(f"{option} must be a positive number of {unit}, got {value}")


def _require_dir(path: Path, option: str) -> None:
    """Refuse a state directory that is a file (before anything is created under it)."""
    if path.exists() and not path.is_dir():
        _fail(f"{option} {path} is not a directory")


def _address(text: str) -> str:
    """A checksummed address, refusing malformed ones and mixed case with a bad checksum."""
    from web3 import Web3

    digits = text.removeprefix("0x")
    mixed_case = digits != digits.lower() and digits != digits.upper()
    if not Web3.is_address(text) or (mixed_case and not Web3.is_checksum_address(text)):
        _fail(f"{text!r} is not an address: 0x and 40 hex digits, and if mixed-case, with a "
              "valid checksum")
    return Web3.to_checksum_address(text)


def _check_writable(path: Path, force: bool) -> None:
    """Refuse an output file that cannot be written, or that exists (unless `force`), before
    any fee is spent on its result. A link to nothing exists too: the result's rename would
    find the name taken, after the fee."""
    if path.is_dir():
        _fail(f"output {path} is a directory, not a file")
    if path.exists() and not path.is_file():  # --force would put a file in its place
        _fail(f"output {path} is not a regular file (a device, pipe or socket); not replaced")
    if os.path.lexists(path) and not force:
        _fail(f"output {path} exists; pass --force to overwrite it")
    if not path.parent.is_dir():
        _fail(f"output {path}: directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK):  # `_save` writes beside it, then renames
        _fail(f"output {path} is not writable: directory {path.parent} is read-only to you")


def _save(path: Path, array: np.ndarray, force: bool, recovery: str = "") -> None:
    """Write `array` as .npy to exactly `path` (`np.save` given a name would add `.npy`),
    through a temporary file beside it: a failed write leaves no partial file, and an
    existing `path` as it was. A replaced file keeps its permission bits, as when
    overwritten in place. Without `force`, a file that appeared at `path` while the job ran
    (another command writing the same output) is not replaced: the result, paid for, is
    kept in the temporary file and the error names it. A write that fails (the directory
    removed, the disk full) ends with `recovery`: how to get the result again."""
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with part.open("wb") as f:
            np.save(f, array)
        if not force:
            _place_new(part, path)
            return
        if path.exists():
            os.chmod(part, stat.S_IMODE(path.stat().st_mode))
        os.replace(part, path)
    except FileExistsError:
        _fail(f"output {path} was created by something else while the job ran; not "
              f"overwritten: the result is in {part}")
    except OSError as err:
        part.unlink(missing_ok=True)
        _fail(f"cannot write {path}: {err}{recovery}")


def _place_new(part: Path, path: Path) -> None:
    """Rename `part` to `path`, or FileExistsError if `path` exists: a hard link creates the
    name or fails at once, where checking then renaming would replace a file created in
    between. A file system without hard links gets the check, then the rename."""
    try:
        os.link(part, path)
    except OSError as err:  # FileExistsError (EEXIST) goes up as it is
        if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        if path.exists():
            raise FileExistsError(errno.EEXIST, "exists", str(path)) from err
        os.replace(part, path)
        return
    part.unlink()


def _load_operand(path: Path) -> np.ndarray:
    """An operand from a .npy file, in this machine's byte order (a file written on a
    big-endian one loads as >f4, which the checks refuse); never unpickled (a file is data,
    not code)."""
    try:
        with path.open("rb") as f:
            if f.read(len(np.lib.format.MAGIC_PREFIX)) != np.lib.format.MAGIC_PREFIX:
                _fail(f"{path} is not a .npy array file (numpy.save writes one)")
            f.seek(0)
            array = np.load(f, allow_pickle=False)
    except (OSError, ValueError, MemoryError, tokenize.TokenError) as err:  # MemoryError: a
        # header's shape too large for memory; TokenError: numpy's parse of a cut-off header
        _fail(f"cannot read operand {path}: {err}")
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def _require_valid_operands(a: np.ndarray, b: np.ndarray) -> None:
    """Refuse operands no job can take (float64, shapes that do not multiply, NaN...)
    before the chain node or a keystore password is asked for: the client checks them only
    once it has reached the node, so they read "cannot reach the chain node" where none
    ran. The node's blob size limit is left to the client, which learns it from the node."""
    from node.client import validate_operands

    try:
        validate_operands(a, b, max_bytes=sys.maxsize)
    except ValueError as err:
        _fail(f"[stage validate] pair 0: {err}")  # as the client says it


@devnet_app.command("up")
def devnet_up(
    workers: Annotated[int, typer.Option(help="Number of worker processes.", min=0)] = 2,
    data_dir: Annotated[Path, typer.Option(help="State of chain and workers.")] = Path(
        ".needle-net/devnet"),
    port: Annotated[int, typer.Option(help="Chain JSON-RPC port; 0: any free port.", min=0,
                                      max=65535)] = 8545,
    block_time: Annotated[float, typer.Option(
        help="Seconds between blocks (at most a day); 0: seal only when transactions are "
             "pending.", min=0, max=86400)] = 0.5,
    blob_port: Annotated[int | None, typer.Option(
        help="Port of the chain's blob listener (default: the JSON-RPC port + 1, else any "
             "free port; 0: any free port).", min=0, max=65535)] = None,
    worker_api_port: Annotated[int | None, typer.Option(
        help="API port of worker 0; worker i takes this + i (default: any free ports).",
        min=1, max=65535)] = None,
) -> None:
    """Start a chain node and N workers as local processes; Ctrl-C stops them all.

    Example: [bold]needle-net devnet up --workers 3[/bold]
    """
    import httpx

    from node.devnet import Devnet

    _require_dir(data_dir, "--data-dir")
    signal.signal(signal.SIGTERM, exit_on_signal)  # leave through `with`: stop the children
    with Devnet(data_dir, port=port, block_time=block_time, blob_port=blob_port,
                worker_api_port=worker_api_port) as net:
        try:  # Ctrl-C while starting too: say so before the (up to 15 s per process) shutdown
            net.start(workers)
            blob_url = httpx.get(f"{net.rpc_url}/info").json()["blob_url"]
            print_table(console, ("process", "address", "API / dashboard"), [
                ("chain", "", net.rpc_url), ("blob store", "", blob_url),
                *((f"worker {w.index}", w.address, w.api_url) for w in net.workers)],
                whole=("process", "address", "API / dashboard"))
            console.print(f"logs in {data_dir}; Ctrl-C to stop")
            net.watch()  # DevnetError, one error line, once any process exits
        except KeyboardInterrupt:
            console.print("stopping the chain node and workers ...")


@worker_app.command("up")
def worker_up(
    rpc_url: RpcUrl = DEFAULT_RPC,
    data_dir: Annotated[Path, typer.Option(help="Keystore and job state.")] = Path(
        ".needle-net/worker"),
    password_file: PasswordFile = None,
    stake: Annotated[Decimal, typer.Option(
        parser=_ether, help="Stake to hold, in ETH (>= the market minimum).")] = Decimal("1"),
    min_fee: Annotated[Decimal, typer.Option(parser=_ether, help="Ignore jobs paying less (ETH).")
                       ] = Decimal("0"),
    max_flops: Annotated[float, typer.Option(help="Largest job accepted (FLOPs).")] = 2 * 4096**3,
    min_deadline: Annotated[int, typer.Option(
        help="Claim no job whose deadline is fewer blocks after the claim (missing one cuts "
             "10 % of the stake).", min=1)] = 5,
    max_in_flight: Annotated[int, typer.Option(help="Jobs processed at once.", min=1)] = 8,
    poll_interval: Annotated[float, typer.Option(
        help="Longest wait for a new block (the node pushes it) before polling anyway, in "
             "seconds.")] = 1.0,
    api_host: Annotated[str, typer.Option(help="HTTP API address.")] = "127.0.0.1",
    api_port: Annotated[int, typer.Option(help="HTTP API port (dashboard at /).", min=1,
                                          max=65535)] = 8600,
    admin_token_file: Annotated[Path | None, typer.Option(
        help="File with the token for /admin routes (else $NEEDLE_NET_ADMIN_TOKEN).")] = None,
    api_allowed_hosts: Annotated[str, typer.Option(
        envvar="NEEDLE_NET_API_ALLOWED_HOSTS",
        help="DNS names the API may be reached by, comma-separated ('*': any). On a loopback "
             "or private address it refuses other names with a dot (DNS rebinding); "
             "addresses, localhost and names without a dot always work.")] = "",
    wait_for_funds: Annotated[bool, typer.Option(
        help="If the worker's address cannot pay its stake yet, wait until it is funded "
             "(for service managers) instead of exiting.")] = False,
    corrupt_results: Annotated[bool, typer.Option(hidden=True)] = False,
    stall_after_claim: Annotated[float, typer.Option(hidden=True)] = 0.0,
) -> None:
    """Run a worker: stake, claim jobs, compute, commit, get paid. SIGTERM finishes jobs first.

    The key lives encrypted in DATA_DIR/key.json (created on first start).

    Example: [bold]NEEDLE_NET_PASSWORD=... needle-net worker up --api-port 8600[/bold]
    """
    from node.worker import Worker, WorkerConfig, admin_token

    stake_wei, min_fee_wei = _wei(stake, "--stake"), _wei(min_fee, "--min-fee", allow_zero=True)
    _require_positive(max_flops, "--max-flops", "FLOPs")
    _require_positive(poll_interval, "--poll-interval", "seconds")
    _require_dir(data_dir, "--data-dir")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        account = keys.load_or_create(data_dir / "key.json", keys.read_password(password_file))
    except keys.KeystoreError as err:
        _fail(str(err))
    try:
        token = admin_token(admin_token_file)
    except ValueError as err:
        _fail(str(err))
    config = WorkerConfig(
        rpc_url=rpc_url, data_dir=data_dir, stake_wei=stake_wei,
        min_fee_wei=min_fee_wei, max_flops=int(max_flops), min_deadline_blocks=min_deadline,
        max_in_flight=max_in_flight,
        poll_interval=poll_interval, api_host=api_host, api_port=api_port, admin_token=token,
        api_allowed_hosts=tuple(api_allowed_hosts.split(",")),
        corrupt_results=corrupt_results, stall_after_claim=stall_after_claim,
        wait_for_funds=wait_for_funds,
    )
    try:
        worker = Worker(config, account)
    except ValueError as err:
        _fail(str(err))
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    signal.signal(signal.SIGINT, lambda *_: worker.request_stop())
    console.print(f"worker {account.address} on {redacted(rpc_url)}, API "
                  f"http://{api_host}:{api_port}")
    worker.run()


@app.command()
def submit(
    a_path: Annotated[Path, typer.Argument(metavar="A.npy", help="Left operand.")],
    b_path: Annotated[Path, typer.Argument(metavar="B.npy", help="Right operand.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write C.")],
    force: Force = False,
    rpc_url: RpcUrl = DEFAULT_RPC,
    keystore: Keystore = None,
    password_file: PasswordFile = None,
    fee: Annotated[Decimal, typer.Option(parser=_ether, help="Fee per job in ETH.")
                   ] = Decimal("0.001"),
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the verified result.")
                       ] = 120.0,
    deadline: Annotated[int, typer.Option(
        help="Blocks a worker has to deliver after claiming; past it the job reopens and the "
             "worker's stake is cut.")] = 20,
) -> None:
    """Multiply A @ B on the network; write the verified result to OUTPUT.

    Example: [bold]needle-net submit a.npy b.npy -o c.npy --fee 0.002 --deadline 50[/bold]
    """
    from node.client import MAX_TIMEOUT_BLOCKS, JobClient, RemoteJobError

    if not 1 <= deadline <= MAX_TIMEOUT_BLOCKS:
        _fail(f"--deadline must be between 1 and {MAX_TIMEOUT_BLOCKS} blocks, got {deadline}")
    _require_positive(timeout, "--timeout", "seconds")
    fee_wei = _wei(fee, "--fee", allow_zero=True)
    _check_writable(output, force)
    try:  # large operands take seconds to read and check: Ctrl-C then said nothing at all
        a, b = _load_operand(a_path), _load_operand(b_path)
        _require_valid_operands(a, b)
    except KeyboardInterrupt:
        _fail("interrupted while reading the operands; no job was sent", code=130)
    client = JobClient(rpc_url, _account(keystore, password_file), fee_wei=fee_wei,
                       timeout=timeout, timeout_blocks=deadline, progress=True,
                       output_name=str(output))
    with _sigterm_as_interrupt() as terminated:
        try:
            c = client.matmul(a, b)
        except RemoteJobError as err:
            _fail(str(err))
        except KeyboardInterrupt as err:
            _fail(str(err) or "interrupted", code=(128 + signal.SIGTERM) if terminated else 130)
        finally:
            client.close()
    job_id = client.job_ids[0]
    _save(output, c, force, recovery=f"; job {job_id}'s result is verified and paid for: "
          f"`needle-net fetch {job_id} -o FILE` writes it to FILE")
    console.print(f"wrote {output} {c.shape} {c.dtype}: job {job_id}'s result, verified on "
                  "chain and by this client")


@app.command()
def cancel(
    job_id: Annotated[int, typer.Argument(help="The job to cancel.", min=0)],
    rpc_url: RpcUrl = DEFAULT_RPC,
    keystore: Keystore = None,
    password_file: PasswordFile = None,
) -> None:
    """Cancel a job you submitted that no worker has taken; its fee is refunded.

    A job whose worker missed its deadline is reopened first.

    Example: [bold]needle-net cancel 12 --keystore me.json[/bold]
    """
    from node.market import JOB_CLAIMED, JOB_OPEN, STATUS_NAMES, Market

    market = Market(rpc_url, _account(keystore, password_file))
    try:
        job = _existing_job(market, job_id)
        if job.submitter != market.address:
            _fail(f"job {job_id} was submitted by {job.submitter}, not by {market.address}: "
                  "only its submitter can cancel it")
        if _expired(job, market.block_number()):
            job = _reopen(market, job)
        if job.status != JOB_OPEN:
            hint = (f"; run this again after block {job.deadline} if its worker has not "
                    "delivered by then" if job.status == JOB_CLAIMED else "")
            _fail(f"job {job_id} is {STATUS_NAMES[job.status]}: only an open job can be "
                  f"cancelled{hint}")
        market.send("cancel", job_id)
    finally:
        market.close()
    console.print(f"cancelled job {job_id}: {_eth(job.fee_wei)} ETH refunded to "
                  f"{job.submitter}")


@app.command()
def fetch(
    job_id: Annotated[int, typer.Argument(help="A done job.", min=0)],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write C.")],
    force: Force = False,
    rpc_url: RpcUrl = DEFAULT_RPC,
) -> None:
    """Write the verified result of a done job to OUTPUT.

    E.g. a job whose `submit` timed out after a worker took it (C checked against its id).

    Example: [bold]needle-net fetch 12 -o c.npy[/bold]
    """
    from chain.blobhttp import BlobError
    from chain.devnet import dev_account
    from node.market import JOB_DONE, STATUS_NAMES, Market

    _check_writable(output, force)
    market = Market(rpc_url, dev_account(0))
    try:
        job = _existing_job(market, job_id)
        if job.status != JOB_DONE:
            _fail(f"job {job_id} is {STATUS_NAMES[job.status]}: only a done job has a "
                  "verified result")
        try:
            c = market.get_array(job.c_id)
        except BlobError as err:  # not stored (any more), or bytes that do not match the id
            _fail(f"job {job_id} is done, but the node's blob store did not give its result: "
                  f"{err.args[0] if err.args else err}")  # a KeyError's str() adds quotes
    finally:
        market.close()
    _save(output, c, force)
    console.print(f"wrote {output} {c.shape} {c.dtype}: job {job_id}'s result, verified on "
                  "chain")


def _expired(job: Job, head: int) -> bool:
    """Whether the contract lets anyone reopen `job`: a claim past its deadline, or a commit
    nobody finalised within the blockhash window. Nobody else does so once the submitting
    client is gone (workers do not), so without this its fee stayed in escrow for good."""
    from node.market import BLOCKHASH_WINDOW, JOB_CLAIMED, JOB_COMMITTED

    return (job.status == JOB_CLAIMED and head > job.deadline) or \
        (job.status == JOB_COMMITTED and head > job.commit_block + BLOCKHASH_WINDOW)


def _reopen(market: Market, job: Job) -> Job:
    """Reopen an expired job (`reopenExpired`: a late worker's stake cut goes to the reward
    pool) and say so; the job as it is now (a worker may have claimed it again)."""
    market.send("reopenExpired", job.job_id)
    console.print(f"reopened job {job.job_id}: its worker {job.worker} did not deliver in "
                  "time")
    return market.job(job.job_id)


def _existing_job(market: Market, job_id: int) -> Job:
    """The market's record of `job_id`, refusing an id it never gave out (the contract
    would answer an empty record)."""
    count = market.job_count()
    if job_id >= count:
        _fail(f"no job {job_id}: the market has {count} jobs so far")
    return market.job(job_id)


@app.command()
def jobs(
    rpc_url: RpcUrl = DEFAULT_RPC,
    limit: Annotated[int, typer.Option(help="How many of the latest jobs.", min=0)] = 20,
) -> None:
    """List the latest jobs on the market.

    Example: [bold]needle-net jobs --limit 5[/bold]
    """
    from chain.devnet import dev_account
    from node.market import PRECISIONS, STATUS_NAMES, ZERO_ADDRESS, Market

    market = Market(rpc_url, dev_account(0))
    rows = []
    try:
        count = market.job_count()
        for job_id in range(count - 1, max(-1, count - 1 - limit), -1):
            job = market.job(job_id)
            rows.append((str(job_id), STATUS_NAMES[job.status],
                         f"{job.batch}×{job.m}×{job.k}×{job.n}", PRECISIONS[job.precision],
                         _eth(job.fee_wei),
                         "-" if job.worker == ZERO_ADDRESS else job.worker))  # none yet
    finally:
        market.close()
    print_table(console, ("job", "status", "batch×m×k×n", "precision", "fee (ETH)", "worker"),
                rows, whole=("worker",))


@app.command()
def balance(
    address: Annotated[str | None, typer.Argument(help="Default: the keystore's address.")] = None,
    rpc_url: RpcUrl = DEFAULT_RPC,
    keystore: Keystore = None,
    password_file: Annotated[Path | None, typer.Option(  # accepted, as before; not needed
        "--password-file", hidden=True)] = None,
) -> None:
    """Show an account's balance and stake.

    Example: [bold]needle-net balance 0xf39F...[/bold]
    """
    from chain.devnet import dev_account
    from node.market import Market

    if address:
        address = _address(address)
    else:  # the keystore's address is in its file: no password needed to read it
        address = _keystore_address(keystore) if keystore else dev_account(0).address
    market = Market(rpc_url, dev_account(0))  # reads only
    try:
        stake, withdraw_block, claims = market.worker_info(address)
        wei = market.balance_of(address)
    finally:
        market.close()
    console.print(f"{address}\n  balance {_eth(wei, 6)} ETH\n"
                  f"  stake   {_eth(stake, 6)} ETH (active claims {claims}"
                  f"{f', withdrawal from block {withdraw_block}' if withdraw_block else ''})")


@keys_app.command("new")
def keys_new(
    path: Annotated[Path, typer.Argument(help="Keystore file to create.")],
    password_file: PasswordFile = None,
) -> None:
    """Create a new account in an encrypted keystore.

    Example: [bold]NEEDLE_NET_PASSWORD=... needle-net keys new worker.json[/bold]
    """
    if os.path.lexists(path):
        dangling = " (a link to nothing)" if not path.exists() else ""
        _fail(f"{path} exists{dangling}; refusing to overwrite a key")
    account = keys.load_or_create(path, keys.read_password(password_file))
    console.print(f"created {path}: {account.address}")


@keys_app.command("show")
def keys_show(
    path: Annotated[Path, typer.Argument(help="Keystore file.")],
) -> None:
    """Print the address a keystore states (read from the file; no password, no secret
    shown). Every command that unlocks the key checks it against this address.

    Example: [bold]needle-net keys show .needle-net/worker/key.json[/bold]
    """
    console.print(_keystore_address(path))


def _keystore_address(path: Path) -> str:
    """A keystore's checksummed address, read from its file without decrypting it."""
    from web3 import Web3

    if not path.is_file():
        raise keys.KeystoreError(f"keystore {path} does not exist or is not a file")
    address = keys.read_keyfile(path).get("address")
    if address is None:
        _fail(f"cannot read an address from keystore {path}: it has no \"address\" field")
    if not Web3.is_address("0x" + str(address).removeprefix("0x")):
        _fail(f"keystore {path} holds no valid address ({address!r})")
    return Web3.to_checksum_address("0x" + address.removeprefix("0x"))


@app.command()
def send(
    to: Annotated[str, typer.Argument(help="Recipient address (0x...).")],
    amount: Annotated[Decimal, typer.Argument(parser=_ether, help="ETH to transfer.")],
    rpc_url: RpcUrl = DEFAULT_RPC,
    keystore: Keystore = None,
    password_file: PasswordFile = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")
                   ] = False,
) -> None:
    """Transfer ETH to an address: signed locally, sent, and waited for until mined.

    Example: [bold]needle-net send 0x7099...79C8 1.5 --keystore me.json[/bold]
    """
    from web3.exceptions import Web3RPCError

    from chain.client import ChainClient

    to = _address(to)
    value = _wei(amount, "amount")
    account = _account(keystore, password_file)
    client = ChainClient(rpc_url, account.key)
    try:
        _require_account(client, to)
        if not yes and not typer.confirm(
                f"send {_eth(value)} ETH from {account.address} to {to}?"):
            _fail("cancelled")
        tx = {"to": to, "value": value, "gas": TRANSFER_GAS, "chainId": client.chain_id,
              "nonce": client.w3.eth.get_transaction_count(account.address, "pending"),
              "maxFeePerGas": client.w3.eth.gas_price * 2, "maxPriorityFeePerGas": 0}
        try:
            tx_hash = client.w3.eth.send_raw_transaction(account.sign_transaction(tx)
                                                         .raw_transaction)
        except Web3RPCError as err:  # the node's refusal, e.g. insufficient funds
            from node.market import node_refusal  # its message, not the JSON-RPC dict

            _fail(f"transfer refused: {node_refusal(err).removeprefix('the chain node refused: ')}")
        receipt = client.wait_for_receipt(tx_hash)
        if receipt["status"] != 1:
            _fail(f"the transfer failed in block {receipt['blockNumber']} (tx "
                  f"{tx_hash.to_0x_hex()}): nothing was sent; its gas was spent")
    finally:
        client.close()
    console.print(f"sent {_eth(value)} ETH to {to} in block {receipt['blockNumber']} "
                  f"(tx {tx_hash.to_0x_hex()})")


PRECOMPILE_RANGE = 0x100  # Prague's precompiles (0x01-0x11) and the Freivalds check (0xf1)


def _require_account(client: ChainClient, to: str) -> None:
    """Refuse a recipient that holds code: a transfer's 21,000 gas runs none of it, so the
    transfer reverts, spending its gas (before, `send` said "sent" all the same)."""
    if int(to, 16) < PRECOMPILE_RANGE:
        _fail(f"{to} is no one's account (the zero address and the chain's precompiles lie "
              f"below {PRECOMPILE_RANGE:#x}): ETH sent there is lost, or the transfer fails")
    if client.w3.eth.get_code(to):
        market = " (the market: `needle-net stake` deposits a stake)" \
            if to == client.market.address else ""
        _fail(f"{to} is a contract{market}, not an account: a plain transfer to it fails")


@app.command()
def stake(
    amount: Annotated[Decimal, typer.Argument(parser=_ether, help="ETH to add to the stake.")],
    rpc_url: RpcUrl = DEFAULT_RPC,
    keystore: Keystore = None,
    password_file: PasswordFile = None,
) -> None:
    """Register as a worker or top up the stake.

    Example: [bold]needle-net stake 1 --keystore worker.json[/bold]
    """
    from node.market import Market

    value = _wei(amount, "amount")
    market = Market(rpc_url, _account(keystore, password_file))
    try:
        balance = market.balance_of(market.address)
        if value > balance:
            _fail(f"insufficient funds: {market.address} holds {_eth(balance)} ETH, "
                  f"cannot stake {_eth(value)} ETH")
        stake_wei, withdrawing, _ = market.worker_info(market.address)
        if stake_wei + value < (minimum := market.min_stake()):
            _fail(f"a stake of {_eth(stake_wei + value)} ETH is below the minimum of "
                  f"{_eth(minimum)} ETH: stake at least {_eth(minimum - stake_wei)} ETH")
        market.send("register", value=value)
        # registering cancels a pending withdrawal (the contract's rule): said, not silent
        cancelled = f" (the withdrawal requested for block {withdrawing} is cancelled)" \
            if withdrawing else ""
        console.print(f"stake is now {_eth(market.stake_of(market.address))} ETH{cancelled}")
    finally:
        market.close()


@app.command()
def withdraw(
    rpc_url: RpcUrl = DEFAULT_RPC,
    keystore: Keystore = None,
    password_file: PasswordFile = None,
) -> None:
    """Request withdrawal of the whole stake; run again after the cooldown to receive it.

    Example: [bold]needle-net withdraw --keystore worker.json[/bold]
    """
    from node.market import Market

    market = Market(rpc_url, _account(keystore, password_file))
    try:
        _, withdraw_block, claims = market.worker_info(market.address)
        if withdraw_block == 0:
            receipt = market.send("requestWithdraw")
            block = market.events_in(receipt, "WithdrawRequested")[0]["availableBlock"]
            console.print(f"withdrawal requested; run again from block {block}")
        else:
            _require_withdrawable(market, withdraw_block, claims)
            receipt = market.send("withdraw")
            amount = market.events_in(receipt, "Withdrawn")[0]["amount"]
            console.print(f"withdrew {_eth(amount)} ETH")
    finally:
        market.close()


def _require_withdrawable(market: Market, withdraw_block: int, claims: int) -> None:
    """Refuse, before a transaction that would revert, a withdrawal the contract refuses now:
    its revert reasons ("cooldown not over") named neither the block nor the claims."""
    head = market.block_number()
    if head + 1 < withdraw_block:  # a transaction sent now lands in block head + 1 or later
        _fail(f"the stake can be withdrawn in block {withdraw_block} or later; the chain is at "
              f"block {head}: run this again then")
    if claims:
        _fail(f"{claims} job(s) claimed by {market.address} are not finished: the stake can be "
              "withdrawn once they are finalised or reopened")


@app.command()
def demo(
    workers: Annotated[int, typer.Option(help="Worker processes to start.", min=1)] = 2,
    data_dir: Annotated[Path | None, typer.Option(help="Default: a temporary directory.")] = None,
) -> None:
    """Run a devnet, a verified job and training with offloaded matmuls; show who earned what.

    Example: [bold]needle-net demo --workers 2[/bold]
    """
    from node.demo import run_demo

    if data_dir is not None:
        _require_dir(data_dir, "--data-dir")
    run_demo(workers, data_dir, console)
