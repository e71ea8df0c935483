"""Ethereum JSON-RPC over HTTP (POST / and /rpc), blob endpoints and /info, as one ASGI app."""
from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import json
import math
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from urllib.parse import parse_qs

import anyio
import numpy as np
import rlp
from eth._utils.address import generate_contract_address
from eth.constants import BLANK_ROOT_HASH, EMPTY_SHA3
from eth.exceptions import HeaderNotFound, OutOfGas, Revert, TransactionNotFound
from eth.rlp.accounts import Account
from eth.vm.spoof import SpoofTransaction
from eth.vm.stack import Stack
from eth_abi import decode as abi_decode
from eth_hash.auto import keccak
from eth_utils import to_checksum_address
from fastapi import FastAPI, Request
from trie import HexaryTrie
from trie.exceptions import MissingTrieNode

from chain.admission import calldata_floor_gas
from chain.blobhttp import BODY_TIMEOUT, CLOSE, BlobApp, BodyWatch, UploadStalled, json_reply
from chain.blobserver import blob_url
from chain.compile import compiled_market
from chain.node import PRIORITY_FEE, Node, TxRejected, recent_block_bytes
from chain.params import (
    CHAIN_ID,
    FREIVALDS_ADDRESS,
    MARKET_ADDRESS,
    MAX_LOG_BLOCKS,
    REWARD_POOL_ADDRESS,
)
from chain.timeline import mark
from chain.tries import MissingNode, encode_node

CLIENT_VERSION = "needle-net/0.1.0/py-evm-0.12.1b1"
REVERT_SELECTOR = bytes.fromhex("08c379a0")  # Error(string)
PANIC_SELECTOR = bytes.fromhex("4e487b71")  # Panic(uint256): Solidity's checks, assert
PANIC_REASONS = {  # geth's words for Solidity's panic codes
    0x00: "generic panic", 0x01: "assert(false)", 0x11: "arithmetic underflow or overflow",
    0x12: "division or modulo by zero", 0x21: "enum overflow",
    0x22: "invalid encoded storage byte array accessed",
    0x31: "out-of-bounds array access; popping on an empty array",
    0x32: "out-of-bounds access of an array or bytesN", 0x41: "out of memory",
    0x51: "uninitialized function",
}
FILTER_TTL = 300.0
# eth_createAccessList's traces at most: each pass runs the call with the last pass's list;
# a path that keeps changing its list with it gets the last one (its gas is still the real one)
ACCESS_LIST_PASSES = 8
UINT256_LIMIT = 2**256  # quantities (values, slots, block numbers) are below it
MAX_TOPICS = 4  # LOG0..LOG4: a filter with more positions can match nothing (geth refuses it)
# JSON nested deeper than this is refused before it is parsed: json's C scanner recurses once
# per level, and with the recursion limit py_ecc sets (100,000) a body of ~100k '[' (200 kB)
# overflowed the C stack and killed the node. A JSON-RPC request nests a handful of levels.
MAX_JSON_DEPTH = 256
# requests one batch may hold (geth: 1000): every item runs, so a batch of 10^5 calls or full
# blocks held the node for minutes and built a reply of hundreds of MB
MAX_BATCH = 4096
# seconds of EVM execution (eth_call, eth_estimateGas) one HTTP request may spend, over all
# of its batch (geth's --rpc.evmtimeout is 5 s a call): execution holds the node's lock, and
# a call of the block's 2e9 gas of cheap opcodes ran for ~10 minutes, stalling the chain
RPC_EVM_TIMEOUT = 5.0
DEADLINE_CHECK_POPS = 1024  # stack pops between two looks at the clock
# a block parameter this long ("0x" and 32 bytes of hex) is a block hash, as geth reads it
# (BlockNumberOrHash): web3.py sends a block_identifier given as a hash this way, and it was
# read as a block number beyond the head ("block 1073...365 not found")
BLOCK_HASH_TEXT = 66
DYNAMIC_FEE_TX_TYPE = 2  # EIP-1559: the first type with maxFeePerGas
# storage keys one eth_getProof may prove: each is a walk of the storage trie under the lock
MAX_PROOF_KEYS = 1024
STORAGE_KEY_TEXT = re.compile(r"(0[xX])?[0-9a-fA-F]{0,64}")


class RpcError(Exception):
    def __init__(self, code: int, message: str, data: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


class UnknownBlock(RpcError):
    """A well-formed block number or hash this node has no canonical block for."""

    def __init__(self, message: str) -> None:
        super().__init__(-32000, message)


def invalid_params(message: str) -> RpcError:
    return RpcError(-32602, f"invalid params: {message}")


def arity_problem(name: str, method: Callable, params: list) -> str | None:
    """What is wrong with the number of `params` of the JSON-RPC method `name`, naming a
    missing parameter (Python's own TypeError names the server's functions); None if their
    number fits."""
    accepted = inspect.signature(method).parameters.values()
    positional = [p for p in accepted if p.kind is p.POSITIONAL_OR_KEYWORD]
    missing = [p.name for p in positional[len(params):] if p.default is p.empty]
    if missing:
        return f"{name} is missing parameter {len(params) + 1} ({missing[0]})"
    if len(params) > len(positional) and all(p.kind is not p.VAR_POSITIONAL for p in accepted):
        return f"{name} takes at most {len(positional)} parameters, got {len(params)}"
    return None


def q(value: int) -> str:
    return hex(value)


def d(value: bytes) -> str:
    return "0x" + bytes(value).hex()


def addr(value: bytes | None) -> str | None:
    return checksummed(value) if value else None


@functools.lru_cache(maxsize=4096)
def checksummed(address: bytes) -> str:
    """EIP-55 form of an address (its keccak costs ~0.1 ms: the same few addresses come
    back in every receipt and log)."""
    return to_checksum_address(address)


HEX_QUANTITY = re.compile(r"0x[0-9a-fA-F]+")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as int8


def json_nesting_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `body` nests arrays/objects deeper than `limit` outside its strings, as json's
    scanner would recurse into them (for invalid JSON: up to its first error). Linear, in C
    (bytes methods and numpy): it runs before every parse of a large batch."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    # strings cannot hold a raw '"' or backslash outside an escape: drop escaped backslashes,
    # then escaped quotes, and every other piece between quotes is outside a string
    plain = bytes(body).replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(plain.split(b'"')[::2]).translate(None, _NOT_BRACKETS)
    steps = np.frombuffer(outside.translate(_BRACKET_STEPS), dtype=np.int8)
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0)) > limit


def _reject_constant(name: str):
    """json's parse_constant: NaN and Infinity are not JSON (RFC 8259); parsing them made ids
    and params the reply then wrote back as invalid JSON."""
    raise ValueError(f"{name} is not a JSON value")


def valid_id(rid) -> bool:
    """JSON-RPC 2.0: an id is a string, a number or null (a non-finite float cannot be
    written back as JSON)."""
    if rid is None or isinstance(rid, str) or type(rid) is int:
        return True
    return type(rid) is float and math.isfinite(rid)


def parse_quantity(value, name: str) -> int:
    """A 0x-prefixed hex string, or a JSON integer as some clients send; not a bool, a float
    or bare hex (Python's int() would take all three, and underscores and spaces too)."""
    if isinstance(value, str) and HEX_QUANTITY.fullmatch(value):
        number = int(value, 16)
    elif type(value) is int:
        number = value
    else:
        raise invalid_params(f"{name} must be a hex quantity, got {value!r}")
    if not 0 <= number < UINT256_LIMIT:
        raise invalid_params(f"{name} must be between 0 and 2**256-1, got {value!r}")
    return number


def parse_data(value, name: str, size: int | None = None) -> bytes:
    """0x-prefixed hex data; of exactly `size` bytes where given."""
    if not isinstance(value, str) or not value.startswith("0x"):
        raise invalid_params(f"{name} must be 0x-prefixed hex data")
    try:
        raw = bytes.fromhex(value[2:])
    except ValueError as exc:
        raise invalid_params(f"{name} is not hex") from exc
    if size is not None and len(raw) != size:
        raise invalid_params(f"{name} must be {size} bytes")
    return raw


