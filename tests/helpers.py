"""Test helpers shared by several test files: float32 tensors and finite differences for the
framework tests, a node serving blobs for the blob tests, chain clients for the dev accounts,
a bounded wait, exact-mode references in Python integers, a plain HTTP server."""
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

import needle as ndl
from verifier import P


def tensor(a, device, requires_grad=True) -> ndl.Tensor:
    return ndl.Tensor(np.asarray(a, dtype=np.float32), device=device, requires_grad=requires_grad)


def numeric_grad(f, arrays, i, eps=1e-6) -> np.ndarray:
    """Central differences of the float64 numpy function f(*arrays) w.r.t. arrays[i]."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    grad = np.zeros_like(arrays[i])
    for idx in np.ndindex(*arrays[i].shape):
        old = arrays[i][idx]
        arrays[i][idx] = old + eps
        up = f(*arrays)
        arrays[i][idx] = old - eps
        down = f(*arrays)
        arrays[i][idx] = old
        grad[idx] = (up - down) / (2 * eps)
    return grad


BLOB_SERVERS = ("listener", "main port")  # the node's two blob servers


@contextmanager
def blob_node(data_dir, served_by: str, limit_mb: int) -> Iterator:
    """A node process whose `blob_port` is the blob server under test: the listener /info
    advertises (chain/blobserver.py) or /blobs on the main port (chain/blobhttp.py)."""
    from urllib.parse import urlsplit

    import httpx

    from chain.launch import NodeProcess

    with NodeProcess(data_dir, block_time=0, extra_args=("--max-blob-mb", str(limit_mb))) as proc:
        listener = urlsplit(httpx.get(f"{proc.url}/info").json()["blob_url"]).port
        assert listener != proc.port
        proc.blob_port = listener if served_by == "listener" else proc.port
        yield proc


@contextmanager
def dev_clients(url: str, count: int, **options) -> Iterator[list]:
    """ChainClients of the first `count` genesis-funded dev accounts, closed afterwards."""
    from chain.client import ChainClient
    from chain.devnet import dev_accounts

    made = [ChainClient(url, account.key, **options) for account in dev_accounts(count)]
    try:
        yield made
    finally:
        for client in made:
            client.close()


@contextmanager
def http_server(handler) -> Iterator:
    """A ThreadingHTTPServer of `handler` (a request handler class or factory) on a free port
    of 127.0.0.1, serving on a thread until the block ends; yields the server."""
    from http.server import ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def wait_for(predicate, timeout: float, what: str) -> None:
    """Poll `predicate` every 0.1 s until it holds; AssertionError naming `what` after
    `timeout` seconds."""
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def reference_mod_p(M, V) -> np.ndarray:
    """(M @ V) mod p with Python's unbounded integers."""
    M, V = M.astype(object), V.astype(object)
    return np.array((M @ V) % P, dtype=np.int64)


def integers(rng, shape, dtype, small=False) -> np.ndarray:
    """Random entries over the dtype's whole range, or within +-1000."""
    info = np.iinfo(dtype)
    lo, hi = (max(info.min, -1000), min(info.max, 1000)) if small else (info.min, info.max)
    return rng.integers(lo, hi, shape, dtype=dtype, endpoint=True)


def submit_as_declared(market, fee: int, jobs: list[tuple]) -> list[int]:
    """Submit (A, B, (batch, m, k, n), precision) jobs exactly as declared, without the
    client's validation, in one transaction of a node.market.Market; their ids."""
    ids = [(market.put_array(a), market.put_array(b)) for a, b, _, _ in jobs]
    first = market.job_count()
    dims = list(zip(*(d for _, _, d, _ in jobs), strict=True))
    market.send("submitJobs", [a for a, _ in ids], [b for _, b in ids], *map(list, dims),
                [p for _, _, _, p in jobs], [fee] * len(jobs), 50, value=fee * len(jobs))
    return list(range(first, first + len(jobs)))


def events_by_topic(abi: list[dict]) -> dict[bytes, dict]:
    """A contract ABI's events by their topic 0 (the keccak of their signature)."""
    from eth_hash.auto import keccak

    return {keccak(f"{e['name']}({','.join(i['type'] for i in e['inputs'])})".encode()): e
            for e in abi if e["type"] == "event"}


def decode_log(log: dict, events: dict[bytes, dict]) -> tuple[str, dict] | None:
    """(event name, its arguments) of a raw JSON-RPC log; None for an event not in `events`."""
    from eth_abi import decode

    topics = [bytes.fromhex(t[2:]) for t in log["topics"]]
    event = events.get(topics[0]) if topics else None
    if event is None:
        return None
    indexed = [i for i in event["inputs"] if i["indexed"]]
    plain = [i for i in event["inputs"] if not i["indexed"]]
    args = {i["name"]: decode([i["type"]], t)[0]
            for i, t in zip(indexed, topics[1:], strict=True)}
    args |= dict(zip([i["name"] for i in plain],
                     decode([i["type"] for i in plain], bytes.fromhex(log["data"][2:])),
                     strict=True))
    return event["name"], args


# headers a proxy answers with its own values (http.server adds Server and Date itself)
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                        "server", "date"})


