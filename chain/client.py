"""A small web3 client for the market: signs locally, manages nonces, moves blobs."""
from __future__ import annotations

import threading

import httpx
import numpy as np
from eth_account import Account
from web3 import Web3
from web3.exceptions import ContractLogicError

from chain.blobhttp import BlobClient
from chain.blobs import decode_array, parse_id


class TransactionReverted(RuntimeError):
    """A transaction was mined but reverted (status 0), or would revert."""


class ChainClient:
    """Talk to one chain node: JSON-RPC at ``rpc_url``, blobs at ``rpc_url/blobs``."""

    def __init__(self, rpc_url: str, private_key: str | bytes | None = None,
                 timeout: float = 60.0, max_blob_bytes: int = 1 << 30) -> None:
        self.url = rpc_url.rstrip("/")
        self.http = httpx.Client(timeout=timeout)
        self.info = self.http.get(f"{self.url}/info").raise_for_status().json()
        self.w3 = Web3(Web3.HTTPProvider(self.url, request_kwargs={"timeout": timeout}))
        self.chain_id = int(self.info["chain_id"])
        self.market = self.w3.eth.contract(
            address=Web3.to_checksum_address(self.info["contract"]), abi=self.info["abi"]
        )
        self.account = Account.from_key(private_key) if private_key is not None else None
        self.blobs = BlobClient(self.info.get("blob_url", f"{self.url}/blobs"),
                                max_blob_bytes, timeout)
        self.timeout = timeout
        self._nonce: int | None = None
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
        """Build and sign a contract call; returns the raw transaction bytes."""
        tx = {
            "from": self.account.address,
            "value": value,
            "chainId": self.chain_id,
            "maxFeePerGas": self.w3.eth.gas_price * 2,
            "maxPriorityFeePerGas": 0,
        }
        if gas is not None:
            tx["gas"] = gas
        try:
            tx = fn_call.build_transaction(tx)
        except ContractLogicError as exc:
            raise TransactionReverted(f"{fn_call.fn_name} would revert: {exc}") from exc
        with self._lock:
            tx["nonce"] = self._next_nonce()
        return self.account.sign_transaction(tx).raw_transaction

    def send(self, fn_call, value: int = 0, gas: int | None = None):
        """Sign, send and wait for a contract call; raises TransactionReverted on status 0."""
        raw = self.sign(fn_call, value=value, gas=gas)
        try:
            tx_hash = self.w3.eth.send_raw_transaction(raw)
        except Exception:
            self._nonce = None  # resynchronise with the node on the next call
            raise
        receipt = self.w3.eth.wait_for_transaction_receipt(
            tx_hash, timeout=self.timeout, poll_latency=0.05
        )
        if receipt["status"] != 1:
            raise TransactionReverted(f"{fn_call.fn_name} reverted in tx {tx_hash.hex()}")
        return receipt

    def events(self, receipt, name: str) -> list:
        """Decoded events called ``name`` emitted by the market in a receipt."""
        from web3.logs import DISCARD

        return list(getattr(self.market.events, name)().process_receipt(receipt, errors=DISCARD))

    def put_blob(self, array_or_bytes: np.ndarray | bytes) -> bytes:
        """Upload an array (or encoded blob) to the node's blob store; returns its 32-byte id."""
        if isinstance(array_or_bytes, bytes):
            return self.blobs.put(array_or_bytes)
        return self.blobs.put_array(array_or_bytes)

    def get_blob_bytes(self, id_: bytes | str) -> bytearray:
        """Download a blob and check that its sha256 matches the id (KeyError if missing)."""
        return self.blobs.get(parse_id(id_))

    def get_blob(self, id_: bytes | str) -> np.ndarray:
        return decode_array(self.get_blob_bytes(id_))

    def get_job(self, job_id: int) -> dict:
        """The market's view of a job, as a dict keyed like the getJob tuple."""
        values = self.market.functions.getJob(job_id).call()
        return dict(zip(JOB_FIELDS, values, strict=True))

    def close(self) -> None:
        self.blobs.close()
        self.http.close()


JOB_FIELDS = (
    "submitter", "worker", "status", "aId", "bId", "cId", "batch", "m", "k", "n",
    "precision", "fee", "deadline", "commitBlock",
)