def parse_bool(value, name: str) -> bool:
    """A JSON boolean, null read as false (as geth); anything else is invalid (bool() read
    the string "false" as true)."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid_params(f"{name} must be a boolean, got {value!r}")
    return value


def parse_address(value, name: str = "address") -> bytes:
    return parse_data(value, name, 20)


def parse_hash(value, name: str) -> bytes:
    return parse_data(value, name, 32)


def parse_storage_key(value) -> tuple[int, str]:
    """An eth_getProof storage key as geth reads it (hex of at most 32 bytes, 0x optional,
    an odd number of digits too), and the key as geth answers it: as sent for 32 bytes,
    else as a quantity."""
    if not isinstance(value, str) or not STORAGE_KEY_TEXT.fullmatch(value):
        raise invalid_params(f"storage key must be hex of at most 32 bytes, got {value!r}")
    digits = value[2:] if value[:2] in ("0x", "0X") else value
    slot = int(digits or "0", 16)
    return slot, ("0x" + f"{slot:064x}" if len(digits) > 62 else q(slot))


def trie_proof(db, root: bytes, key: bytes) -> list[str]:
    """geth's proof of `key` in the trie at `root` (EIP-1186): the RLP of the nodes on the
    key's path from the root down, where it ends or leaves the trie, less the nodes inlined
    in their parent (under 32 bytes). MissingTrieNode if the database lacks one."""
    nodes = [encode_node(node) for node in HexaryTrie(db, root).get_proof(key)]
    return [d(node) for i, node in enumerate(nodes) if i == 0 or len(node) >= 32]


def parse_log_filter(criteria) -> tuple[set[str] | None, list[set[str] | None]]:
    """The addresses (None: any) and the topic sets by position (None: any) a log filter
    asks for, as lower-case hex; a malformed filter is invalid params naming the field."""
    if not isinstance(criteria, dict):
        raise invalid_params("filter must be an object")
    addresses = criteria.get("address")
    if isinstance(addresses, str):
        addresses = [addresses]
    if not isinstance(addresses, list | None):
        raise invalid_params("address must be an address or an array of addresses")
    wanted = {d(parse_address(a)) for a in addresses} if addresses else None
    topics = criteria.get("topics") or []
    if not isinstance(topics, list):
        raise invalid_params("topics must be an array")
    if len(topics) > MAX_TOPICS:
        raise invalid_params(f"topics has {len(topics)} positions; a log has at most "
                             f"{MAX_TOPICS}")
    topic_sets = []
    for i, topic in enumerate(topics):
        name = f"topics[{i}]"
        if topic is None:
            topic_sets.append(None)
        elif isinstance(topic, list):  # any of these; an empty list matches any (as geth)
            options = {d(parse_hash(t, name)) for t in topic if t is not None}
            # a null among the options matches any topic there, as geth reads it
            topic_sets.append(None if not options or None in topic else options)
        else:
            topic_sets.append({d(parse_hash(topic, name))})
    if criteria.get("blockHash") is not None and (criteria.get("fromBlock") is not None
                                                   or criteria.get("toBlock") is not None):
        raise invalid_params("blockHash cannot be combined with fromBlock or toBlock (EIP-234)")
    return wanted, topic_sets


def parse_percentiles(value) -> list[float]:
    """eth_feeHistory's reward percentiles: numbers from 0 to 100, non-decreasing."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(
            isinstance(p, int | float) and not isinstance(p, bool) for p in value):
        raise invalid_params("rewardPercentiles must be an array of numbers")
    if not all(0 <= p <= 100 for p in value):
        raise invalid_params(f"rewardPercentiles must be between 0 and 100, got {value}")
    if any(later < earlier for earlier, later in itertools.pairwise(value)):
        raise invalid_params(f"rewardPercentiles must be non-decreasing, got {value}")
    return value


def parse_state_overrides(value) -> dict[bytes, dict]:
    """eth_call's and eth_estimateGas's state override set (geth's): by address, a new
    balance, nonce and code, and its whole storage (``state``) or some slots
    (``stateDiff``); None: none. They were accepted and ignored: the call ran on the
    unchanged state and answered as if they held."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid_params("state overrides must be an object keyed by address")
    parsed = {}
    for address, fields in value.items():
        name = f"state override of {address}"
        if not isinstance(fields, dict):
            raise invalid_params(f"{name} must be an object")
        if unknown := sorted(fields.keys() - OVERRIDE_FIELDS):
            raise invalid_params(f"{name}: unsupported fields {unknown}")
        if fields.get("state") is not None and fields.get("stateDiff") is not None:
            raise invalid_params(f"{name} has both state and stateDiff")
        parsed[parse_address(address, name)] = {
            key: None if fields.get(key) is None else parse(fields[key], f"{name}: {key}")
            for key, parse in OVERRIDE_FIELDS.items()}
    return parsed


def parse_storage(value, name: str) -> dict[int, int]:
    """A storage override: 32-byte slots to 32-byte values."""
    if not isinstance(value, dict):
        raise invalid_params(f"{name} must be an object of slots to values")
    return {int.from_bytes(parse_hash(slot, name), "big"):
            int.from_bytes(parse_hash(word, name), "big") for slot, word in value.items()}


def parse_nonce(value, name: str) -> int:
    """An account nonce: a quantity below 2**64 (EIP-2681)."""
    number = parse_quantity(value, name)
    if number >= 2**64:
        raise invalid_params(f"{name} must be below 2**64, got {value!r}")
    return number


OVERRIDE_FIELDS = {"balance": parse_quantity, "nonce": parse_nonce, "code": parse_data,
                   "state": parse_storage, "stateDiff": parse_storage}


def apply_state_overrides(state, overrides: dict[bytes, dict]) -> None:
    """Write ``parse_state_overrides``' set into a (costless, discarded) state, as if an
    earlier transaction had: original values and access lists start from it."""
    for account, fields in overrides.items():
        if fields["balance"] is not None:
            state.set_balance(account, fields["balance"])
        if fields["nonce"] is not None:
            state.set_nonce(account, fields["nonce"])
        if fields["code"] is not None:
            state.set_code(account, fields["code"])
        if fields["state"] is not None:
            state.delete_storage(account)
        for slot, word in (fields["state"] or fields["stateDiff"] or {}).items():
            state.set_storage(account, slot, word)
    state.lock_changes()


def parse_access_list(value) -> list[tuple[bytes, list[int]]]:
    """A call's EIP-2930 access list (geth's JSON: address and storageKeys); none if
    absent."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise invalid_params("accessList must be an array of objects")
    return [(parse_address(e.get("address"), "accessList address"),
             [int.from_bytes(parse_hash(k, "accessList storage key"), "big")
              for k in e.get("storageKeys") or []]) for e in value]


def record_accesses(state, accessed: dict[bytes, dict[int, None]]) -> None:
    """Gather in `accessed` every account and slot the state's EIP-2929 warm marks reach
    (opcodes, and the transaction's own pre-warmed ones), by address, in order; also those
    of frames that reverted later, as geth's access-list tracer."""
    mark_address, mark_slot = state.mark_address_warm, state.mark_storage_warm

    def address_warm(address: bytes):
        accessed.setdefault(address, {})
        return mark_address(address)

    def storage_warm(address: bytes, slot: int):
        accessed.setdefault(address, {})[slot] = None
        return mark_slot(address, slot)

    state.mark_address_warm, state.mark_storage_warm = address_warm, storage_warm


def created_addresses(computation) -> set[bytes]:
    """The contracts a computation and its children created."""
    created = {computation.msg.storage_address} if computation.msg.is_create else set()
    for child in computation.children:
        created |= created_addresses(child)
    return created


def access_list_json(accessed: dict[bytes, dict[int, None]], computation) -> list[dict]:
    """geth's access list of what a call accessed: accounts with the slots read or written,
    less those warm anyway (sender, recipient, precompiles, coinbase) and the contracts it
    created, unless their slots are listed."""
    msg = computation.msg
    warm = {msg.sender, msg.storage_address, computation.state.coinbase,
            *computation.precompiles, *created_addresses(computation)}
    return [{"address": checksummed(address),
             "storageKeys": [d(slot.to_bytes(32, "big")) for slot in slots]}
            for address, slots in accessed.items() if slots or address not in warm]


def costless_state(vm):
    """The state py-evm's ``vm.in_costless_state()`` gives (the block after the VM's header,
    with no base fee), without the revert that closes it: the state is dropped after the
    call anyway, and py-evm's journal cannot revert across the state overrides' locked-in
    changes (-32603 'No checkpoint ... was found' on the stock execution path)."""
    header = vm.get_header()
    child = vm.generate_block_from_parent_header_and_coinbase(header, header.coinbase).header
    previous = itertools.chain((header.hash,), vm.previous_hashes)
    return vm.build_state(vm.chaindb.db, child.copy(base_fee_per_gas=0), vm.chain_context,
                          previous)


def no_block_overrides(value) -> None:
    """geth's block overrides (a call's block number, time, ...) are not offered: refused,
    not ignored."""
    if value is not None:
        raise invalid_params("block overrides are not supported")


def new_filter_id() -> str:
    """A filter id no other filter had, across restarts too (random, as geth's): counted from
    1 at every start, a client polling its filter after a restart got another client's
    filter, of logs or of block hashes, instead of "not found" (which says to install it
    again), and any client could poll (and so drain) or uninstall its neighbours'."""
    return q(secrets.randbits(128) | 1 << 127)