class FlakyProxy:
    """A real HTTP server on 127.0.0.1 in front of one of the node's servers that relays
    GETs, HEADs, PUTs and POSTs with their replies' headers, except that the next `failures`
    requests are answered 503 (a store restarting) or, with drop, get no answer at all (the
    connection cut), and the next
    `lose` requests to a path starting with `lose_path` whose body holds `lose_marker` are
    relayed but their answer is lost (the connection cut after the node acted on them)."""

    def __init__(self, upstream: str, failures: int = 0, drop: bool = False) -> None:
        import http.client
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        target = urlsplit(upstream)
        proxy = self
        self.failures, self.drop, self.requests, self.failed = failures, drop, 0, 0
        self.lose, self.lose_path, self.lose_marker, self.lost = 0, "", b"", 0
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def relay(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.requests += 1
                if proxy.failed < proxy.failures:
                    proxy.failed += 1
                    if proxy.drop:
                        self.close_connection = True
                        return
                    reply = b"try again later"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                    return
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                headers = {"Content-Type": self.headers.get("Content-Type", "")}
                conn.request(method, self.path, body=body or None, headers=headers)
                response = conn.getresponse()
                reply = response.read()
                conn.close()
                with proxy._lock:
                    cut = proxy.lost < proxy.lose and self.path.startswith(proxy.lose_path) \
                        and proxy.lose_marker in body
                    proxy.lost += cut
                if cut:
                    self.close_connection = True
                    return
                self.send_response(response.status)
                for name, value in response.getheaders():  # a store's name among them
                    if name.lower() not in HOP_BY_HOP:
                        self.send_header(name, value)
                length = response.getheader("Content-Length", "0") if method == "HEAD" \
                    else str(len(reply))
                self.send_header("Content-Length", length)
                self.end_headers()
                self.wfile.write(reply)

            def do_GET(self):  # noqa: N802 - http.server's names
                self.relay("GET")

            def do_HEAD(self):  # noqa: N802
                self.relay("HEAD")

            def do_PUT(self):  # noqa: N802
                self.relay("PUT")

            def do_POST(self):  # noqa: N802
                self.relay("POST")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}{target.path}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def run_worker(worker) -> threading.Thread:
    """A node.worker.Worker's loop on a daemon thread, started."""
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return thread


def stop_worker(worker, thread: threading.Thread) -> None:
    """Stop a worker started by run_worker, within 60 s, and close its chain client."""
    worker.request_stop()
    thread.join(60)
    assert not thread.is_alive(), "the worker did not stop"
    worker.chain.close()


def finalize_when_due(market, job_id: int) -> None:
    """finalize, once the commit's block is behind (it must be, one block later)."""
    for _ in range(20):
        try:
            market.send("finalize", job_id)
            return
        except Exception:  # noqa: BLE001 - same block as the commit: wait for the next
            market.wait_for_block(market.block_number() + 1, 0.5)
    raise AssertionError(f"job {job_id} could not be finalised")


def balances_at_head(market, parties: list[str]) -> tuple[int, int]:
    """(head, every party's balance summed at that block): with `base_fees_burned`, the
    money check of a whole run (only base fees leave the parties)."""
    head = market.block_number()
    return head, sum(market.w3.eth.get_balance(a, block_identifier=head) for a in parties)


def base_fees_burned(market, first: int, last: int) -> int:
    blocks = (market.w3.eth.get_block(n) for n in range(first, last + 1))
    return sum(block["gasUsed"] * block.get("baseFeePerGas", 0) for block in blocks)


def cancel_as_submitter(market, job_id: int) -> None:
    """Cancel an open job with its submitter's key (one of the first 20 dev accounts)."""
    from chain.devnet import dev_account
    from node.market import Market

    submitter = market.job(job_id).submitter
    owner = Market(market.client.url, next(
        dev_account(i) for i in range(20) if dev_account(i).address == submitter))
    try:
        owner.send("cancel", job_id)
    finally:
        owner.close()


def keystore_options(tmp_path, index: int) -> list[str]:
    """CLI options for a keystore holding dev account `index` (funded in genesis)."""
    from chain.devnet import dev_account
    from node import keys

    path, password = tmp_path / f"key{index}.json", tmp_path / f"pw{index}"
    password.write_text("pw")
    if not path.exists():
        keys.save_keystore(dev_account(index), path, "pw", iterations=2048)
    return ["--keystore", str(path), "--password-file", str(password)]


def one_block(market) -> None:
    """One more block, of a node that seals on pending: a node.market.Market's transfer of
    1 wei to itself."""
    client = market.client
    raw = client.account.sign_transaction({
        "to": client.account.address, "value": 1, "gas": 21_000, "chainId": client.chain_id,
        "nonce": client.w3.eth.get_transaction_count(client.account.address, "pending"),
        "maxFeePerGas": 10 * client.w3.eth.gas_price, "maxPriorityFeePerGas": 0,
    }).raw_transaction
    client.wait_for_receipt(client.w3.eth.send_raw_transaction(raw))


def run_cli(*args, **kwargs):
    """`needle-net` run in-process (typer's CliRunner), arguments as strings, 400 columns."""
    from typer.testing import CliRunner

    from node.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=400, **kwargs)


def one_error_line(result, code: int = 1) -> str:
    """The output of a command that failed cleanly: exit `code`, one `error:` line (a
    traceback is an exception the runner caught; `error:` lines end in SystemExit)."""
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert not lines[0].startswith("error:  "), lines[0]
    return lines[0]
