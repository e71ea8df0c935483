"""A small web3 client for the market: signs locally, manages nonces, moves blobs."""
from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlencode, urlsplit

import coincurve
import httpx
import numpy as np
import rlp
from eth_abi import decode as abi_decode
from eth_abi import encode as abi_encode
from eth_account import Account
from eth_utils import keccak, to_checksum_address
from hexbytes import HexBytes
from web3 import HTTPProvider, Web3
from web3._utils.method_formatters import receipt_formatter
from web3.datastructures import AttributeDict
from web3.exceptions import ContractLogicError, TransactionNotFound, Web3RPCError

from chain.blobhttp import BlobClient
from chain.blobs import DEFAULT_MAX_BLOB_BYTES, decode_array, parse_id
from chain.keepalive import Connections
from chain.params import MAX_LOG_BLOCKS
from chain.timeline import mark

FEE_REFRESH_S = 2.0
POLL_S = 0.05
DYNAMIC_FEE_TX_TYPE = b"\x02"


def sign_dynamic_fee(key: coincurve.PrivateKey, *, chain_id: int, nonce: int, max_fee: int,
                     max_priority_fee: int, gas: int, to: bytes, value: int,
                     data: bytes) -> bytes:
    """A signed EIP-1559 transaction (no access list), raw: rlp and libsecp256k1 directly,
    byte for byte what eth-account's sign_transaction gives (RFC 6979 nonces, low s) in
    a tenth of its time."""
    fields = [chain_id, nonce, max_priority_fee, max_fee, gas, to, value, data, []]
    digest = keccak(DYNAMIC_FEE_TX_TYPE + rlp.encode(fields))
    signature = key.sign_recoverable(digest, hasher=None)  # r (32) | s (32) | y parity
    r, s = int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:64], "big")
    return DYNAMIC_FEE_TX_TYPE + rlp.encode([*fields, signature[64], r, s])


def call_data(fn_call) -> bytes:
    """A contract call's ABI-encoded input (web3's encoding, without its per-call ABI
    lookups)."""
    return bytes.fromhex(fn_call.selector[2:]) + abi_encode(list(fn_call.argument_types),
                                                            list(fn_call.arguments))