def revert_reason(output: bytes) -> str | None:
    """The readable reason of revert data as geth words it: an Error(string)'s text, a
    Panic(uint256)'s meaning; None for other data (a custom error, none at all)."""
    try:
        if output[:4] == REVERT_SELECTOR:
            return abi_decode(["string"], output[4:])[0]
        if output[:4] == PANIC_SELECTOR:
            code = abi_decode(["uint256"], output[4:])[0]
            return PANIC_REASONS.get(code, f"unknown panic code: {code:#x}")
    except Exception:  # data that only starts like one: no reason, as geth
        return None
    return None


def revert_error(output: bytes) -> RpcError:
    """geth's answer to a reverted call: code 3, its reason in the message and its revert
    data; a revert without data has no data field (it had "0x")."""
    reason = revert_reason(output)
    message = "execution reverted" if reason is None else f"execution reverted: {reason}"
    return RpcError(3, message, d(output) if output else None)


def block_rewards(block, receipts: list, percentiles: list[float]) -> list[int]:
    """eth_feeHistory's rewards of one block, as geth computes them: the transactions'
    effective tips in ascending order, each percentile the tip of the transaction at which
    their gas used adds up to that share of the block's. Counting transactions instead
    gave each percentile the next one up (the 50th of two was the higher tip)."""
    if not block.transactions:
        return [0] * len(percentiles)
    base_fee, gas_before, by_tip = block.header.base_fee_per_gas, 0, []
    for tx, receipt in zip(block.transactions, receipts, strict=True):
        tip = min(tx.max_priority_fee_per_gas, tx.max_fee_per_gas - base_fee)
        by_tip.append((tip, receipt.gas_used - gas_before))
        gas_before = receipt.gas_used
    by_tip.sort(key=lambda tip_and_gas: tip_and_gas[0])
    index, gas_so_far, rewards = 0, by_tip[0][1], []
    for percentile in percentiles:
        threshold = int(block.header.gas_used * percentile / 100)
        while gas_so_far < threshold and index < len(by_tip) - 1:
            index += 1
            gas_so_far += by_tip[index][1]
        rewards.append(by_tip[index][0])
    return rewards


class ExecutionTimeout(Exception):
    """An RPC call ran past its deadline. Not a VMError, so py-evm does not record it as the
    call's outcome: it leaves the (discarded) costless state at once."""


_execution = threading.local()  # this thread's request: its EVM time left, a call's deadline


class DeadlineValues(list):
    """A stack's values whose ``pop`` looks at the call's deadline every DEADLINE_CHECK_POPS
    pops: every loop iteration (JUMP, JUMPI) and every call pops, and straight code is
    bounded by its size, so no execution outlives its deadline by much."""

    __slots__ = ("deadline", "countdown")

    def pop(self, *index):
        self.countdown -= 1
        if self.countdown <= 0:
            self.countdown = DEADLINE_CHECK_POPS
            if time.monotonic() > self.deadline:
                raise ExecutionTimeout
        return list.pop(self, *index)


class DeadlineStack(Stack):
    """py-evm's stack over DeadlineValues (its bound methods rebound to them)."""

    def __init__(self) -> None:
        super().__init__()
        values = DeadlineValues()
        values.deadline = getattr(_execution, "deadline", math.inf)
        values.countdown = DEADLINE_CHECK_POPS
        self.values, self._append, self._pop, self.__len__ = (
            values, values.append, values.pop, values.__len__)


@functools.cache
def deadline_computation(base: type) -> type:
    """``base`` (the VM's computation class) with DeadlineStack as every frame's stack."""

    class DeadlineComputation(base):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._stack = DeadlineStack()

    return DeadlineComputation


def entry_bytes(entry: tuple) -> int:
    """What a cached (block, receipts, JSON logs) holds, roughly: the node's measure of the
    block and receipts, plus the JSON logs' hex text."""
    block, receipts, logs = entry
    return recent_block_bytes(block, receipts) + sum(
        len(log["data"]) + 67 * len(log["topics"]) for log in logs)


class BlockCache:
    """Blocks with their receipts and JSON logs, by number; the most recent ones kept, up to
    `size` blocks holding up to `transactions` transactions and `max_bytes` (`entry_bytes`)
    in all. By block count alone (~2.3 KB per transaction) full blocks of 5,000 transactions
    could take ~20 GB; by transactions alone, 100,000 of 128 KiB calldata each ~12 GB."""

    def __init__(self, node: Node, size: int = 2048, transactions: int = 100_000,
                 max_bytes: int = 256 << 20) -> None:
        self.node, self.size, self.max_transactions = node, size, transactions
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, tuple] = OrderedDict()
        self.transactions = 0  # in the blocks kept
        self.bytes = 0  # entry_bytes of the blocks kept

    def get(self, number: int) -> tuple:
        entry = self.entries.get(number)
        if entry is None or entry[0].hash != self.node.chain.get_canonical_block_hash(number):
            block = self.node.chain.get_canonical_block_by_number(number)
            receipts = block.get_receipts(self.node.chain.chaindb)
            entry = (block, receipts, self._logs(block, receipts))
            self._keep(number, entry)
        return entry

    def _keep(self, number: int, entry: tuple) -> None:
        """Cache `entry`, dropping the oldest blocks beyond the two limits (never the last)."""
        replaced = self.entries.pop(number, None)
        if replaced is not None:
            self._count(replaced, -1)
        self.entries[number] = entry
        self._count(entry, 1)
        while len(self.entries) > 1 and (len(self.entries) > self.size
                                         or self.transactions > self.max_transactions
                                         or self.bytes > self.max_bytes):
            self._count(self.entries.popitem(last=False)[1], -1)

    def _count(self, entry: tuple, sign: int) -> None:
        self.transactions += sign * len(entry[0].transactions)
        self.bytes += sign * entry_bytes(entry)

    def sealed(self, number: int) -> tuple | None:
        """Like ``get`` for a block among the node's recent ones (None otherwise), without
        the node's lock: long polls answer while the next block is sealing."""
        found = self.node.recent.get(number)
        if found is None:
            return None
        entry = self.entries.get(number)
        if entry is None or entry[0].hash != found[0].hash:
            entry = (*found, self._logs(*found))
            self._keep(number, entry)
        return entry

    @staticmethod
    def _logs(block, receipts) -> list[dict]:
        logs, counter = [], itertools.count()
        for index, (tx, receipt) in enumerate(zip(block.transactions, receipts, strict=True)):
            for entry in receipt.logs:
                logs.append({
                    "address": addr(entry.address),
                    "topics": [d(t.to_bytes(32, "big")) for t in entry.topics],
                    "data": d(entry.data),
                    "blockNumber": q(block.number),
                    "blockHash": d(block.hash),
                    "transactionHash": d(tx.hash),
                    "transactionIndex": q(index),
                    "logIndex": q(next(counter)),
                    "removed": False,
                })
        return logs


