"""The fast execution path against stock py-evm on what review 22's fuzzer does not generate.

Review 22's fuzzer (tests/test_chain_fast_review22.py) runs random code with random gas; a
rule checked at the wrong moment or against the wrong amount shows only when a frame runs
out of gas at exactly that check. Here every case is a small contract (a "snippet"), and a
driver contract calls it once with each gas allowance of a range (stride 1 near the
snippet's own cost and the SSTORE stipend bound), through CALL, CALLCODE, DELEGATECALL and
STATICCALL, so that each failure point of the snippet is reached once with nothing warm (a
failed call reverts its warm marks and writes). Both chains (``Pair`` of review 22: fast and
stock, sealed block by block) must agree on every frame (success, output, gas left,
refund, logs, self-destructs), receipt, account and block header (state root, receipts
root, bloom, gas used).

The snippets: copies (CALLDATACOPY/CODECOPY/MCOPY/EXTCODECOPY/RETURNDATACOPY) out of range
and with huge zero-size offsets, memory expansion by every memory opcode, KECCAK256 and LOG
of large memory, SSTORE's EIP-2200/3529 cases on pre-set slots, TLOAD/TSTORE, calls with
value to missing, empty and funded accounts and beyond the balance, every precompile
(0x01-0x11 and the Freivalds one) with valid and malformed input, static-context writes,
CREATE/CREATE2 with collisions, reverting or EIP-3541/EIP-170-violating initcode and
EIP-3860 oversized initcode, SELFDESTRUCT (EIP-6780) of new and old contracts, and the block
context opcodes. Transactions also run at the exact gas limit where they start to succeed
(found by bisection on a throwaway stock VM), with access lists and EIP-7623 floors;
review 22's random contracts get the same sweeps and boundaries; and arithmetic on edge
words is checked against a model of execution-specs' semantics.

For a longer hunt: ``REVIEW23_ALL_DRIVERS=1`` (every snippet through all four call opcodes)
and ``REVIEW23_RANDOM=<n>`` random cases (6 in the suite). When written, 350 random
cases and every snippet through every driver agreed, and the sweeps caught each of these
planted bugs in the loop: the stipend bound off by one, the cold-slot surcharge off by one,
SHA3's word gas, LOG's gas off by one, MCOPY expanding memory to its target only, and
CALLDATACOPY/CODECOPY not zero-padding.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from eth.vm.forks.prague.transactions import PragueTransactionBuilder
from test_chain_fast_evm import asm
from test_chain_fast_review22 import (
    CONTRACTS,
    EMPTY,
    FUNDED,
    KEYS,
    MISSING,
    SENDERS,
    CodeGenerator,
    Pair,
    address_word,
    returning,
)

from chain.params import CHAIN_ID, FREIVALDS_ADDRESS, GENESIS_GAS_LIMIT

UINT = 2**256
DRIVERS = [bytes(18) + bytes([0xD0, i]) for i in range(4)]  # CALL, CALLCODE, DELEGATE, STATIC
DRIVER_OPS = ["CALL", "CALLCODE", "DELEGATECALL", "STATICCALL"]
SNIPPET_BASE = 0x5000
NEW_ACCOUNTS = [bytes(18) + bytes([0xAA, i]) for i in range(8)]  # never funded
IDENTITY = bytes(19) + b"\x04"


def snippet_address(index: int) -> bytes:
    return (SNIPPET_BASE + index).to_bytes(20, "big")


def driver_code(op: str) -> bytes:
    """Calls calldata word 0 (the snippet) once with each gas allowance of calldata words
    1, 2, ...; no call data, no output (the frames are compared directly)."""
    value = [0] if op in ("CALL", "CALLCODE") else []
    depth = 7 if value else 6  # DUPn reaching the target, then the calldata position
    loop = len(asm(0, "CALLDATALOAD", 32))
    return asm(0, "CALLDATALOAD", 32, "JUMPDEST",
               0, 0, 0, 0, *value, f"DUP{depth}", f"DUP{depth}", "CALLDATALOAD", op, "POP",
               32, "ADD", "DUP1", "CALLDATASIZE", "GT", loop, "JUMPI", "STOP")


def store_init(code: bytes) -> list:
    """Items that write ``code`` to memory 0.. with MSTOREs (for CREATE's initcode)."""
    items = []
    for i in range(0, len(code), 32):
        items += [int.from_bytes(code[i:i + 32].ljust(32, b"\0"), "big"), i, "MSTORE"]
    return items


def call_items(op: str, target, gas="GAS", value: int = 0, args=(0, 0), out=(0, 0)) -> list:
    """A call's stack arguments and the opcode; ``args``/``out``: (offset, size)."""
    items = [out[1], out[0], args[1], args[0]]
    if op in ("CALL", "CALLCODE"):
        items.append(value)
    target = [target] if isinstance(target, (int, str)) else list(target)
    return [*items, *target, gas, op]


def precompile_input(index: int, kind: int) -> bytes:
    """Input for precompile ``index``: kind 0 well-formed (or a plausible size), 1 one byte
    short, 2 all 0xff (out of the field), 3 empty."""
    sizes = {1: 128, 2: 40, 3: 40, 4: 40, 5: 96 + 3, 6: 128, 7: 96, 8: 192, 9: 213, 10: 192,
             11: 256, 12: 160, 13: 512, 14: 288, 15: 384, 16: 64, 17: 128}
    size = sizes[index]
    if kind == 3:
        return b""
    if kind == 2:
        return b"\xff" * size
    if index == 5:  # modexp: base, exponent, modulus lengths 1, then 3, 5, 7 (or a huge one)
        data = (1).to_bytes(32, "big") + (1).to_bytes(32, "big") + (1).to_bytes(32, "big")
        data += b"\x03\x05\x07"
    elif index == 7:  # ecmul: the generator (1, 2) times 3
        data = (1).to_bytes(32, "big") + (2).to_bytes(32, "big") + (3).to_bytes(32, "big")
    elif index == 6:  # ecadd: (1, 2) + (1, 2)
        data = ((1).to_bytes(32, "big") + (2).to_bytes(32, "big")) * 2
    elif index == 9:  # blake2f: 12 rounds, final flag 1
        data = (12).to_bytes(4, "big") + bytes(range(64)) + bytes(128) + bytes(16) + b"\x01"
    else:
        data = bytes((i * 7 + index) % 256 for i in range(size))
    return data if kind == 0 else data[:-1]


def snippets() -> list[bytes]:
    """The callee contracts; each ends by returning something it computed."""
    return snippets_and_precompile_calls()[0]


def snippets_and_precompile_calls() -> tuple[list[bytes], set[int]]:
    """The snippets, and the indices of those calling a precompile."""
    out = []
    ret = [64, 0, "RETURN"]
    # copies and memory expansion
    out += [
        asm(64, UINT - 1, 0, "CALLDATACOPY", "MSIZE", 0, "MSTORE", *ret),
        asm(40, "CODESIZE", 3, "SWAP1", "SUB", 5, "CODECOPY", *ret),
        asm(64, 2**64, 0, "CODECOPY", "MSIZE", 32, "MSTORE", *ret),
        asm(0, UINT - 1, UINT - 1, "CALLDATACOPY", 0, UINT - 1, UINT - 1, "CODECOPY",
            0, UINT - 1, UINT - 1, "MCOPY", 0, UINT - 1, UINT - 1, "RETURNDATACOPY",
            0, UINT - 1, UINT - 1, "ADDRESS", "EXTCODECOPY", "MSIZE", 0, "MSTORE", *ret),
        asm(0xAB, 0, "MSTORE", 0xCD, 40, "MSTORE8", 70, 0, 1, "MCOPY", 70, 1, 0, "MCOPY",
            *ret),
        asm(32, 200, 0, "MCOPY", 32, 0, 300, "MCOPY", "MSIZE", 0, "MSTORE", *ret),
        asm(1, 0xFFFF, "MSTORE8", 0x7FFF, "MLOAD", "MSIZE", 0, "MSTORE", *ret),
        asm(1, 2**14, "MSTORE", "MSIZE", 0, "MSTORE", *ret),
        asm(2**32, "MLOAD", 0, "MSTORE", *ret),
        asm(5000, 0, "SHA3", 0, "MSTORE", 0, 2**40, "SHA3", 32, "MSTORE", *ret),
        asm(1, 2, 3, 4, 3000, 17, "LOG4", 0, 2**70, "LOG0", *ret),
        asm(2**12, 2**13, "RETURN"),
        asm(32, 2**13, "REVERT"),
        asm(0, UINT - 1, "RETURN"),
        asm(100, 9, 0x1234, "ADDRESS", "EXTCODECOPY", 0, UINT - 1, 0, EMPTY[-1],
            "EXTCODECOPY", *ret),
    ]
    # RETURNDATACOPY after 32 bytes of return data from the identity precompile
    echo = call_items("STATICCALL", address_word(IDENTITY), "GAS", args=(0, 32), out=(0, 0))
    for size, offset in [(32, 0), (32, 1), (0, 32), (0, 33), (1, UINT - 1), (0, UINT - 1),
                         (31, 1)]:
        out.append(asm(7, 0, "MSTORE", *echo, "POP", size, offset, 40, "RETURNDATACOPY",
                       "RETURNDATASIZE", 0, "MSTORE", *ret))
    # SSTORE's cases over the pre-set slots (0: 1, 1: 7, 2: max, 3: unset), then SLOAD
    for writes in [[(0, 0)], [(0, 0), (0, 1)], [(0, 2), (0, 1)], [(0, 0), (0, 2)],
                   [(3, 5)], [(3, 5), (3, 0)], [(1, 7)], [(2, 0), (2, UINT - 1)],
                   [(1, 0), (0, 0), (2, 0)], [(3, 1), (3, 2), (3, 0)]]:
        items = []
        for slot, value in writes:
            items += [value, slot, "SSTORE"]
        out.append(asm(*items, writes[0][0], "SLOAD", 0, "MSTORE", 3, "SLOAD", 32, "MSTORE",
                       *ret))
    out.append(asm(0, "SLOAD", 0, "SLOAD", "ADD", 5, "SLOAD", 2, "SSTORE", *ret))
    # SSTOREs costing no more than the stipend, last: only the stipend rule fails them
    out += [asm(7, 1, "SSTORE"), asm(1, 0, "SSTORE"), asm(0, 3, "SSTORE"),
            asm(1, "SLOAD", 1, "SSTORE"), asm(5, 3, "SSTORE", 6, 3, "SSTORE"),
            asm(2, 0, "SSTORE", 1, 0, "SSTORE")]
    # transient storage, across a reverted and a successful self-call
    out.append(asm(5, 1, "TSTORE", 1, "TLOAD", 0, "MSTORE", 1, "TLOAD", 9, "ADD", 1, "TSTORE",
                   1, "TLOAD", 32, "MSTORE", *ret))
    # calls with value: new, empty and funded accounts, beyond the balance, CALLCODE
    for target in (NEW_ACCOUNTS[0], EMPTY, FUNDED, NEW_ACCOUNTS[1]):
        for op in ("CALL", "CALLCODE"):
            out.append(asm(*call_items(op, address_word(target), "GAS", value=1), 0, "MSTORE",
                           "GAS", 32, "MSTORE", *ret))
    out.append(asm(*call_items("CALL", address_word(NEW_ACCOUNTS[2]), 0, value=1), 0,
                   "MSTORE", *ret))
    out.append(asm(*call_items("CALL", address_word(FUNDED), "GAS", value=10**30), 0, "MSTORE",
                   *ret))
    for op in ("DELEGATECALL", "STATICCALL"):
        out.append(asm(*call_items(op, address_word(NEW_ACCOUNTS[3]), "GAS"), 0, "MSTORE",
                       *ret))
    out.append(asm("SELFBALANCE", 0, "MSTORE", *call_items("CALL", "CALLER", 2300, value=1),
                   32, "MSTORE", *ret))
    # every precompile, valid and malformed input, all the gas or a tight amount
    first_precompile_call = len(out)
    for index in range(1, 0x12):
        for kind in range(4):
            data = precompile_input(index, kind)
            gas = "GAS" if kind != 1 else 3000
            out.append(asm(*store_init(data), *call_items(
                "STATICCALL", index, gas, args=(0, len(data)), out=(0, 64)),
                "RETURNDATASIZE", 64, "MSTORE", 96, 0, "RETURN"))
    for words in ([], [1, 2], [1] * 10, [2**64] * 10, [1, 1, 1, 1, 1, 1, 1, 0, 65, 5]):
        data = b"".join(w.to_bytes(32, "big") for w in words)
        out.append(asm(*store_init(data), *call_items(
            "STATICCALL", address_word(FREIVALDS_ADDRESS), "GAS", args=(0, len(data)),
            out=(0, 32)), "RETURNDATASIZE", 32, "MSTORE", *ret))
    precompile_calls = set(range(first_precompile_call, len(out)))
    # writes under a static context: each fails only there
    for items in ([1, 0, "SSTORE"], [1, 0, "TSTORE"], [0, 0, "LOG0"],
                  call_items("CALL", address_word(FUNDED), "GAS", value=1),
                  call_items("CALL", address_word(FUNDED), "GAS"),
                  [0, 0, 0, "CREATE"], [0, 0, 0, 0, "CREATE2"],
                  [address_word(FUNDED), "SELFDESTRUCT"]):
        out.append(asm(*items, 0, "MSTORE", *ret))
    # creations
    fail_initcodes = [
        asm(1, 0, "MSTORE", 32, 0, "REVERT"),
        asm(0xEF, 0, "MSTORE8", 1, 0, "RETURN"),  # EIP-3541
        asm(24_577, 0, "RETURN"),  # EIP-170
        asm(24_576, 0, "RETURN"),  # the largest code: 4.9M gas of deposit
        asm(0xFE),
        returning(asm(1, 0, "SSTORE")),
    ]
    for init in fail_initcodes:
        for create in ([len(init), 0, 0, "CREATE"], [7, len(init), 0, 0, "CREATE2"]):
            out.append(asm(*store_init(init), *create, 0, "MSTORE", "RETURNDATASIZE", 32,
                           "MSTORE", *ret))
    init = returning(asm(1, "SLOAD", 1, "ADD", 1, "SSTORE"))
    out.append(asm(*store_init(init), 9, len(init), 0, 0, "CREATE2", 0, "MSTORE",
                   9, len(init), 0, 0, "CREATE2", 32, "MSTORE", *ret))  # the second collides
    out.append(asm(49_153, 0, 0, "CREATE", 0, "MSTORE", 0, 49_152, 0, 0, "CREATE2", 32,
                   "MSTORE", *ret))  # EIP-3860: initcode over 49152 bytes fails the frame
    out.append(asm(0, 0, 10**30, "CREATE", 0, "MSTORE", *ret))
    # SELFDESTRUCT: a child destroyed in its creating transaction, and an old contract
    doomed = asm(5, 0, "SSTORE", address_word(NEW_ACCOUNTS[4]), "SELFDESTRUCT")
    out.append(asm(*store_init(doomed), len(doomed), 0, 7, "CREATE", 0, "MSTORE", *ret))
    kept = returning(asm(address_word(NEW_ACCOUNTS[5]), "SELFDESTRUCT"))
    out.append(asm(*store_init(kept), len(kept), 0, 3, "CREATE", "DUP1", 0, "MSTORE",
                   *call_items("CALL", ["DUP6"], "GAS"), 32, "MSTORE", *ret))
    out.append(asm(address_word(NEW_ACCOUNTS[6]), "SELFDESTRUCT"))
    out.append(asm("ADDRESS", "SELFDESTRUCT"))
    # the block context
    for items in (["NUMBER", 1, "SWAP1", "SUB", "BLOCKHASH"], ["NUMBER", "BLOCKHASH"],
                  ["NUMBER", 256, "SWAP1", "SUB", "BLOCKHASH"],
                  ["NUMBER", 257, "SWAP1", "SUB", "BLOCKHASH"], [UINT - 1, "BLOCKHASH"],
                  ["COINBASE"], ["BASEFEE"], ["PREVRANDAO"], ["BLOBBASEFEE"],
                  [0, "BLOBHASH"], ["GASPRICE"], ["ORIGIN"], ["TIMESTAMP"], ["CHAINID"],
                  ["GASLIMIT"], ["COINBASE", "BALANCE"], [address_word(MISSING), "BALANCE"],
                  [address_word(EMPTY), "EXTCODEHASH"], [address_word(MISSING), "EXTCODEHASH"],
                  [1, "EXTCODEHASH"], [address_word(FREIVALDS_ADDRESS), "EXTCODESIZE"]):
        out.append(asm(*items, 0, "MSTORE", "GAS", 32, "MSTORE", *ret))
    return out, precompile_calls


class Case:
    """A pair of chains with the drivers and snippets in their genesis."""

    def __init__(self, tmp_path, extra: dict[bytes, bytes] | None = None, seed: int = 0
                 ) -> None:
        self.snippets, self.precompile_calls = snippets_and_precompile_calls()
        contracts = {address: driver_code(op)
                     for address, op in zip(DRIVERS, DRIVER_OPS, strict=True)}
        contracts.update({snippet_address(i): code for i, code in enumerate(self.snippets)})
        contracts.update(extra or {})
        self.pair = Pair(tmp_path, contracts)
        # accounts compared after each transaction (the block's state root covers the rest)
        self.pair.watched -= {snippet_address(i) for i in range(len(self.snippets))}
        self.pair.watched.update(NEW_ACCOUNTS)
        self.rng = np.random.default_rng(seed)

    def tx(self, sender: int, to: bytes, data: bytes = b"", gas: int = 30_000_000,
           value: int = 0, access=()):
        return self.pair.transaction(self.rng, sender, to, data, value, gas, access)

    def sweep(self, driver: int, index: int, allowances: list[int]):
        """A driver's transaction calling snippet ``index`` once with each allowance."""
        return self.sweep_address(driver, snippet_address(index), allowances)

    def sweep_address(self, driver: int, address: bytes, allowances: list[int]):
        words = (address_word(address), *allowances)
        data = b"".join(w.to_bytes(32, "big") for w in words)
        gas = 100_000 + sum(allowances) + 800 * len(allowances) + 64 * len(data)
        return self.tx(driver % len(KEYS), DRIVERS[driver], data, gas=gas)

    def cost(self, driver: int, index: int) -> tuple[int, int]:
        return self.cost_of(driver, snippet_address(index))

    def cost_of(self, driver: int, address: bytes) -> tuple[int, int]:
        """The gas the contract uses when the driver calls it with plenty, and (within 16)
        the least allowance it succeeds with (more than the gas it uses where an SSTORE
        needs more than the 2300 stipend left: a cold no-op SSTORE costs only 2200); both
        from throwaway stock VMs at the head."""
        cost = self._children(driver, address, [10_000_000])[0]
        if cost is None:
            return 10_000_000, 10_000_000  # it never succeeds
        if b"\x55" not in self.pair.chains[1].get_vm().state.get_code(address):
            return cost, cost  # no SSTORE (or not obviously)
        tries = list(range(cost, cost + 2400, 16))
        used = self._children(driver, address, tries)
        least = next((g for g, u in zip(tries, used, strict=True) if u is not None), cost)
        return cost, least

    def _children(self, driver: int, address: bytes, allowances: list[int]) -> list:
        """The gas each call of the sweep used (None: the call failed)."""
        sender = driver % len(KEYS)
        vm = self.pair.chains[1].get_vm()
        pending_nonce = self.pair.nonces[sender]
        self.pair.nonces[sender] = vm.state.get_nonce(SENDERS[sender])
        tx = self.sweep_address(driver, address, allowances)
        self.pair.nonces[sender] = pending_nonce
        _, computation = vm.apply_transaction(vm.get_header(), tx)
        return [child.msg.gas - child.get_gas_remaining() if child.is_success else None
                for child in computation.children]


def allowances(cost: tuple[int, int], last: int = 64, coarse: int = 24) -> list[int]:
    """Gas allowances where a snippet meets its checks, from ``cost`` (the gas it uses, the
    least allowance it succeeds with, within 16): every value in the ``last`` before each
    (its final charges: SSTORE, memory, word gas, code deposit; the SSTORE stipend bound)
    and a few past it, and ``coarse`` values spread below (the earlier checks)."""
    used, least = cost
    points = set(range(max(0, used - last), used + 8))
    points.update(range(max(0, least - 16 - last), least + 8))
    points.update(range(0, used, max(1, used // coarse)))
    return sorted(points)


def sweeps(case: Case, driver: int, index: int) -> list:
    cost = case.cost(driver, index)
    if index in case.precompile_calls:  # one charge, before the work (pairings: slow)
        return [case.sweep(driver, index, allowances(cost, last=3, coarse=3))]
    return [case.sweep(driver, index, allowances(cost))]


def seal_in_blocks(pair: Pair, transactions: list) -> None:
    """Seal the transactions in order, as many per block as half the gas limit takes (the
    base fee stays put)."""
    block, gas = [], 0
    for tx in transactions:
        if block and (gas + tx.gas > GENESIS_GAS_LIMIT // 2 or len(block) >= 24):
            pair.seal(block)
            block, gas = [], 0
        block.append(tx)
        gas += tx.gas
    if block:
        pair.seal(block)


ALL_DRIVERS = bool(os.environ.get("REVIEW23_ALL_DRIVERS"))  # every snippet through all 4


@pytest.mark.parametrize("driver", range(len(DRIVERS)))
def test_gas_sweeps_agree(tmp_path, driver):
    """The snippets, through one call opcode, at every gas allowance around their checks
    (CALL: every snippet; the others a third each, unless ``REVIEW23_ALL_DRIVERS``); the
    new accounts and collisions carry over from block to block."""
    case = Case(tmp_path / str(driver))
    transactions = []
    for index in range(len(case.snippets)):
        if driver == 0 or ALL_DRIVERS or index % 3 == driver - 1:
            transactions += sweeps(case, driver, index)
    seal_in_blocks(case.pair, transactions)


def signed(sender: int, nonce: int, to: bytes, data: bytes, gas: int, value: int = 0,
           access=()):
    """An EIP-1559 transaction (type 2), with its access list."""
    return PragueTransactionBuilder.new_unsigned_dynamic_fee_transaction(
        chain_id=CHAIN_ID, nonce=nonce, max_priority_fee_per_gas=1, max_fee_per_gas=10**10,
        gas=gas, to=to, value=value, data=data, access_list=list(access),
    ).as_signed_transaction(KEYS[sender], chain_id=CHAIN_ID)


def outcome(pair: Pair, sender: int, to: bytes, data: bytes, gas: int, value: int,
            access) -> tuple[bool, int]:
    """Whether the transaction succeeds at the head of the stock chain (not sealed), and
    the gas it used before refunds."""
    vm = pair.chains[1].get_vm()
    nonce = vm.state.get_nonce(SENDERS[sender])
    tx = signed(sender, nonce, to, data, gas, value, access)
    _, computation = vm.apply_transaction(vm.get_header(), tx)
    return computation.is_success, gas - computation.get_gas_remaining()


def at_the_boundary(pair: Pair, to: bytes, data: bytes = b"", value: int = 0,
                    access=()) -> list:
    """Two transactions (senders 0 and 1) with the gas limits where the transaction starts
    to succeed: the largest failing one and the smallest succeeding one (bisection on the
    stock chain, between the gas it uses with plenty and 1/64 + 2400 more: the reserve of
    its calls and the SSTORE stipend), or the intrinsic gas and 30M if it never flips."""
    intrinsic = signed(0, 0, to, data, 10**6, value, access).intrinsic_gas
    succeeded, used = outcome(pair, 0, to, data, 30_000_000, value, access)
    low, high = max(intrinsic, used - 1), min(30_000_000, used + used // 64 + 2400)
    if not succeeded or outcome(pair, 0, to, data, low, value, access)[0] or \
            not outcome(pair, 0, to, data, high, value, access)[0]:
        gases = [intrinsic, 30_000_000]
    else:
        while high - low > 1:  # low fails, high succeeds
            middle = (low + high) // 2
            if outcome(pair, 0, to, data, middle, value, access)[0]:
                high = middle
            else:
                low = middle
        gases = [low, high]
    out = []
    for sender, gas in enumerate(gases):
        out.append(signed(sender, pair.nonces[sender], to, data, gas, value, access))
        pair.nonces[sender] += 1
    return out


def boundary_cases(case: Case) -> list[tuple]:
    """(to, data, value, access list) of the transactions run at their gas boundary:
    every snippet called directly (its refunds capped at a fifth of the gas used, EIP-3529),
    some with the snippet and its slots in the access list (EIP-2930), some with calldata
    past the EIP-7623 floor, with value, and creation transactions of each initcode."""
    out = []
    for index in range(len(case.snippets)):
        target = snippet_address(index)
        out.append((target, b"", 0, ()))
        if index % 5 == 0:
            out.append((target, b"", 0, ((target, [0, 1, 2, 3]), (FUNDED, []))))
        if index % 7 == 0:
            out.append((target, bytes(range(1, 256)) * 4, 0, ()))
        if index % 11 == 0:
            out.append((target, b"", 5, ()))
    for code in case.snippets[::3]:
        out.append((b"", returning(code), 0, ()))
        out.append((b"", code, 1, ()))
    return out


def test_transactions_at_their_gas_boundary(tmp_path):
    """Transactions at the gas limits where they flip from failing to succeeding."""
    case = Case(tmp_path)
    transactions = []
    for to, data, value, access in boundary_cases(case):
        transactions += at_the_boundary(case.pair, to, data, value, access)
    seal_in_blocks(case.pair, transactions)


EDGES = [0, 1, 2, 3, 7, 31, 32, 255, 256, 257, 2**64, 2**128 + 1, 2**255 - 1, 2**255,
         2**255 + 1, UINT - 2, UINT - 1]


def signed_word(x: int) -> int:
    return x - UINT if x >= 2**255 else x


def reference(op: str, a: int, b: int = 0, c: int = 0) -> int:
    """execution-specs' result of ``op`` with a on top of the stack, then b, then c."""
    sa, sb = signed_word(a), signed_word(b)
    if op in ("DIV", "SDIV", "MOD", "SMOD") and b == 0:
        return 0
    results = {
        "ADD": lambda: a + b, "MUL": lambda: a * b, "SUB": lambda: a - b,
        "DIV": lambda: a // b, "MOD": lambda: a % b,
        "SDIV": lambda: (-1 if sa * sb < 0 else 1) * (abs(sa) // abs(sb)),
        "SMOD": lambda: (-1 if sa < 0 else 1) * (abs(sa) % abs(sb)),
        "ADDMOD": lambda: (a + b) % c if c else 0, "MULMOD": lambda: (a * b) % c if c else 0,
        "EXP": lambda: pow(a, b, UINT),
        "SIGNEXTEND": lambda: b if a > 30 else (
            b | (UINT - (1 << (8 * a + 8))) if b >> (8 * a + 7) & 1 else
            b & ((1 << (8 * a + 8)) - 1)),
        "LT": lambda: int(a < b), "GT": lambda: int(a > b), "SLT": lambda: int(sa < sb),
        "SGT": lambda: int(sa > sb), "EQ": lambda: int(a == b), "AND": lambda: a & b,
        "OR": lambda: a | b, "XOR": lambda: a ^ b,
        "BYTE": lambda: (b >> (248 - 8 * a)) & 0xFF if a < 32 else 0,
        "SHL": lambda: b << a if a < 256 else 0, "SHR": lambda: b >> a if a < 256 else 0,
        "SAR": lambda: (signed_word(b) >> min(a, 256)),
        "ISZERO": lambda: int(a == 0), "NOT": lambda: UINT - 1 - a,
    }
    return results[op]() % UINT


UNARY = ["ISZERO", "NOT"]
BINARY = ["ADD", "MUL", "SUB", "DIV", "SDIV", "MOD", "SMOD", "EXP", "SIGNEXTEND", "LT", "GT",
          "SLT", "SGT", "EQ", "AND", "OR", "XOR", "BYTE", "SHL", "SHR", "SAR"]
TERNARY = ["ADDMOD", "MULMOD"]


def arithmetic_program() -> tuple[bytes, list[int]]:
    """Code computing every opcode on the edge words (ternary ones on a subset), each
    result MSTOREd in turn and all returned; the expected results, per the reference."""
    items, expected = [], []
    few = [0, 1, 2, 2**255, UINT - 1, 7]
    operands = [(op, (a,)) for op in UNARY for a in EDGES]
    operands += [(op, (a, b)) for op in BINARY for a in EDGES for b in EDGES]
    operands += [(op, (a, b, c)) for op in TERNARY for a in few for b in few for c in few]
    for op, args in operands:
        items += [*reversed(args), op, 32 * len(expected), "MSTORE"]
        expected.append(reference(op, *args))
    return asm(*items, 32 * len(expected), 0, "RETURN"), expected


def test_arithmetic_matches_the_spec(tmp_path):
    """Every arithmetic, comparison, bitwise and shift opcode (inline in the fast loop or
    py-evm's) on edge words, e.g. SDIV of -2**255 by -1, MOD/SMOD/ADDMOD/MULMOD by zero,
    shifts of 256 and more, SIGNEXTEND/BYTE past the word: both chains return the results of
    the execution-specs model, and agree on gas (EXP's per-byte gas) and the block."""
    program, expected = arithmetic_program()
    target = CONTRACTS[0]
    case = Case(tmp_path, {target: program})
    case.pair.seal([case.tx(0, target, gas=60_000_000)])
    for chain in case.pair.chains:
        vm = chain.get_vm()
        nonce = vm.state.get_nonce(SENDERS[1])
        _, computation = vm.apply_transaction(vm.get_header(), signed(
            1, nonce, target, b"", 60_000_000))
        assert computation.is_success
        output = computation.output
        results = [int.from_bytes(output[i:i + 32], "big") for i in range(0, len(output), 32)]
        assert results == expected


def random_sweep_case(tmp_path, seed: int, contracts: int = 6) -> None:
    """Review 22's random contracts (in place of CONTRACTS: they call each other), each
    swept through a random driver over its gas checks, and called at its transaction gas
    boundary."""
    rng = np.random.default_rng(seed)
    gen = CodeGenerator(rng)
    codes = {address: gen.code(int(rng.integers(3, 10))) for address in
             CONTRACTS[:contracts]}
    case = Case(tmp_path / str(seed), codes, seed)
    transactions = []
    for address in codes:
        case.pair.watched.add(address)
        driver = int(rng.integers(len(DRIVERS)))
        cost = case.cost_of(driver, address)
        transactions.append(case.sweep_address(driver, address, allowances(cost, coarse=12)))
        transactions += at_the_boundary(case.pair, address, bytes(int(rng.integers(0, 70))))
    seal_in_blocks(case.pair, transactions)


@pytest.mark.parametrize("seed", range(int(os.environ.get("REVIEW23_RANDOM", "6"))))
def test_random_contracts_at_their_gas_checks(tmp_path, seed):
    random_sweep_case(tmp_path, seed)