class KeepAliveProvider(HTTPProvider):
    """web3's HTTP provider over `chain.keepalive` connections (one per thread)."""

    def __init__(self, url: str, timeout: float) -> None:
        super().__init__(url)
        self.connections = Connections(url, timeout)

    def _make_request(self, method, request_data: bytes) -> bytes:
        def send(conn):  # the answer read whole inside the guard: see `_long_poll`
            conn.request("POST", self.connections.prefix or "/", request_data,
                         {"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, response.read()

        status, body = self.connections.request(send)
        if status != 200:
            raise ConnectionError(f"JSON-RPC endpoint answered HTTP {status} to "
                                  f"{method}: {body[:200]!r}")
        return body


class TransactionReverted(RuntimeError):
    """A transaction was mined but reverted (status 0), or would revert."""


def log_spans(first: int, last: int) -> Iterator[tuple[int, int]]:
    """Blocks first..last as (from, to) spans of at most MAX_LOG_BLOCKS: the most one
    eth_getLogs may cover (-32005 beyond)."""
    for start in range(first, last + 1, MAX_LOG_BLOCKS):
        yield start, min(last, start + MAX_LOG_BLOCKS - 1)


class NotAChainNode(ValueError):
    """A URL that answers, but not as a needle-net chain node: unlike a node that is down,
    not worth retrying."""


NODE_INFO_FIELDS = ("chain_id", "contract", "abi")


def node_info(http: httpx.Client, url: str) -> dict:
    """The node's /info, or NotAChainNode naming what answered instead (a web page, a 404,
    another service's JSON), or why the URL cannot name one (no http://, a port past 65535,
    a query or fragment)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises for a port out of range (httpx would wrap it around)
        if parts.query or parts.fragment:
            raise ValueError("a query or fragment cannot precede the node's paths (/info, "
                             "/rpc, /blobs)")
    except ValueError as err:
        raise NotAChainNode(f"not a chain node URL: {url}: {err}") from None
    try:
        info = http.get(f"{url}/info").raise_for_status().json()
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as err:
        raise NotAChainNode(f"not a chain node URL: {url}: {err}") from None
    except httpx.HTTPStatusError as err:
        answer = f"HTTP {err.response.status_code}"
    except ValueError:  # not JSON, or not text
        answer = "no JSON"
    else:
        missing = [f for f in NODE_INFO_FIELDS if not isinstance(info, dict) or f not in info]
        if not missing:
            return info
        answer = f"without {missing[0]!r}"
    hint, base = "", url.rstrip("/")
    if answer == "HTTP 404" and base.endswith("/rpc"):  # the JSON-RPC path given
        hint = f"; give the node's own URL, {base.removesuffix('/rpc')}"
    raise NotAChainNode(f"{url} is not a needle-net chain node: its /info answered {answer}"
                        + hint)


class ChainClient:
    """Talk to one chain node: JSON-RPC at ``rpc_url``, blobs at ``rpc_url/blobs``."""

    def __init__(self, rpc_url: str, private_key: str | bytes | None = None,
                 timeout: float = 60.0, max_blob_bytes: int | None = None) -> None:
        self.url = rpc_url.rstrip("/")
        self.http = httpx.Client(timeout=timeout)
        self.info = node_info(self.http, self.url)
        self.w3 = Web3(KeepAliveProvider(self.url, timeout))
        self.chain_id = int(self.info["chain_id"])
        self.market = self.w3.eth.contract(
            address=Web3.to_checksum_address(self.info["contract"]), abi=self.info["abi"]
        )
        self.account = Account.from_key(private_key) if private_key is not None else None
        self._key = coincurve.PrivateKey(self.account.key) if self.account else None
        # the blob listener's port may not be reachable from here (a compose network
        # publishes only the RPC port): /blobs on the RPC port then serves the same store
        # None: the node's own limit, which it advertises (older nodes: the default one)
        self.max_blob_bytes = max_blob_bytes or self.info.get("max_blob_bytes",
                                                              DEFAULT_MAX_BLOB_BYTES)
        self.blobs = BlobClient(self.info.get("blob_url", f"{self.url}/blobs"),
                                self.max_blob_bytes, timeout, fallback_url=f"{self.url}/blobs")
        self.timeout = timeout
        self._nonce: int | None = None
        self._fee: tuple[float, int] | None = None
        self._has_long_poll = True
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return self.account.address

    def _next_nonce(self) -> int:
        if self._nonce is None:
            self._nonce = self.w3.eth.get_transaction_count(self.account.address, "pending")
        nonce = self._nonce
        self._nonce += 1
        return nonce

    def sign(self, fn_call, value: int = 0, gas: int | None = None) -> bytes:
        """Build and sign a contract call; returns the raw transaction bytes. Without `gas`
        the node estimates it (a call that would revert raises TransactionReverted)."""
        mark(f"client sign {fn_call.fn_name}")
        if gas is None:
            try:
                gas = fn_call.estimate_gas({"from": self.account.address, "value": value})
            except ContractLogicError as exc:
                raise TransactionReverted(f"{fn_call.fn_name} would revert: {exc}") from exc
        data = call_data(fn_call)
        # the fee first: asking the node for it after taking a nonce lost that nonce when the
        # node was unreachable, and every later transaction then waited behind the gap (a
        # worker's commits after an outage: never mined, the claim expired)
        max_fee = self._max_fee()
        with self._lock:
            nonce = self._next_nonce()
        raw = sign_dynamic_fee(self._key, chain_id=self.chain_id, nonce=nonce,
                               max_fee=max_fee, max_priority_fee=0, gas=gas,
                               to=bytes.fromhex(fn_call.address[2:]), value=value, data=data)
        mark(f"client signed {fn_call.fn_name}")
        return raw

    def _max_fee(self) -> int:
        """Twice the node's gas price, asked at most every FEE_REFRESH_S: the base fee moves
        by at most 1/8 per block, so the margin covers several blocks."""
        now, fee = time.monotonic(), self._fee  # one read: forget_nonce may clear it
        if fee is None or now - fee[0] > FEE_REFRESH_S:
            fee = self._fee = (now, self.w3.eth.gas_price * 2)
        return fee[1]

    def wait_for_block(self, number: int, timeout: float) -> int:
        """Wait until block `number` is sealed or `timeout` seconds pass; returns the head.
        Uses the node's long poll (GET /wait) where it has one, else polls."""
        answer = self._long_poll({"block": number, "timeout": timeout})
        if answer is not None:
            return answer["head"]
        return self._poll_for_block(number, timeout)

    def _poll_for_block(self, number: int, timeout: float) -> int:
        end = time.monotonic() + timeout
        while (head := self.w3.eth.block_number) < number and time.monotonic() < end:
            time.sleep(POLL_S)
        return head

    def wait_for_logs(self, number: int, timeout: float) -> tuple[int, list | None]:
        """`wait_for_block`, then (head, the market's logs in blocks `number`..head as JSON,
        as eth_getLogs answers), or (head, None) if block `number` did not come. The node's
        long poll carries the logs; elsewhere they are asked for."""
        answer = self._long_poll({"block": number, "timeout": timeout,
                                  "logs": self.market.address})
        if answer is None:
            head = self._poll_for_block(number, timeout)
        elif "logs" in answer:
            return answer["head"], answer["logs"]
        else:
            head = answer["head"]
        return (head, None) if head < number else (head, self.raw_logs(number, head))

    def raw_logs(self, first: int, last: int) -> list[dict]:
        """eth_getLogs of the market over blocks `first`..`last`, as JSON (decoders take
        it as it is: web3's formatting of every field is not needed), asked for in spans of
        MAX_LOG_BLOCKS: the node refuses (-32005) a query over more, and a worker starting
        on a longer chain, or a client waiting on jobs submitted that many blocks before,
        failed every poll."""
        logs: list[dict] = []
        for start, end in log_spans(first, last):
            answer = self.w3.provider.make_request("eth_getLogs", [{
                "address": self.market.address, "fromBlock": hex(start), "toBlock": hex(end)}])
            if "error" in answer:
                raise ValueError(f"eth_getLogs failed: {answer['error']}")
            logs += answer["result"]
        return logs

    def request(self, method: str, params: list):
        """One JSON-RPC request straight through the provider: its result; Web3RPCError with
        the node's message if it answers an error (ContractLogicError for a revert, as web3
        raises it)."""
        answer = self.w3.provider.make_request(method, params)
        if "error" in answer:
            error = answer["error"]
            if error.get("code") == 3:
                raise ContractLogicError(error.get("message", "execution reverted"),
                                         data=error.get("data"))
            raise Web3RPCError(f"{method} failed: {error}", rpc_response=answer)
        return answer["result"]

    def call(self, fn_call, block: int | str = "latest"):
        """A contract view's result as web3's ``fn_call.call()`` returns it (one output as
        itself, several as a list, addresses checksummed), from one eth_call: web3's call
        pipeline cost ~5 ms of CPU per call here, against ~0.5 (it also asks eth_chainId
        every time)."""
        output = self.request("eth_call", [
            {"to": fn_call.address, "data": "0x" + call_data(fn_call).hex()},
            block if isinstance(block, str) else hex(block)])
        types = [o["type"] for o in fn_call.abi["outputs"]]
        values = [checksummed(v) if t == "address" else v
                  for t, v in zip(types, abi_decode(types, bytes.fromhex(output[2:])),
                                  strict=True)]
        return values[0] if len(values) == 1 else values

    def balance(self, address: str) -> int:
        """An account's balance in wei at the head."""
        return int(self.request("eth_getBalance", [address, "latest"]), 16)

    def _long_poll(self, params: dict, raw: bytes | None = None) -> dict | None:
        """GET /wait, or POST /wait sending `raw` first (on this thread's keep-alive
        connection; the wait is capped below the socket timeout): the node's answer, its gas
        price kept for signing; None where the node has no long poll (another EVM node)."""
        if not self._has_long_poll:
            return None
        params = {**params, "timeout": min(params["timeout"], self.timeout / 2)}
        url = f"{self.w3.provider.connections.prefix}/wait?{urlencode(params, doseq=True)}"

        def send(conn):
            if raw is None:
                conn.request("GET", url)
            else:
                conn.request("POST", url, json.dumps("0x" + raw.hex()),
                             {"Content-Type": "application/json"})
            # read whole inside the connection's guard: a Ctrl-C in the read otherwise left
            # the rest of this answer on the connection the thread's next request took
            response = conn.getresponse()
            return response.status, response.read()

        status, body = self.w3.provider.connections.request(send)
        mark(f"client long poll returned {params.get('block', 'tx')}")
        if status == 404:
            self._has_long_poll = False
            return None
        if status != 200:
            raise ConnectionError(f"{'GET' if raw is None else 'POST'} /wait answered HTTP "
                                  f"{status}: {body[:200]!r}")
        answer = json.loads(body)
        if "gas_price" in answer:
            self._fee = (time.monotonic(), int(answer["gas_price"]) * 2)
        return answer

    def wait_for_receipt(self, tx_hash: bytes):
        """The receipt of a sent transaction: one long poll until it is mined (its answer
        carries the receipt), then block by block (TimeoutError after self.timeout s)."""
        end = time.monotonic() + self.timeout
        answer = self._long_poll({"tx": "0x" + tx_hash.hex(), "timeout": self.timeout})
        if answer is not None and answer.get("receipt") is not None:
            mark("client receipt")
            return formatted_receipt(answer["receipt"])
        head = self.w3.eth.block_number if answer is None else answer["head"]
        while True:
            receipt = self.receipt(tx_hash)
            if receipt is not None:
                mark("client receipt")
                return receipt
            if time.monotonic() > end:
                raise TimeoutError(f"transaction 0x{tx_hash.hex()} not mined after "
                                   f"{self.timeout:.0f}s")
            head = self.wait_for_block(head + 1, max(0.0, end - time.monotonic()))

    def wait_for_receipts(self, tx_hashes: list[bytes]) -> list:
        """The receipts of several sent transactions: one long poll until all are mined (its
        answer carries them), then `wait_for_receipt` for any it did not bring (a node
        whose long poll takes one transaction answers for one)."""
        answer = self._long_poll({"tx": ["0x" + h.hex() for h in tx_hashes],
                                  "timeout": self.timeout})
        return self._receipts_in(answer, tx_hashes)

    def _receipts_in(self, answer: dict | None, tx_hashes: list[bytes]) -> list:
        """The receipts a long poll's answer carries, `wait_for_receipt` for the others."""
        found = (answer or {}).get("receipts") or [None] * len(tx_hashes)
        if len(found) != len(tx_hashes):
            found = [None] * len(tx_hashes)
        mark("client receipts")
        return [self.wait_for_receipt(h) if r is None else formatted_receipt(r)
                for h, r in zip(tx_hashes, found, strict=True)]

    def send_and_wait(self, raw: bytes, after: list[bytes] = ()) -> tuple[bytes, list]:
        """Send a raw transaction and wait for the receipts of transactions sent already
        (`after`) and then its own: (its hash, the receipts). One POST /wait where the node
        advertises it (/info), else eth_sendRawTransaction and the long poll; a poll that
        times out goes on as `wait_for_receipt`. Web3RPCError if the node refuses it."""
        after = list(after)
        answer = None
        if self.info.get("send_and_wait"):
            answer = self._long_poll({"tx": ["0x" + h.hex() for h in after],
                                      "timeout": self.timeout}, raw)
        if answer is None:  # no POST /wait (a 404 admits nothing): the two requests
            tx_hash = self.send_raw(raw)
            return tx_hash, self.wait_for_receipts([*after, tx_hash])
        if "error" in answer:
            raise _refused(answer)
        tx_hash = bytes.fromhex(answer["hash"][2:])
        return tx_hash, self._receipts_in(answer, [*after, tx_hash])

    def receipt(self, tx_hash: bytes):
        """A transaction's receipt; None while it is pending or unknown."""
        try:
            return self.w3.eth.get_transaction_receipt(tx_hash)
        except TransactionNotFound:
            return None

    def post(self, fn_call, value: int = 0, gas: int | None = None) -> bytes:
        """Sign and send a contract call without waiting for it; its hash."""
        return self.post_signed(fn_call, self.sign(fn_call, value=value, gas=gas))

    def post_signed(self, fn_call, raw: bytes) -> bytes:
        """Send a transaction `sign` made for `fn_call`; its hash."""
        try:
            tx_hash = self.send_raw(raw)
            mark(f"client sent {fn_call.fn_name}")
            return tx_hash
        except Exception:
            self.forget_nonce()
            raise

    def forget_nonce(self) -> None:
        """Ask the node for the next nonce (and fee) again: a transaction `sign` made was not
        sent, or may not have been taken. Under the lock `sign` takes: between its read of
        the nonce and its increment this made None + 1."""
        with self._lock:
            self._nonce = None
            self._fee = None

    def send_raw(self, raw: bytes) -> bytes:
        """eth_sendRawTransaction straight through the provider (web3's method pipeline
        around it cost ~0.4 ms of client CPU per call here); the transaction's hash.
        Web3RPCError with the node's message if the node refuses it."""
        answer = self.w3.provider.make_request("eth_sendRawTransaction", ["0x" + raw.hex()])
        if "error" in answer:
            raise _refused(answer)
        return bytes.fromhex(answer["result"][2:])

    def confirm_all(self, posted: list[tuple]) -> list:
        """Wait for several posted calls, (fn_call, tx_hash) each (sent without value),
        with one long poll: their receipts in order; TransactionReverted for the first
        that reverted."""
        receipts = self.wait_for_receipts([tx_hash for _, tx_hash in posted])
        return [self._succeeded(fn_call, tx_hash, 0, receipt)
                for (fn_call, tx_hash), receipt in zip(posted, receipts, strict=True)]

    def _succeeded(self, fn_call, tx_hash: bytes, value: int, receipt):
        if receipt["status"] != 1:
            raise TransactionReverted(f"{fn_call.fn_name} reverted in tx 0x{tx_hash.hex()}"
                                      f"{self._revert_reason(fn_call, value, receipt)}")
        return receipt

    def send_signed(self, fn_call, raw: bytes, value: int = 0, after: list[tuple] = ()) -> list:
        """Send a transaction `sign` made for `fn_call` and `confirm_all` it with calls posted
        before it, (fn_call, tx_hash) each (sent without value): their receipts and then its
        own, from one request where the node allows; TransactionReverted for the first that
        reverted."""
        try:
            tx_hash, receipts = self.send_and_wait(raw, [h for _, h in after])
        except Web3RPCError as err:
            self.forget_nonce()
            tx_hash = keccak(raw)
            if not self._sent_before(err, tx_hash):
                raise
            # a resend of this very transaction, whose first send's answer was lost: it is
            # pending or mined, so its receipt is what the caller wants, not the refusal
            receipts = self.wait_for_receipts([*(h for _, h in after), tx_hash])
        except Exception:
            self.forget_nonce()
            raise
        mark(f"client sent and confirmed {fn_call.fn_name}")
        calls = [(c, h, 0) for c, h in after] + [(fn_call, tx_hash, value)]
        return [self._succeeded(c, h, v, receipt)
                for (c, h, v), receipt in zip(calls, receipts, strict=True)]

    def send(self, fn_call, value: int = 0, gas: int | None = None):
        """Sign, send and wait for a contract call; raises TransactionReverted on status 0.
        A refusal because another client (a second process with this key) took the nonce
        (`nonce_taken`) means the call did not run: it is signed once more with the node's
        next nonce."""
        try:
            return self.send_signed(fn_call, self.sign(fn_call, value=value, gas=gas),
                                    value)[-1]
        except Web3RPCError as err:
            if not nonce_taken(err):
                raise
        return self.send_signed(fn_call, self.sign(fn_call, value=value, gas=gas), value)[-1]

    def _sent_before(self, refusal: Web3RPCError, tx_hash: bytes) -> bool:
        """Whether the node refused a transaction because this very one (same hash) is
        already pending or mined, rather than another with its nonce."""
        message = str(refusal)
        if "already known" in message:
            return True
        return "nonce too low" in message and self.receipt(tx_hash) is not None

    def _revert_reason(self, fn_call, value: int, receipt) -> str:
        """Why a mined transaction reverted: the call replayed on the state before its block
        (a transaction sent with fixed gas skipped the estimate that would have said)."""
        try:
            fn_call.call({"from": self.account.address, "value": value},
                         block_identifier=receipt["blockNumber"] - 1)
        except ContractLogicError as exc:  # its message: str() is a tuple with the hex data
            return f": {exc.message or exc}"
        except Exception:  # noqa: BLE001 - the reason is a courtesy; the revert stands
            return ""
        return " (out of gas, or the state changed within its block)"

    def events(self, receipt, name: str) -> list:
        """Decoded events called ``name`` emitted by the market in a receipt."""
        from web3.logs import DISCARD

        return list(getattr(self.market.events, name)().process_receipt(receipt, errors=DISCARD))

    def put_blob(self, array_or_bytes: np.ndarray | bytes) -> bytes:
        """Upload an array (or encoded blob) to the node's blob store; returns its 32-byte id."""
        if isinstance(array_or_bytes, bytes):
            return self.blobs.put(array_or_bytes)
        return self.blobs.put_array(array_or_bytes)

    def get_blob_bytes(self, id_: bytes | str) -> memoryview:
        """Download a blob and check that its bytes hash to the id (KeyError if missing)."""
        return self.blobs.get(parse_id(id_))

    def get_blob(self, id_: bytes | str) -> np.ndarray:
        return decode_array(self.get_blob_bytes(id_))

    def get_job(self, job_id: int) -> dict:
        """The market's view of a job, as a dict keyed like the getJob tuple."""
        values = self.call(self.market.functions.getJob(job_id))
        return dict(zip(JOB_FIELDS, values, strict=True))

    def close(self) -> None:
        self.blobs.close()
        self.w3.provider.connections.close()
        self.http.close()


def nonce_taken(refusal: Web3RPCError) -> bool:
    """Whether the node refused a transaction because another one from its sender (a second
    client with this key) took its nonce: mined already ("nonce too low"), or pending and
    not replaceable. The refused transaction never runs (`send_signed` has already told a
    resend of this very transaction from these), so it may be signed again with the next
    nonce without paying twice."""
    message = str(refusal)
    return "nonce too low" in message or "already used by a pending transaction" in message


def _refused(answer: dict) -> Web3RPCError:
    """The error for a raw transaction the node refused (eth_sendRawTransaction's answer,
    or POST /wait's)."""
    return Web3RPCError(f"eth_sendRawTransaction refused: {answer['error']}",
                        rpc_response=answer)


@functools.lru_cache(maxsize=4096)
def checksummed(address: str) -> str:
    """EIP-55 form (a keccak each, ~65 us: the same few addresses recur)."""
    return to_checksum_address(address)


def formatted_receipt(receipt: dict) -> AttributeDict:
    """A JSON-RPC receipt (from a long poll's answer) as web3 returns receipts: the values
    its receipt formatter gives, then attribute access. Its generic formatter pipeline cost
    ~0.5 ms for a receipt with two logs, and a job's path reads three; this does the same
    conversions directly. A receipt whose fields are not the hex strings the node sends
    goes through web3's formatter."""
    try:
        out = _converted(receipt, RECEIPT_INTS, ("blockHash", "transactionHash"))
        out["logsBloom"] = HexBytes(receipt["logsBloom"])
        for key in ("from", "to", "contractAddress"):
            if receipt.get(key) is not None:
                out[key] = checksummed(receipt[key])
        out["logs"] = [_converted(log, LOG_INTS, ("blockHash", "transactionHash")) | {
            "address": checksummed(log["address"]), "data": HexBytes(log["data"]),
            "topics": [_bytes32(t) for t in log["topics"]]} for log in receipt["logs"]]
    except (KeyError, TypeError, ValueError):
        out = receipt_formatter(receipt)
    return AttributeDict.recursive(out)


RECEIPT_INTS = ("blockNumber", "transactionIndex", "cumulativeGasUsed", "status", "gasUsed",
                "effectiveGasPrice", "type", "blobGasPrice", "blobGasUsed")
LOG_INTS = ("blockNumber", "transactionIndex", "logIndex")


def _converted(value: dict, ints: tuple[str, ...], hashes: tuple[str, ...]) -> dict:
    """`value` with its hex quantities `ints` as ints and its hashes as HexBytes (None stays;
    a field of another kind raises ValueError)."""
    out = dict(value)
    for key in ints:
        if out.get(key) is not None:
            if not (isinstance(out[key], str) and out[key].startswith("0x")):
                raise ValueError(f"{key} is not a hex quantity")
            out[key] = int(out[key], 16)
    for key in hashes:
        if out.get(key) is not None:
            out[key] = _bytes32(out[key])
    return out


def _bytes32(value: str) -> HexBytes:
    out = HexBytes(value)
    if len(out) != 32:
        raise ValueError("not a 32-byte hash")
    return out


JOB_FIELDS = (
    "submitter", "worker", "status", "aId", "bId", "cId", "batch", "m", "k", "n",
    "precision", "fee", "deadline", "commitBlock", "timeoutBlocks",
)