class Rpc:
    """The JSON-RPC method table over one node."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.blocks = BlockCache(node)
        self.filters: dict[str, dict] = {}
        self.methods: dict[str, Callable] = {
            name[4:].replace("__", "_"): getattr(self, name)
            for name in dir(self) if name.startswith("rpc_")
        }

    # --- dispatch ------------------------------------------------------------------------------
    def handle(self, payload) -> dict | list | None:
        _execution.left = RPC_EVM_TIMEOUT  # this request's EVM time, shared by its batch
        try:
            return self._handle(payload)
        finally:
            del _execution.left  # a call made outside a request gets a budget of its own

    def _handle(self, payload) -> dict | list | None:
        if isinstance(payload, list):
            if not payload:
                return self._error(None, RpcError(-32600, "invalid request: empty batch"))
            if len(payload) > MAX_BATCH:
                return self._error(None, RpcError(
                    -32600, f"invalid request: batch of {len(payload)} requests; at most "
                            f"{MAX_BATCH}"))
            decoded = self._decode_raw_transactions(payload)
            replies = [self._one(item, decoded.get(i)) for i, item in enumerate(payload)]
            # a batch of notifications only is answered with nothing, not [] (JSON-RPC 2.0)
            return [r for r in replies if r is not None] or None
        return self._one(payload)

    def _decode_raw_transactions(self, batch: list) -> dict:
        """The batch's eth_sendRawTransaction payloads decoded together (by the node's decoder
        process when there are many), by position in the batch; malformed requests are left
        to ``_one`` to report."""
        raws = {}
        for i, item in enumerate(batch):
            if isinstance(item, dict) and item.get("method") == "eth_sendRawTransaction" \
                    and isinstance(item.get("params"), list) and len(item["params"]) == 1:
                try:
                    raws[i] = parse_data(item["params"][0], "transaction")
                except RpcError:
                    continue
        return dict(zip(raws, self.node.decode_many(list(raws.values())), strict=True))

    def _one(self, request, decoded=None) -> dict | None:
        """One request's reply; None for a notification (no id), which JSON-RPC 2.0 never
        answers, not even with an error (it still runs). A request that is not a valid
        request object at all is answered -32600 with id null."""
        if not isinstance(request, dict) or not isinstance(request.get("method"), str):
            return self._error(None, RpcError(-32600, "invalid request: expected an object "
                                                      "with a method"))
        if request.get("jsonrpc") != "2.0":
            return self._error(None, RpcError(-32600, 'invalid request: "jsonrpc" must be '
                                                      '"2.0"'))
        rid = request.get("id")
        if not valid_id(rid):
            return self._error(None, RpcError(-32600, "invalid request: id must be a string, "
                                                      "a number or null"))
        reply = self._reply(request, rid, decoded)
        return reply if "id" in request else None

    def _reply(self, request: dict, rid, decoded) -> dict:
        params = request.get("params")
        if params is None:  # omitted, or null as geth also takes it
            params = []
        if not isinstance(params, list):
            return self._error(rid, invalid_params("params must be an array"))
        method = self.methods.get(request["method"])
        if method is None:
            return self._error(rid, RpcError(-32601, f"method {request['method']} not found"))
        try:
            if decoded is not None:  # a raw transaction of a batch, decoded already
                if isinstance(decoded, TxRejected):
                    raise decoded
                result = d(self.node.admit_decoded(decoded))
            elif method == self.rpc_eth__sendRawTransaction:  # decodes and recovers unlocked
                result = method(*params)
            else:
                with self.node.lock:
                    result = method(*params)
        except RpcError as exc:
            return self._error(rid, exc)
        except TypeError as exc:
            problem = arity_problem(request["method"], method, params)
            return self._error(rid, invalid_params(problem or str(exc)))
        except TxRejected as exc:
            return self._error(rid, RpcError(-32000, str(exc)))
        except MissingNode as exc:  # a damaged database, not a bug: say what is missing
            return self._error(rid, RpcError(-32000, f"missing trie node {d(exc.args[0])}: "
                                                     "this block's state is not held"))
        except Exception as exc:  # a bug must not kill the server: report it to the caller
            return self._error(rid, RpcError(-32603, f"internal error: {exc!r}"))
        return {"jsonrpc": "2.0", "id": rid, "result": result}

    @staticmethod
    def _error(rid, exc: RpcError) -> dict:
        error = {"code": exc.code, "message": exc.message}
        if exc.data is not None:
            error["data"] = exc.data
        return {"jsonrpc": "2.0", "id": rid, "error": error}

    # --- helpers -------------------------------------------------------------------------------
    def header_at(self, tag="latest"):
        """The header a block parameter names (a tag, a number, or EIP-1898's object);
        UnknownBlock if this node has no such block."""
        chain = self.node.chain
        if isinstance(tag, str) and len(tag) == BLOCK_HASH_TEXT:  # web3's block_identifier=hash
            tag = {"blockHash": tag}
        if isinstance(tag, dict):
            if "blockHash" in tag:
                block_hash = parse_hash(tag["blockHash"], "blockHash")
                try:
                    return chain.get_block_header_by_hash(block_hash)
                except HeaderNotFound:
                    raise UnknownBlock(f"block {d(block_hash)} not found") from None
            tag = tag.get("blockNumber", "latest")
        if tag in ("latest", "pending", "safe", "finalized", None):
            return self.node.head()
        if tag == "earliest":
            return chain.get_canonical_block_header_by_number(0)
        number = parse_quantity(tag, "block")
        if number > self.node.head().block_number:
            raise UnknownBlock(f"block {number} not found (head is "
                               f"{self.node.head().block_number})")
        return chain.get_canonical_block_header_by_number(number)

    def _spoof(self, call: dict, state, gas_cap: int):
        if not isinstance(call, dict):
            raise invalid_params("call must be an object")
        sender = parse_address(call["from"], "from") if call.get("from") else b"\x00" * 20
        to = parse_address(call["to"], "to") if call.get("to") else b""
        given = {name: parse_data(call[name], name) for name in ("input", "data")
                 if call.get(name) is not None}
        if len(set(given.values())) > 1:  # geth's rule: which one ran went unsaid
            raise invalid_params('both "data" and "input" are set and not equal; use "input" '
                                 "to pass the call data")
        data = given.get("input", given.get("data", b""))
        gas = parse_quantity(call["gas"], "gas") if call.get("gas") else gas_cap
        value = parse_quantity(call.get("value", "0x0"), "value")
        if value > state.get_balance(sender):  # geth's words, which web3 reports as such
            raise RpcError(-32000, "insufficient funds for transfer")
        access_list = parse_access_list(call.get("accessList"))
        vm = self.node.chain.get_vm(self.node.head())
        fields = dict(nonce=state.get_nonce(sender), gas_price=0, gas=min(gas, gas_cap), to=to,
                      value=value, data=data)
        if access_list:  # geth runs a call with its access list (warm, and paid for)
            tx = vm.get_transaction_builder().new_unsigned_access_list_transaction(
                chain_id=CHAIN_ID, access_list=access_list, **fields)
        else:
            tx = vm.create_unsigned_transaction(**fields)
        if tx.gas < tx.intrinsic_gas:  # py-evm would fail on a negative message gas (-32603)
            raise RpcError(-32000, f"intrinsic gas too low: gas {tx.gas} < intrinsic gas "
                                   f"{tx.intrinsic_gas}")
        return SpoofTransaction(tx, from_=sender)

    def _execute(self, call: dict, tag, allowance: int | None = None,
                 overrides: dict | None = None):
        """Run a call in the context of the block after ``tag`` (costless, discarded), with
        at most ``allowance`` gas where given (eth_estimateGas's cap), on the state with
        ``parse_state_overrides``' `overrides`; a failed execution is raised as its
        RpcError."""
        tx, computation = self._run(call, tag, allowance, overrides)
        if computation.is_error:
            if isinstance(computation.error, Revert):
                raise revert_error(computation.output)
            if allowance is not None and isinstance(computation.error, OutOfGas):
                raise RpcError(-32000, f"gas required exceeds allowance ({tx.gas})")
            raise RpcError(-32000, f"execution failed: {computation.error!r}")
        return tx, computation

    def _run(self, call: dict, tag, allowance: int | None = None, overrides: dict | None = None,
             accessed: dict | None = None):
        """``_execute``'s run: the transaction and its computation, failed or not; within
        what is left of the request's RPC_EVM_TIMEOUT. ``accessed``: filled by
        ``record_accesses``."""
        header = self.header_at(tag)
        shared = getattr(_execution, "left", None)  # None: not within a request (handle)
        left = RPC_EVM_TIMEOUT if shared is None else shared
        if left <= 0:
            raise RpcError(-32000, f"execution aborted (timeout = {RPC_EVM_TIMEOUT:g}s): "
                                   "this request's execution time is spent")
        started = time.monotonic()
        _execution.deadline = started + left
        try:
            state = costless_state(self.node.chain.get_vm(header))
            if overrides:
                apply_state_overrides(state, overrides)
            tx = self._spoof(call, state, min(header.gas_limit, allowance or header.gas_limit))
            if accessed is not None:
                record_accesses(state, accessed)
            state.computation_class = deadline_computation(state.computation_class)
            computation = state.costless_execute_transaction(tx)
        except ExecutionTimeout:
            raise RpcError(-32000, f"execution aborted (timeout = {RPC_EVM_TIMEOUT:g}s)") \
                from None
        finally:
            if shared is not None:
                _execution.left = left - (time.monotonic() - started)
            _execution.deadline = math.inf
        return tx, computation

    def _block_json(self, block, full: bool) -> dict:
        h = block.header
        txs = [self._tx_json(tx, block, i) if full else d(tx.hash)
               for i, tx in enumerate(block.transactions)]
        return {
            "number": q(h.block_number), "hash": d(h.hash), "parentHash": d(h.parent_hash),
            "nonce": d(h.nonce), "sha3Uncles": d(h.uncles_hash),
            "logsBloom": d(h.bloom.to_bytes(256, "big")), "transactionsRoot": d(h.transaction_root),
            "stateRoot": d(h.state_root), "receiptsRoot": d(h.receipt_root),
            "miner": addr(h.coinbase), "difficulty": q(h.difficulty), "totalDifficulty": q(0),
            "extraData": d(h.extra_data), "size": q(len(rlp.encode(block))),
            "gasLimit": q(h.gas_limit), "gasUsed": q(h.gas_used), "timestamp": q(h.timestamp),
            "transactions": txs, "uncles": [], "baseFeePerGas": q(h.base_fee_per_gas),
            "mixHash": d(h.mix_hash), "withdrawals": [], "withdrawalsRoot": d(h.withdrawals_root),
            "blobGasUsed": q(h.blob_gas_used), "excessBlobGas": q(h.excess_blob_gas),
            "parentBeaconBlockRoot": d(h.parent_beacon_block_root),
            "requestsHash": d(h.requests_hash),
        }

    @staticmethod
    def _tx_json(tx, block=None, index: int | None = None) -> dict:
        base_fee = block.header.base_fee_per_gas if block is not None else None
        out = {
            "hash": d(tx.hash), "nonce": q(tx.nonce), "from": addr(tx.sender),
            "to": addr(tx.to) if tx.to else None, "value": q(tx.value), "gas": q(tx.gas),
            "input": d(tx.data), "type": q(tx.type_id or 0), "chainId": q(tx.chain_id),
            "v": q(tx.y_parity if tx.type_id else tx.v), "r": q(tx.r), "s": q(tx.s),
            "blockHash": d(block.hash) if block is not None else None,
            "blockNumber": q(block.number) if block is not None else None,
            "transactionIndex": q(index) if index is not None else None,
        }
        if tx.type_id:
            out.update(
                yParity=q(tx.y_parity),
                accessList=[{"address": addr(a), "storageKeys": [d(k.to_bytes(32, "big"))
                                                                 for k in keys]}
                            for a, keys in tx.access_list],
            )
        if (tx.type_id or 0) >= DYNAMIC_FEE_TX_TYPE:  # an access-list (type 1) one has none:
            # its JSON with them could not be signed again (eth-account, ethers refuse both)
            out.update(maxFeePerGas=q(tx.max_fee_per_gas),
                       maxPriorityFeePerGas=q(tx.max_priority_fee_per_gas))
        price = tx.gas_price if not tx.type_id else tx.max_fee_per_gas
        if base_fee is not None and tx.type_id:
            price = min(tx.max_fee_per_gas, base_fee + tx.max_priority_fee_per_gas)
        out["gasPrice"] = q(price)
        return out

    def _locate(self, tx_hash: bytes):
        try:
            number, index = self.node.chain.chaindb.get_transaction_index(tx_hash)
        except TransactionNotFound:
            return None
        return self.blocks.get(number), index

    def _matching_logs(self, wanted: set[str] | None, topic_sets: list[set[str] | None],
                       first: int, last: int) -> list[dict]:
        """The logs of blocks first..last that ``parse_log_filter``'s sets match."""
        out = []
        for number in range(first, last + 1):
            for entry in self.blocks.get(number)[2]:
                if wanted is not None and entry["address"].lower() not in wanted:
                    continue
                if len(entry["topics"]) < len(topic_sets):
                    continue
                if all(s is None or entry["topics"][i] in s for i, s in enumerate(topic_sets)):
                    out.append(entry)
        return out

    def _log_range(self, criteria: dict) -> tuple[int, int]:
        if criteria.get("blockHash") is not None:
            header = self.header_at({"blockHash": criteria["blockHash"]})
            return header.block_number, header.block_number
        for end in ("fromBlock", "toBlock"):  # geth's code and words for it (not "not found")
            if self._block_ahead(criteria.get(end)) is not None:
                raise invalid_params(f"block range extends beyond current head block "
                                     f"{self.node.head().block_number}")
        first = self.header_at(criteria.get("fromBlock", "latest")).block_number
        last = self.header_at(criteria.get("toBlock", "latest")).block_number
        if first > last:
            raise invalid_params(f"fromBlock {first} is after toBlock {last}")
        if last - first > MAX_LOG_BLOCKS:
            raise RpcError(-32005, f"query spans more than {MAX_LOG_BLOCKS} blocks; narrow the "
                                   "range")
        return first, last

    # --- methods -------------------------------------------------------------------------------
    def rpc_web3__clientVersion(self):
        return CLIENT_VERSION

    def rpc_net__version(self):
        return str(CHAIN_ID)

    def rpc_net__listening(self):
        return True

    def rpc_net__peerCount(self):
        """web3's net.peer_count: a single node has no peers."""
        return q(0)

    def rpc_eth__chainId(self):
        return q(CHAIN_ID)

    def rpc_eth__syncing(self):
        return False

    def rpc_eth__accounts(self):
        return []

    def rpc_eth__blockNumber(self):
        return q(self.node.head().block_number)

    def rpc_eth__getBalance(self, address, block="latest"):
        return q(self.node.state_at(self.header_at(block)).get_balance(parse_address(address)))

    def rpc_eth__getTransactionCount(self, address, block="latest"):
        account = parse_address(address)
        if block == "pending" or isinstance(block, dict) and block.get("blockNumber") == "pending":
            return q(self.node.pending_nonce(account))
        return q(self.node.state_at(self.header_at(block)).get_nonce(account))

    def rpc_eth__getCode(self, address, block="latest"):
        return d(self.node.state_at(self.header_at(block)).get_code(parse_address(address)))

    def rpc_eth__getStorageAt(self, address, slot, block="latest"):
        value = self.node.state_at(self.header_at(block)).get_storage(
            parse_address(address), parse_quantity(slot, "slot"))
        return d(value.to_bytes(32, "big"))

    def rpc_eth__getProof(self, address, storage_keys, block="latest"):
        """EIP-1186: the account and the storage slots asked for, each with its Merkle proof
        from the block's state root (an absent one: an exclusion proof, the empty account's
        fields and value 0)."""
        account = parse_address(address)
        if storage_keys is None:
            storage_keys = []
        if not isinstance(storage_keys, list):
            raise invalid_params("storageKeys must be an array")
        if len(storage_keys) > MAX_PROOF_KEYS:
            raise invalid_params(f"at most {MAX_PROOF_KEYS} storage keys, got "
                                 f"{len(storage_keys)}")
        keys = [parse_storage_key(key) for key in storage_keys]
        header = self.header_at(block)
        try:
            return self._proof(header.state_root, account, keys)
        except MissingTrieNode as exc:
            raise RpcError(-32000, f"missing trie node {d(exc.missing_node_hash)}: the state "
                                   f"of block {header.block_number} is not held") from None

    def _proof(self, state_root: bytes, address: bytes, keys: list[tuple[int, str]]) -> dict:
        """eth_getProof's answer from the tries themselves (the node keeps every block's
        state: trie nodes are never deleted)."""
        db = self.node.db
        encoded = HexaryTrie(db, state_root).get(keccak(address))
        account = rlp.decode(encoded, sedes=Account) if encoded else \
            Account(0, 0, BLANK_ROOT_HASH, EMPTY_SHA3)
        storage = HexaryTrie(db, account.storage_root)
        slots = []
        for slot, key_text in keys:
            hashed = keccak(slot.to_bytes(32, "big"))
            value = storage.get(hashed)  # RLP of the value's big-endian bytes; absent: b""
            slots.append({"key": key_text,
                          "value": q(int.from_bytes(rlp.decode(value) if value else b"", "big")),
                          "proof": trie_proof(db, account.storage_root, hashed)})
        return {"address": checksummed(address),
                "accountProof": trie_proof(db, state_root, keccak(address)),
                "balance": q(account.balance), "codeHash": d(account.code_hash),
                "nonce": q(account.nonce), "storageHash": d(account.storage_root),
                "storageProof": slots}

    def rpc_eth__call(self, call, block="latest", state_overrides=None, block_overrides=None):
        no_block_overrides(block_overrides)
        overrides = parse_state_overrides(state_overrides)
        return d(self._execute(call, block, overrides=overrides)[1].output)

    def rpc_eth__estimateGas(self, call, block="latest", state_overrides=None,
                             block_overrides=None):
        """Gas for the call with a margin, within the caller's `gas` (its allowance, as geth)
        and never below EIP-7623's calldata floor, which admission requires."""
        if not isinstance(call, dict):
            raise invalid_params("call must be an object")
        no_block_overrides(block_overrides)
        overrides = parse_state_overrides(state_overrides)
        header = self.header_at(block)
        allowance = header.gas_limit
        if call.get("gas"):
            allowance = min(allowance, parse_quantity(call["gas"], "gas"))
        tx, computation = self._execute({**call, "gas": None}, block, allowance, overrides)
        used = tx.gas - computation.get_gas_remaining()
        floor = calldata_floor_gas(tx.data)
        if floor > allowance:
            raise RpcError(-32000, f"gas required exceeds allowance ({allowance}): the calldata "
                                   f"floor is {floor} (EIP-7623)")
        # a call forwards at most 63/64 of its gas: leave room for the callee's share
        estimate = min(allowance, max(floor, used + used // 63 + 2_300))
        if any(child.children for child in computation.children):
            # calls two or more levels deep keep 1/64 at each level: the margin above falls
            # short (a call two levels down that needs 1M gas failed with the estimate)
            estimate = self._lowest_sufficient_gas(call, block, estimate, allowance, overrides)
        return q(estimate)

    def _lowest_sufficient_gas(self, call: dict, tag, guess: int, allowance: int,
                               overrides: dict) -> int:
        """The least gas (within 1/64) from ``guess`` up with which the call succeeds, by
        geth's binary search; the allowance is known to suffice."""
        def enough(gas: int) -> bool:
            return not self._run({**call, "gas": None}, tag, gas, overrides)[1].is_error

        if enough(guess):
            return guess
        low, high = guess, allowance
        while high - low > high // 64:
            middle = (low + high) // 2
            low, high = (low, middle) if enough(middle) else (middle, high)
        return high

    def rpc_eth__createAccessList(self, call, block="latest"):
        """geth's: the access list of what the call touches and the gas it uses with that
        list, traced again with the list until the list stays the same (the list changes
        the gas, which may change the path); a failed call has its error alongside."""
        if not isinstance(call, dict):
            raise invalid_params("call must be an object")
        access_list = call.get("accessList") or []
        for _ in range(ACCESS_LIST_PASSES):
            accessed: dict[bytes, dict[int, None]] = {}
            tx, computation = self._run({**call, "accessList": access_list}, block,
                                        accessed=accessed)
            traced = access_list_json(accessed, computation)
            if traced == access_list:
                break
            access_list = traced
        else:  # the last list traced differs from the list its gas was measured with
            tx, computation = self._run({**call, "accessList": access_list}, block)
        vm_class = self.node.chain.get_vm_class(self.header_at(block))
        result = {"accessList": access_list,
                  "gasUsed": q(vm_class.finalize_gas_used(tx, computation))}
        if computation.is_error:
            result["error"] = (revert_error(computation.output).message
                               if isinstance(computation.error, Revert)
                               else f"execution failed: {computation.error!r}")
        return result

    def rpc_eth__gasPrice(self):
        return q(self.node.next_base_fee() + PRIORITY_FEE)

    def rpc_eth__maxPriorityFeePerGas(self):
        return q(PRIORITY_FEE)

    def rpc_eth__feeHistory(self, block_count, newest_block="latest", reward_percentiles=None):
        count = min(parse_quantity(block_count, "blockCount"), 1024)
        percentiles = parse_percentiles(reward_percentiles)
        last = self.header_at(newest_block).block_number
        first = max(0, last - count + 1)
        base_fees, ratios, rewards = [], [], []
        for number in range(first, last + 1):
            block, receipts, _ = self.blocks.get(number)
            base_fees.append(q(block.header.base_fee_per_gas))
            ratios.append(block.header.gas_used / block.header.gas_limit)
            rewards.append([q(tip) for tip in block_rewards(block, receipts, percentiles)])
        base_fees.append(q(self.node.next_base_fee() if last == self.node.head().block_number
                           else self.blocks.get(last + 1)[0].header.base_fee_per_gas))
        result = {"oldestBlock": q(first), "baseFeePerGas": base_fees, "gasUsedRatio": ratios}
        if percentiles:
            result["reward"] = rewards
        return result

    def rpc_eth__sendRawTransaction(self, transaction):
        return d(self.node.admit(parse_data(transaction, "transaction")))

    def rpc_eth__getTransactionByHash(self, tx_hash):
        tx_hash = parse_hash(tx_hash, "hash")
        pending = self.node.mempool.by_hash.get(tx_hash)
        if pending is not None:
            return self._tx_json(pending)
        found = self._locate(tx_hash)
        if found is None:
            return None
        (block, _, _), index = found
        return self._tx_json(block.transactions[index], block, index)

    def rpc_eth__getRawTransactionByHash(self, tx_hash):
        """The signed bytes of a pending or mined transaction (web3's get_raw_transaction);
        null if the node has none by that hash."""
        tx_hash = parse_hash(tx_hash, "hash")
        tx = self.node.mempool.by_hash.get(tx_hash)
        if tx is None:
            found = self._locate(tx_hash)
            if found is None:
                return None
            (block, _, _), index = found
            tx = block.transactions[index]
        return d(tx.encode())

    def rpc_eth__blobBaseFee(self):
        """The head's blob base fee, by EIP-4844 from its excessBlobGas, as geth answers
        (web3's blob_base_fee, viem's getBlobBaseFee). Blob transactions are refused here,
        so the excess stays 0 and the fee at its minimum."""
        return q(self.node.state_at(self.node.head()).blob_base_fee)

    def rpc_eth__getTransactionReceipt(self, tx_hash):
        found = self._locate(parse_hash(tx_hash, "hash"))
        return None if found is None else self._receipt_json(*found)

    def recent_receipt(self, tx_hash: bytes) -> dict | None:
        """The receipt of a transaction in one of the node's recent blocks (newest first),
        without the node's lock; None if it is not there."""
        for number in range(self.node.head().block_number, -1, -1):
            entry = self.blocks.sealed(number)
            if entry is None:
                return None
            for index, tx in enumerate(entry[0].transactions):
                if tx.hash == tx_hash:
                    return self._receipt_json(entry, index)
        return None

    def recent_logs(self, address: str, first: int, last: int) -> list[dict] | None:
        """``eth_getLogs`` of one address over recent blocks, without the node's lock; None
        if a block of the range is no longer (or not yet) among the recent ones."""
        entries = [self.blocks.sealed(number) for number in range(first, last + 1)]
        if None in entries:
            return None
        address = address.lower()
        return [log for entry in entries for log in entry[2] if log["address"].lower() == address]

    def _receipt_json(self, entry: tuple, index: int, tx_logs: list[dict] | None = None) -> dict:
        """A receipt as geth gives it; `tx_logs`: its transaction's logs where the caller
        has them (else they are found among the block's)."""
        block, receipts, logs = entry
        tx, receipt = block.transactions[index], receipts[index]
        if tx_logs is None:
            tx_logs = [log for log in logs if log["transactionHash"] == d(tx.hash)]
        previous = receipts[index - 1].gas_used if index else 0
        tx_json = self._tx_json(tx, block, index)
        return {
            "transactionHash": d(tx.hash), "transactionIndex": q(index),
            "blockHash": d(block.hash), "blockNumber": q(block.number),
            "from": tx_json["from"], "to": tx_json["to"],
            "cumulativeGasUsed": q(receipt.gas_used), "gasUsed": q(receipt.gas_used - previous),
            "effectiveGasPrice": tx_json["gasPrice"],
            "contractAddress": None if tx.to else addr(
                generate_contract_address(tx.sender, tx.nonce)),
            "logs": tx_logs,
            "logsBloom": d(receipt.bloom.to_bytes(256, "big")),
            "status": q(receipt.state_root == b"\x01"), "type": q(tx.type_id or 0),
        }

    def _entry_at(self, block) -> tuple | None:
        """The cached (block, receipts, logs) of the canonical block a block parameter (or
        EIP-1898 object) names; None if there is none (geth answers null, not an error)."""
        try:
            header = self.header_at(block)
        except UnknownBlock:
            return None
        entry = self.blocks.get(header.block_number)
        return entry if entry[0].hash == header.hash else None  # a hash off the chain

    def _entry_by_hash(self, block_hash) -> tuple | None:
        """``_entry_at`` for a parameter that must be a block hash."""
        return self._entry_at({"blockHash": block_hash})

    def rpc_eth__getBlockByNumber(self, block, full=False):
        full = parse_bool(full, "full")
        entry = self._entry_at(block)
        return None if entry is None else self._block_json(entry[0], full)

    def rpc_eth__getBlockByHash(self, block_hash, full=False):
        full = parse_bool(full, "full")
        entry = self._entry_by_hash(block_hash)
        return None if entry is None else self._block_json(entry[0], full)

    # web3's get_block_transaction_count, get_transaction_by_block and get_block_receipts
    # (and viem's and ethers' equivalents) call these; they were "method not found"
    def rpc_eth__getBlockTransactionCountByNumber(self, block):
        entry = self._entry_at(block)
        return None if entry is None else q(len(entry[0].transactions))

    def rpc_eth__getBlockTransactionCountByHash(self, block_hash):
        entry = self._entry_by_hash(block_hash)
        return None if entry is None else q(len(entry[0].transactions))

    def rpc_eth__getTransactionByBlockNumberAndIndex(self, block, index):
        index = parse_quantity(index, "index")
        return self._transaction_at(self._entry_at(block), index)

    def rpc_eth__getTransactionByBlockHashAndIndex(self, block_hash, index):
        index = parse_quantity(index, "index")
        return self._transaction_at(self._entry_by_hash(block_hash), index)

    def _transaction_at(self, entry: tuple | None, index: int) -> dict | None:
        """The transaction at `index` of a block entry; None past its last (as geth)."""
        if entry is None or index >= len(entry[0].transactions):
            return None
        return self._tx_json(entry[0].transactions[index], entry[0], index)

    def rpc_eth__getBlockReceipts(self, block):
        """Every receipt of a block (a number, a tag or a hash, as geth takes it), its logs
        grouped in one pass (``_receipt_json``'s search of the block's logs for each
        transaction would be quadratic in a full block)."""
        entry = self._entry_at(block)
        if entry is None:
            return None
        by_index: list[list[dict]] = [[] for _ in entry[0].transactions]
        for log in entry[2]:
            by_index[int(log["transactionIndex"], 16)].append(log)
        return [self._receipt_json(entry, index, logs) for index, logs in enumerate(by_index)]

    def rpc_eth__getLogs(self, log_filter):
        matched = parse_log_filter(log_filter)
        return self._matching_logs(*matched, *self._log_range(log_filter))

    def rpc_eth__newFilter(self, log_filter):
        """A log filter, as geth's: its polls return the logs of blocks sealed after it was
        installed (from its start, if that is ahead), and eth_getFilterLogs its whole range:
        web3's get_all_entries then get_new_entries see each log once."""
        matched = parse_log_filter(log_filter)
        last = self._filter_end(log_filter.get("toBlock"))
        head = self.node.head().block_number
        first = self._block_ahead(log_filter.get("fromBlock"))
        follows_head = first is None and \
            log_filter.get("fromBlock") in (None, "latest", "pending")
        if follows_head:
            first = head + 1
        elif first is None:  # a block at or below the head (a number, tag or hash): it exists
            first = self.header_at(log_filter["fromBlock"]).block_number
        if last is not None and first > last and not follows_head:
            raise invalid_params(f"fromBlock {first} is after toBlock {last}")
        fid = new_filter_id()
        self._install(fid, {"kind": "logs", "criteria": log_filter, "matched": matched,
                            "next": max(first, head + 1), "last": last})
        return fid

    def _block_ahead(self, tag) -> int | None:
        """The number of a block parameter naming a block past the head, else None. A log
        filter may start there, as geth's: the node refused it ("block N not found"), and a
        client had to poll for the head before it could ask for that block's logs."""
        number_text = isinstance(tag, str) and len(tag) != BLOCK_HASH_TEXT \
            and HEX_QUANTITY.fullmatch(tag)
        if not number_text and type(tag) is not int:  # a tag, a hash, EIP-1898's object
            return None
        number = parse_quantity(tag, "fromBlock")
        return number if number > self.node.head().block_number else None

    @staticmethod
    def _filter_end(to_block) -> int | None:
        """The last block a log filter's polls cover: None to follow the head (every tag but
        "earliest" is the head here), else its number, which may be ahead of the head. Read
        at install: a tag read on each poll as a number made every poll of a filter to
        "finalized" or "safe" fail."""
        if to_block in (None, "latest", "pending", "safe", "finalized"):
            return None
        if to_block == "earliest":
            return 0
        return parse_quantity(to_block, "toBlock")

    def _install(self, fid: str, spec: dict) -> None:
        """Add a filter; filters nobody polled for FILTER_TTL seconds are dropped (as geth)."""
        now = time.monotonic()
        for stale in [k for k, f in self.filters.items() if now - f["polled"] > FILTER_TTL]:
            del self.filters[stale]
        self.filters[fid] = {**spec, "polled": now}

    def rpc_eth__newBlockFilter(self):
        fid = new_filter_id()
        self._install(fid, {"kind": "blocks", "next": self.node.head().block_number + 1})
        return fid

    def rpc_eth__newPendingTransactionFilter(self):
        """web3's ``filter("pending")``: the hashes of transactions that reached the pool
        after it was installed (``_pending_changes``)."""
        fid = new_filter_id()
        self._install(fid, {"kind": "pending", "next": self.node.head().block_number + 1,
                            "reported": set(self._pending_hashes())})
        return fid

    def _pending_hashes(self) -> list[bytes]:
        """The pool's transactions in arrival order."""
        with self.node.mempool.lock:  # admission adds to it without the node's lock
            return list(self.node.mempool.by_hash)

    def _pending_changes(self, f: dict, first: int, head: int) -> list[str]:
        """Transactions that entered the pool since the last poll: those pending now and
        those mined in blocks first..head (a transaction can come and be mined between two
        polls), less those reported before, or pending at install."""
        pending = self._pending_hashes()
        mined = [tx.hash for number in range(first, head + 1)
                 for tx in self.blocks.get(number)[0].transactions]
        arrived = dict.fromkeys(itertools.chain(mined, pending))  # in order, once each
        new = [h for h in arrived if h not in f["reported"]]
        f["reported"] = set(pending)  # the mined ones can never come back
        return [d(h) for h in new]

    def rpc_eth__getFilterChanges(self, filter_id):
        f = self.filters.get(filter_id)
        if f is None:
            raise RpcError(-32000, f"filter {filter_id} not found")
        f["polled"] = time.monotonic()
        head = self.node.head().block_number
        first = f["next"]
        f["next"] = max(first, head + 1)  # a log filter's start may be ahead of the head
        if f["kind"] == "blocks":
            return [d(self.node.chain.get_canonical_block_hash(n)) for n in range(first, head + 1)]
        if f["kind"] == "pending":
            return self._pending_changes(f, first, head)
        last = head if f["last"] is None else min(head, f["last"])
        return self._matching_logs(*f["matched"], first, last)

    def rpc_eth__getFilterLogs(self, filter_id):
        f = self.filters.get(filter_id)
        if f is None or f["kind"] != "logs":
            raise RpcError(-32000, f"filter {filter_id} not found")
        criteria = f["criteria"]
        if self._block_ahead(criteria.get("fromBlock")) is not None:
            return []  # none of its blocks is sealed yet
        if self._block_ahead(criteria.get("toBlock")) is not None:  # the sealed part of it
            criteria = {**criteria, "toBlock": "latest"}
        return self.rpc_eth__getLogs(criteria)

    def rpc_eth__uninstallFilter(self, filter_id):
        return self.filters.pop(filter_id, None) is not None


MAX_RPC_BODY = 64 * 2**20
MAX_WAIT_TXS = 64  # transactions one long poll may wait for
MAX_WAIT_S = 60.0
ANSWERED = object()  # what _json_body gives once it answered the request (JSON null is None)


class NodeApp:
    """The HTTP face of a node as one raw ASGI app: JSON-RPC (POST / and /rpc), the /wait
    long poll and /blobs are answered here; FastAPI serves the rest (/info, /openapi.json;
    its HTML docs pages, which load their scripts from a CDN, are off). Its
    request machinery cost ~0.6 ms of node CPU per request (measured: eth_blockNumber 0.99
    ms against 0.40 for a raw blob HEAD), as much as most requests' own work, and a job
    makes about twenty."""

    def __init__(self, node: Node, rpc: Rpc, fallback: FastAPI,
                 body_timeout: float = BODY_TIMEOUT) -> None:
        self.node, self.rpc, self.fallback = node, rpc, fallback
        self.body_timeout = body_timeout
        self.blobs = BlobApp(node.blobs)
        self.loop: asyncio.AbstractEventLoop | None = None
        # long polls waiting on the event loop: (ready, future); no thread each, one
        # wake-up of the loop per sealed block (node.on_sealed)
        self.waiters: list[tuple[Callable[[], bool], asyncio.Future]] = []
        self.closing = False  # the server is shutting down: long polls answer at once

    async def __call__(self, scope, receive, send) -> None:
        if self.loop is None:
            self.node.on_sealed.append(self._sealed)
        self.loop = asyncio.get_running_loop()
        if scope["type"] == "http":
            path, method = scope["path"], scope["method"]
            if path in ("/", "/rpc") and method == "POST":
                await self.json_rpc(receive, send)
                return
            if path == "/wait" and method == "GET":
                await self.wait(scope, receive, send)
                return
            if path == "/wait" and method == "POST":
                await self.send_and_wait(scope, receive, send)
                return
            if path == "/blobs" or path.startswith("/blobs/"):
                await self.blobs(scope, receive, send)
                return
        await self.fallback(scope, receive, send)

    async def _json_body(self, receive, send):
        """The request's body parsed as JSON; ANSWERED once an error is answered (413 over
        MAX_RPC_BODY, 408 and the connection closed when no body bytes came for
        `body_timeout` s, JSON-RPC's parse error if it is not JSON). uvicorn bounds no body
        in time: a client that stopped mid-body held its connection and the bytes so far (up
        to 64 MiB) for good."""
        body = bytearray()
        watch = BodyWatch(self.body_timeout)
        try:
            while True:
                message = await watch.receive(receive)
                body += message.get("body", b"")
                if len(body) > MAX_RPC_BODY:
                    await json_reply(send, 413, {"error": f"request body over {MAX_RPC_BODY} "
                                                          "bytes"})
                    return ANSWERED
                if not message.get("more_body"):
                    break
        except UploadStalled as exc:
            await json_reply(send, 408, {"error": str(exc)}, headers=CLOSE)
            return ANSWERED
        finally:
            watch.close()
        if json_nesting_exceeds(body):
            await json_reply(send, 200, Rpc._error(None, RpcError(
                -32600, f"invalid request: JSON nested deeper than {MAX_JSON_DEPTH} levels")))
            return ANSWERED
        try:
            return json.loads(body, parse_constant=_reject_constant)
        except ValueError:
            await json_reply(send, 200, Rpc._error(None, RpcError(-32700, "parse error: body is "
                                                                     "not JSON")))
            return ANSWERED

    async def json_rpc(self, receive, send) -> None:
        payload = await self._json_body(receive, send)
        if payload is ANSWERED:
            return
        method = payload.get("method") if isinstance(payload, dict) else "batch"
        mark(f"rpc in {method}")
        if method == "eth_sendRawTransaction":
            # one transaction's admission takes the mempool's lock only (never waits for a
            # seal) and ~0.5 ms: done here, without two thread hand-offs under a busy GIL
            reply = self.rpc.handle(payload)
        else:
            reply = await anyio.to_thread.run_sync(self.rpc.handle, payload)
        mark(f"rpc out {method}")
        if reply is None:
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
        else:
            await json_reply(send, 200, reply)

    async def send_and_wait(self, scope, receive, send) -> None:
        """POST /wait: the body, a raw transaction as a JSON string, is admitted as
        eth_sendRawTransaction admits it (a refusal answers that method's JSON-RPC error, id
        null), then the long poll of GET /wait follows with the query's `tx` and this
        transaction's hash last (also answered as `hash`): one request instead of two for
        each transaction a client sends and waits for."""
        raw = await self._json_body(receive, send)
        mark("rpc in send_and_wait")
        if raw is ANSWERED:
            return
        if not isinstance(raw, str):
            got = json.dumps(raw)[:64]
            await json_reply(send, 400, {"error": "the body must be a raw transaction as a JSON "
                                                  f"string (\"0x...\"), not {got}"})
            return
        await self.wait(scope, receive, send, raw=raw)

    async def wait(self, scope, receive, send, raw=None) -> None:
        """Long poll: answers once block `block` is sealed, or once transaction `tx` left the
        mempool (mined or dropped), or after `timeout` seconds (at most 60), with the head
        and the gas price eth_gasPrice would give; with `logs=<address>` also that address's
        logs in blocks `block`..head, and for `tx` its receipt (null if it is not among the
        node's recent blocks), as eth_getLogs and eth_getTransactionReceipt give them. So a
        client follows the chain without polling it, and learns what it waited for without
        asking again. `tx` may be repeated (up to MAX_WAIT_TXS): the answer comes once all
        left the mempool, with `receipts` in the same order (`receipt` is the first's), so a
        worker waits for its commit and finalisation with one request instead of two."""
        query = parse_qs(scope["query_string"].decode("latin-1"))
        try:
            block_text = query.get("block", ["0"])[-1]
            if not (block_text.isascii() and block_text.isdigit()):  # int() takes "1_0", " 5"
                raise ValueError(f"block must be a block number, got {block_text!r}")
            block = int(block_text)
            timeout = float(query.get("timeout", ["10"])[-1])
            if not math.isfinite(timeout):
                raise invalid_params(f"timeout must be a finite number of seconds, got {timeout}")
            timeout = min(max(timeout, 0.0), MAX_WAIT_S)
            if len(query.get("tx", [])) + (raw is not None) > MAX_WAIT_TXS:
                raise invalid_params(f"more than {MAX_WAIT_TXS} tx")
            tx_hashes = [parse_hash(value, "tx") for value in query.get("tx", [])]
            logs = query["logs"][-1] if "logs" in query else None
            if logs is not None:
                parse_address(logs, "logs")
        except ValueError as exc:
            await json_reply(send, 400, {"error": f"block and timeout must be numbers: {exc}"})
            return
        except RpcError as exc:
            await json_reply(send, 400, {"error": exc.message})
            return
        sent = None
        if raw is not None:  # admitted only once the query is known good
            reply = self.rpc.handle({"jsonrpc": "2.0", "id": None,
                                     "method": "eth_sendRawTransaction", "params": [raw]})
            if "error" in reply:
                await json_reply(send, 200, reply)
                return
            sent = reply["result"]
            tx_hashes.append(bytes.fromhex(sent[2:]))
        node, rpc = self.node, self.rpc

        def sealed() -> dict:
            head = node.head().block_number
            answer = {"head": head, "gas_price": node.gas_price}
            if logs is not None and head >= block:
                found = rpc.recent_logs(logs, block, head)
                if found is not None:  # else the client asks eth_getLogs
                    answer["logs"] = found
            mark(f"rpc wait block {block} -> {head}")
            return answer

        def left_mempool() -> bool:
            return not any(h in node.mempool.by_hash for h in tx_hashes)

        def mined() -> dict:
            receipts = [None if h in node.mempool.by_hash else rpc.recent_receipt(h)
                        for h in tx_hashes]
            mark("rpc wait tx done")
            answer = {"head": node.head().block_number, "gas_price": node.gas_price,
                      "receipt": receipts[0], "receipts": receipts}
            return answer if sent is None else {**answer, "hash": sent}

        ready = left_mempool if tx_hashes else lambda: node.head().block_number >= block
        if not ready() and not await self._until(ready, timeout, receive):
            return  # the client is gone
        await json_reply(send, 200, mined() if tx_hashes else sealed())

    async def _until(self, ready: Callable[[], bool], timeout: float, receive) -> bool:
        """Wait on the loop until `ready()` holds after a sealed block, or `timeout` s; False
        as soon as the client disconnects (its waiter then leaves at once: before, it stayed
        to its timeout, and clients that opened and dropped long polls piled them up, each
        checked at every block)."""
        if self.closing:
            return True
        waiter = (ready, self.loop.create_future())
        self.waiters.append(waiter)
        gone = asyncio.ensure_future(_disconnect(receive))
        try:
            await asyncio.wait((waiter[1], gone), timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
            return not gone.done()
        finally:
            gone.cancel()
            if waiter in self.waiters:
                self.waiters.remove(waiter)

    def answer_waiters(self) -> None:
        """On the loop, as the server shuts down: answer every long poll now with what holds
        (a transaction still pending gets a null receipt, and its client asks again once the
        node is back). Uvicorn waits for requests in progress before it stops, and a long poll
        on a transaction behind a nonce gap held a SIGTERMed node up to MAX_WAIT_S."""
        self.closing = True
        for _, future in self.waiters:
            if not future.done():
                future.set_result(None)
        self.waiters = []

    def _sealed(self) -> None:
        """On the producer thread, after each block: wake the loop for the long polls."""
        try:
            self.loop.call_soon_threadsafe(self._wake_waiters)
        except RuntimeError:  # the server's loop is closed: no long polls to wake
            pass

    def _wake_waiters(self) -> None:
        """After a sealed block (on the loop): release the long polls it satisfied."""
        waiting = []
        for ready, future in self.waiters:
            if future.done():
                continue
            if ready():
                future.set_result(None)
            else:
                waiting.append((ready, future))
        self.waiters = waiting


async def _disconnect(receive) -> None:
    """Returns once the client of a request whose body was read has disconnected (bytes it
    still sends are dropped)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(node: Node) -> NodeApp:
    """The HTTP face of a node: JSON-RPC, /wait, blobs and /info."""
    rpc = Rpc(node)
    app = FastAPI(title="needle-net chain node", docs_url=None, redoc_url=None)
    market = compiled_market()

    @app.get("/info")
    def info(request: Request) -> dict:
        base = str(request.base_url).rstrip("/")
        return {
            "chain_id": CHAIN_ID,
            "contract": to_checksum_address(MARKET_ADDRESS),
            "abi": market["abi"],
            "abi_path": market["path"],
            "blob_url": blob_url(base, getattr(request.app.state, "blob_port", None)),
            "rpc_url": base,
            "block_time": node.config.block_time,
            "reward_pool": to_checksum_address(REWARD_POOL_ADDRESS),
            "precompile": to_checksum_address(FREIVALDS_ADDRESS),
            "head": node.head().block_number,
            "send_and_wait": True,  # POST /wait
            "max_blob_bytes": node.config.max_blob_bytes,
        }

    return NodeApp(node, rpc, app)
