"""The fast opcode loop (chain/interpreter.py) against stock py-evm, transaction for transaction.

A node running the fast loop seals blocks of market transactions (the whole job lifecycle,
reverts, out-of-gas, value transfers, the Freivalds precompile) and of hand-assembled
contracts that exercise most opcodes and the loop's edge cases (jumps into PUSH data,
truncated PUSH, stack under- and overflow, invalid opcodes, huge memory offsets, nested
calls, CREATE2, static-call violations). A stock py-evm chain then imports every block with
full validation: it re-executes each transaction and rejects the block unless the state
root, receipts (status, cumulative gas, logs), bloom and gas used are identical. Return data
and gas of calls are compared directly on both chains.
"""
import numpy as np
import pytest
from eth._utils.address import generate_contract_address
from eth.db.atomic import AtomicDB
from eth.rlp.logs import Log
from eth.vm import opcode_values
from eth.vm.code_stream import CodeStream
from eth.vm.forks.byzantium import ByzantiumVM
from eth.vm.forks.prague import PragueVM
from eth.vm.spoof import SpoofTransaction
from eth_bloom import BloomFilter
from eth_hash.auto import keccak
from eth_utils import to_canonical_address
from web3 import Web3

from chain.admission import decode_transaction
from chain.blobs import encode_array
from chain.compile import compiled_market
from chain.devnet import dev_accounts
from chain.genesis import genesis_params, genesis_state
from chain.interpreter import jump_destinations
from chain.node import Node, NodeConfig
from chain.params import CHAIN_ID, MARKET_ADDRESS, REWARD_POOL_ADDRESS
from chain.vm import build_chain_class, logs_bloom

MARKET = Web3().eth.contract(address=Web3.to_checksum_address(MARKET_ADDRESS),
                             abi=compiled_market()["abi"])
EDGE_WORDS = [0, 1, 2, 3, 31, 32, 255, 256, 2**255 - 1, 2**255, 2**256 - 2, 2**256 - 1,
              0x8000_0000_0000_0000_0000_0000_0000_00ff]


def asm(*items) -> bytes:
    """Bytecode from mnemonics, ints (pushed with the smallest PUSH) and raw bytes."""
    out = bytearray()
    for item in items:
        if isinstance(item, str):
            out.append(getattr(opcode_values, item))
        elif isinstance(item, int):
            size = (item.bit_length() + 7) // 8
            out += bytes([opcode_values.PUSH0 + size]) + item.to_bytes(size, "big")
        else:
            out += item
    return bytes(out)


def initcode(runtime: bytes) -> bytes:
    """Creation code that returns ``runtime`` (CODECOPY it to memory 0, RETURN it)."""
    prefix = asm(bytes([opcode_values.PUSH2]) + len(runtime).to_bytes(2, "big"), "DUP1",
                 bytes([opcode_values.PUSH1, 10]), "PUSH0", "CODECOPY", "PUSH0", "RETURN")
    assert len(prefix) == 10
    return prefix + runtime


BINARY = ["ADD", "MUL", "SUB", "DIV", "SDIV", "MOD", "SMOD", "EXP", "SIGNEXTEND", "LT", "GT",
          "SLT", "SGT", "EQ", "AND", "OR", "XOR", "BYTE", "SHL", "SHR", "SAR"]


def arith_runtime() -> bytes:
    """Every arithmetic/comparison/bitwise opcode on calldata words x, y, z; results go to
    storage, memory, logs and the return data, with context opcodes mixed in (not TIMESTAMP:
    a call's pending block takes the wall clock; the market's blocks use it)."""
    code = []
    for i, op in enumerate(BINARY):  # op(x, y): x on top
        code += [32, "CALLDATALOAD", 0, "CALLDATALOAD", op, "DUP1", 32 * i, "MSTORE", i,
                 "SSTORE"]
    n = len(BINARY)
    for i, op in enumerate(["ADDMOD", "MULMOD"]):
        code += [64, "CALLDATALOAD", 32, "CALLDATALOAD", 0, "CALLDATALOAD", op,
                 32 * (n + i), "MSTORE"]
    code += [0, "CALLDATALOAD", "ISZERO", 32 * (n + 2), "MSTORE",
             0, "CALLDATALOAD", "NOT", 32 * (n + 3), "MSTORE"]
    for op in ["CALLER", "CALLVALUE", "CALLDATASIZE", "ORIGIN", "ADDRESS", "SELFBALANCE",
               "CODESIZE", "NUMBER", "CHAINID", "BASEFEE", "GASLIMIT", "PC",
               "MSIZE", "RETURNDATASIZE", "GAS"]:
        code += [op, "MSIZE", "MSTORE"]
    code += ["ADDRESS", "BALANCE", "MSIZE", "MSTORE",
             1, "NUMBER", "SUB", "BLOCKHASH", "MSIZE", "MSTORE",
             0xAB, 7, "MSTORE8", 5, 0x11, "TSTORE", 0x11, "TLOAD", "MSIZE", "MSTORE",
             64, 0, "MSIZE", "MCOPY",  # copy the first two words to the end
             96, 0, "MSIZE", "CALLDATACOPY", 40, 3, "MSIZE", "CODECOPY",
             0x20, 0x40, "SHA3", "DUP1", 0x99, "SSTORE",
             "DUP1", 64, 0, "LOG1", "DUP1", "DUP1", 32, 16, "LOG2",
             "DUP1", "DUP1", "DUP1", 0, 0, "LOG3", "DUP1", "DUP1", "DUP1", "DUP1", 33, 1, "LOG4",
             5, 2, "LOG0",
             # deep stack: 17 values, SWAP16 and DUP16
             *range(1, 18), "SWAP16", "DUP16", "ADD", 0x77, "SSTORE",
             *["POP"] * 15, 0x78, "SSTORE", 0x79, "SSTORE",
             "MSIZE", 0, "RETURN"]
    return asm(*code)


def push2(value: int) -> bytes:
    return bytes([opcode_values.PUSH2]) + value.to_bytes(2, "big")


def log_in_static_call_runtime() -> bytes:
    """With call data: LOG1. Without: STATICCALLs itself with one byte of call data, where
    the LOG must fail, and stores the call's success."""
    def code(label: int) -> bytes:
        return asm("CALLDATASIZE", push2(label), "JUMPI",
                   0, 0, 1, 0, "ADDRESS", "GAS", "STATICCALL", 1, "SSTORE", "STOP",
                   "JUMPDEST", 0x77, 32, 0, "LOG1")
    label = code(0).index(bytes([opcode_values.JUMPDEST]), 4)
    return code(label)


EDGE_RUNTIMES = {
    # JUMP to a 0x5b byte that is PUSH data: invalid
    "jump_into_push_data": asm(4, "JUMP", bytes([opcode_values.PUSH1, 0x5B]), "STOP"),
    "jump_to_non_jumpdest": asm(0, "JUMP"),
    "jump_past_end": asm(0xFFFF, "JUMP", "JUMPDEST"),
    # an untaken JUMPI never checks its destination; a taken one does
    "jumpi_untaken_bad_dest": asm(0, 0xFF, "JUMPI", 1, 1, "SSTORE", "STOP"),
    "jumpi_taken_good_dest": asm(1, 6, "JUMPI", b"\xfe", "JUMPDEST", 2, 2, "SSTORE"),
    "stack_underflow": asm(1, "ADD"),
    "swap_underflow": asm(1, 2, "SWAP2"),
    "dup_underflow": asm(1, "DUP2"),
    "invalid_opcode": asm(1, 1, "SSTORE", b"\xfe"),
    "undefined_opcode": asm(1, 1, "SSTORE", b"\x0c"),
    "gas_exhausted_in_loop": asm("JUMPDEST", 1, 1, "SSTORE", 0, "JUMP"),
    "stack_overflow": asm("JUMPDEST", "CALLER", 0, "JUMP"),
    "push_overflow": asm("JUMPDEST", 1, 0, "JUMP"),
    # pushes calldata word n items, then stores: 1022 reaches exactly 1024 stack items
    # (succeeds), 1023 one more (fails)
    "stack_depth": asm(0, "CALLDATALOAD", "JUMPDEST", "DUP1", "ISZERO",
                       bytes([opcode_values.PUSH1, 17]), "JUMPI", "CALLER", "SWAP1", 1, "SWAP1",
                       "SUB", bytes([opcode_values.PUSH1, 2]), "JUMP", "JUMPDEST", 1, 1,
                       "SSTORE"),
    "huge_mload": asm(0xFFFFFFFFFF, "MLOAD"),
    "huge_mstore": asm(1, 2**255, "MSTORE"),
    "huge_calldataload": asm(2**255, "CALLDATALOAD", 3, "SSTORE"),
    "memory_growth": asm(7, 0x1000, "MSTORE", 0x1000, "MLOAD", "MSIZE", "ADD", 4, "SSTORE"),
    # expansion gas at growing, quadratic-cost sizes, inline and in py-evm's opcodes; zero-size
    # accesses at huge offsets cost nothing; the gas left after each is returned
    "memory_expansion": asm(0, 0, 2**200, "CALLDATACOPY", 0, 2**200, 2**201, "MCOPY",
                            0, 2**255, "SHA3", "GAS", 0, "MSTORE",
                            7, 0x10000, "MSTORE", "GAS", 32, "MSTORE",
                            0x10000, "MLOAD", "GAS", 64, "MSTORE",
                            9, 0x20005, "MSTORE8", "GAS", 96, "MSTORE",
                            32, 0, 0x30001, "CALLDATACOPY", "GAS", 128, "MSTORE",
                            64, 0, 0x40000, "MCOPY", 32, 0x50000, "SHA3", "GAS", 160, "MSTORE",
                            "MSIZE", 192, "MSTORE", 224, 0, "RETURN"),
    # copies reading past the end of the code and of the call data (zeros), overlapping
    # MCOPYs both ways, a hash of the result, RETURN of it
    "copies_past_the_end": asm(32, 64, 0, "MCOPY", "MSIZE", 3, "SSTORE",  # source past MSIZE
                               33, 0, "SHA3", "GAS", 4, "SSTORE",  # word gas of a part word
                               64, "CODESIZE", 10, "SWAP1", "SUB", 0, "CODECOPY",
                               40, 2**255, 64, "CALLDATACOPY", 50, 0, 7, "MCOPY",
                               50, 9, 1, "MCOPY", 128, 0, "SHA3", 1, "SSTORE", 128, 0, "RETURN"),
    "return_nothing_far": asm(0, 2**255, "RETURN"),
    "log_in_static_call": log_in_static_call_runtime(),
    "huge_sha3": asm(1, 2**200, "SHA3"),
    "revert_with_data": asm(5, 5, "SSTORE", 0x1234, 0, "MSTORE", 32, 0, "REVERT"),
    "truncated_push": asm(9, 9, "SSTORE", bytes([opcode_values.PUSH3, 0xAB])),
    "return_nothing": asm(0, 0, "RETURN"),
    "stop_then_code": asm("STOP", 1, 1, "SSTORE"),
}


def dispatch_runtime(routines: list[bytes]) -> bytes:
    """Runs ``routines[calldata word 0]``; each routine starts with JUMPDEST."""
    def table(offsets):
        return asm(0, "CALLDATALOAD", *[item for k, offset in enumerate(offsets)
                                        for item in ("DUP1", k, "EQ", push2(offset), "JUMPI")],
                   "STOP")
    offset, offsets = len(table([0] * len(routines))), []
    for routine in routines:
        offsets.append(offset)
        offset += len(routine)
    return table(offsets) + b"".join(routines)


GAS_MARK = ["GAS", "MSIZE", "MSTORE"]  # the gas left, appended to memory (returned at the end)


def storage_rules_runtime() -> bytes:
    """SLOAD/SSTORE through the EIP-2200/2929/3529 cases, the gas left after each recorded.
    Routine 0 gives slots 10-15 the value 7 (run in an earlier block, so that they are
    originally nonzero in the transactions of routine 1); routine 2 stores 1 into slot 20
    (cold, zero -> nonzero) and then 0, routine 3 writes slot 21's own value (cold no-op),
    routine 4 stores 1 into slot NUMBER (cold, zero -> nonzero): the probe calls those with
    gas around each bound."""
    setup = ["JUMPDEST", *(item for slot in range(10, 16) for item in (7, slot, "SSTORE")),
             "STOP"]
    rules = ["JUMPDEST",
             10, "SLOAD", *GAS_MARK, 10, "SLOAD", "ADD", *GAS_MARK,  # cold, then warm read
             5, 1, "SSTORE", *GAS_MARK,   # zero -> nonzero, cold slot
             5, 1, "SSTORE", *GAS_MARK,   # no change, warm
             0, 1, "SSTORE", *GAS_MARK,   # back to the original zero: refund
             0, 11, "SSTORE", *GAS_MARK,  # nonzero -> zero: clearing refund, cold
             7, 11, "SSTORE", *GAS_MARK,  # back to the original nonzero: refund taken back
             9, 12, "SSTORE", 0, 12, "SSTORE", 3, 12, "SSTORE", *GAS_MARK,  # dirty slot
             7, 13, "SSTORE", *GAS_MARK,  # same value, cold
             14, "SLOAD", 8, 14, "SSTORE", *GAS_MARK,  # warmed by the SLOAD
             0, 2, "SSTORE", *GAS_MARK,   # zero -> zero, cold
             0, 15, "SSTORE", 0, 15, "SSTORE", 15, "SLOAD", *GAS_MARK,
             "MSIZE", 0, "RETURN"]
    set_and_clear = ["JUMPDEST", 1, 20, "SSTORE", 0, 20, "SSTORE", "STOP"]
    # clears slots 10-15: 6 x 4800 refund, above the EIP-3529 cap of a fifth of the ~52k gas
    clear_all = ["JUMPDEST", *(item for slot in range(10, 16) for item in (0, slot, "SSTORE")),
                 "STOP"]
    cold_noop = ["JUMPDEST", 0, 21, "SSTORE", "STOP"]
    cold_set = ["JUMPDEST", 1, "NUMBER", "SSTORE", "STOP"]  # a slot still zero in each block
    return dispatch_runtime([asm(*setup), asm(*rules), asm(*set_and_clear), asm(*cold_noop),
                             asm(*cold_set), asm(*clear_all)])


GAS_SWEEPS = ((3, range(2_389, 2_409)), (2, range(24_473, 24_493)), (4, range(22_200, 22_225)),
              (2, range(2_483, 25_483, 1000)))


def storage_gas_probe_runtime(rules: bytes) -> bytes:
    """CALLs the storage rules' routines 2 and 3 with gas stepping over the EIP-2200 stipend
    bound and the SSTORE costs (each call fails or succeeds by a few gas units); records each
    call's success and the gas left, and returns them."""
    target = int.from_bytes(rules, "big")
    code = []
    # routine 3 needs 2399 gas (2300 + 1 left at its SSTORE), routine 2 24483 (its second
    # SSTORE with 2301 left), routine 4 22220 (20000 and the cold slot's 2100 at its SSTORE);
    # the last sweep runs out of gas during the first SSTORE's charge
    for routine, gas_values in GAS_SWEEPS:
        code += [routine, 0, "MSTORE"]
        for gas in gas_values:
            code += [0, 0, 32, 0, 0, target, gas, "CALL", "MSIZE", "MSTORE", *GAS_MARK]
    return asm(*code, "MSIZE", 0, "RETURN")


def probe_runtime(targets: list[bytes], arith: bytes) -> bytes:
    """Calls each target (limited gas) and records success, return data size and a hash of
    the return data; then STATICCALL/DELEGATECALL/CALL with value to the arith contract,
    precompiles, and CREATE2 of a self-destructing child."""
    code = []
    for i, target in enumerate(targets):
        code += [0, 0, 0, 0, 0, int.from_bytes(target, "big"), 200_000, "CALL", i, "SSTORE",
                 "RETURNDATASIZE", 0x100 + i, "SSTORE",
                 "RETURNDATASIZE", 0, 0, "RETURNDATACOPY", "RETURNDATASIZE", 0, "SHA3",
                 0x200 + i, "SSTORE"]
    a = int.from_bytes(arith, "big")
    code += [0x1234, 0, "MSTORE", 2**255 + 77, 32, "MSTORE", 3, 64, "MSTORE",
             64, 96, 96, 0, a, 100_000, "STATICCALL", 0x300, "SSTORE",
             64, 96, 96, 0, a, 300_000, "DELEGATECALL", 0x301, "SSTORE", 64, 96, "MLOAD",
             0x302, "SSTORE",
             32, 200, 96, 0, 11, a, 300_000, "CALL", 0x303, "SSTORE", 200, "MLOAD", 0x304,
             "SSTORE"]
    for i, precompile in enumerate([1, 2, 3, 4, 5, 9]):
        code += [32, 300, 128, 0, 0, precompile, 50_000, "CALL", 0x310 + i, "SSTORE",
                 300, "MLOAD", 0x320 + i, "SSTORE"]
    child = initcode(asm("CALLER", "SELFDESTRUCT"))
    code += [int.from_bytes(child, "big"), 0, "MSTORE",
             0x5EED, len(child), 32 - len(child), 3, "CREATE2", "DUP1", 0x330, "SSTORE",
             0, 0, 0, 0, 0, "DUP6", 100_000, "CALL", 0x331, "SSTORE",
             "EXTCODESIZE", 0x332, "SSTORE"]
    return asm(*code)


class Sender:
    def __init__(self, account):
        self.account, self.nonce = account, 0
        self.address = to_canonical_address(account.address)

    def tx(self, to: bytes | None, data: bytes = b"", value: int = 0,
           gas: int = 3_000_000, max_fee: int = 10**10) -> bytes:
        tx = {"data": data, "value": value, "gas": gas, "maxFeePerGas": max_fee,
              "maxPriorityFeePerGas": 1, "nonce": self.nonce, "chainId": CHAIN_ID, "type": 2}
        if to is not None:
            tx["to"] = Web3.to_checksum_address(to)
        self.nonce += 1
        return self.account.sign_transaction(tx).raw_transaction

    def market(self, fn: str, *args, value: int = 0, gas: int = 3_000_000) -> bytes:
        return self.tx(MARKET_ADDRESS, MARKET.encode_abi(fn, args=list(args)), value, gas)

    def create(self, runtime: bytes) -> tuple[bytes, bytes]:
        address = generate_contract_address(self.address, self.nonce)
        return self.tx(None, initcode(runtime)), address


def words(*values: int) -> bytes:
    return b"".join(v.to_bytes(32, "big") for v in values)


def call(chain, header, sender: bytes, to: bytes, data: bytes, value: int = 0):
    """(success, output, gas used, gas refund, logs) of a call executed on top of
    ``header``."""
    vm = chain.get_vm(header)
    with vm.in_costless_state() as state:
        tx = vm.create_unsigned_transaction(nonce=state.get_nonce(sender), gas_price=0,
                                            gas=5_000_000, to=to, value=value, data=data)
        computation = state.costless_execute_transaction(SpoofTransaction(tx, from_=sender))
    return (computation.is_success, computation.output, computation.get_gas_used(),
            computation.get_gas_refund(), computation.get_log_entries())


class Unfunded(bytes):
    """A transaction its sender cannot pay for when the block is sealed: it goes into the
    mempool without admission's checks (as one whose funds were spent meanwhile would), and
    sealing must drop it and still produce a valid block."""


def run_blocks(node: Node, blocks: list[list[bytes]]) -> list:
    sealed = []
    for raws in blocks:
        for raw in raws:
            if isinstance(raw, Unfunded):
                node.mempool.add(decode_transaction(bytes(raw)))
            else:
                node.admit(raw)
        block = node.seal()
        dropped = {keccak(raw) for raw in raws if isinstance(raw, Unfunded)}
        assert len(block.transactions) == len(raws) - len(dropped)
        assert not dropped & {tx.hash for tx in block.transactions}
        sealed.append(block)
    return sealed


@pytest.fixture
def scenario(tmp_path):
    """A fast-loop node after the scenario's blocks; the contracts' addresses."""
    node = Node(NodeConfig(tmp_path / "fast", block_time=0))
    deployer, submitter, worker, other, worker2, poor = (Sender(a) for a in dev_accounts(6))
    raw_arith, arith = deployer.create(arith_runtime())
    edges = [deployer.create(code) for code in EDGE_RUNTIMES.values()]
    edge_addresses = [address for _, address in edges]
    raw_probe, probe = deployer.create(probe_runtime(edge_addresses, arith))
    raw_rules, rules = deployer.create(storage_rules_runtime())
    raw_gas_probe, gas_probe = deployer.create(storage_gas_probe_runtime(rules))

    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((5, 4), np.float32), rng.standard_normal((4, 3), np.float32)
    a_id, b_id, good_c, bad_c = (node.blobs.put(encode_array(x))
                                 for x in (a, b, a @ b, a @ b + 1))
    blocks = [
        [raw_arith, raw_probe, raw_rules, raw_gas_probe, other.tx(rules, words(0)),
         *(raw for raw, _ in edges),
         worker.market("register", value=10**18),
         submitter.market("submitJob", a_id, b_id, 1, 5, 4, 3, 1, 50, value=10**15),
         submitter.market("submitJob", a_id, b_id, 1, 5, 4, 3, 1, 50, value=10**15),
         submitter.market("submitJob", a_id, b_id, 0, 5, 4, 3, 1, 50, value=10**15),  # bad
         submitter.market("submitJob", a_id, b_id, 1, 5, 4, 3, 1, 50, value=10**15,
                          gas=40_000),  # out of gas
         other.tx(submitter.address, value=12345),  # plain value transfer
         other.tx(b"\x77" * 20),  # touches a new empty account: EIP-161 removes it
         other.tx(b"\x78" * 20, b"\x01" * 1000, gas=100_000),  # EIP-7623 calldata floor
         other.tx(MARKET_ADDRESS, b"\xde\xad\xbe\xef", value=1)],  # unknown selector
        [worker.market("claimJob", 0), worker.market("claimJob", 1),
         other.market("claimJob", 0),  # not registered: reverts
         *(other.tx(arith, words(x, y, z)) for x, y, z in
           zip(EDGE_WORDS, reversed(EDGE_WORDS), EDGE_WORDS[3:] + EDGE_WORDS[:3],
               strict=True)),
         *(other.tx(address, words(i)) for i, address in enumerate(edge_addresses)),
         other.tx(probe, value=10**6, gas=12_000_000),
         other.tx(rules, words(1)), other.tx(gas_probe),
         other.tx(rules, words(1), gas=21_000 + 16 * 32 + 40_000),  # out of gas in SSTOREs
         other.tx(rules, words(0)),  # the setup again: every write a no-op
         Unfunded(poor.tx(other.address, value=1, gas=10**6, max_fee=10**40)),
         other.tx(rules, words(5))],  # six clearing refunds, capped
        [worker.market("commitResult", 0, good_c), worker.market("commitResult", 1, bad_c)],
        [worker.market("finalize", 0), worker.market("finalize", 1),  # pass, fail (slash)
         submitter.market("cancel", 0)],  # already verified: reverts
        # the market's steps mixed in one block, with transfers and several txs per sender
        [worker2.market("register", value=10**18),
         submitter.market("submitJob", a_id, b_id, 1, 5, 4, 3, 1, 50, value=10**15),
         worker2.market("claimJob", 1),  # reopened by the failed verification
         other.tx(worker2.address, value=10**9),
         worker2.market("commitResult", 1, good_c),
         submitter.market("submitJob", a_id, b_id, 1, 5, 4, 3, 1, 50, value=10**15)],
        [worker2.market("finalize", 1), worker2.market("claimJob", 2),
         submitter.tx(other.address, value=5), worker2.market("commitResult", 2, bad_c),
         submitter.market("submitJob", a_id, b_id, 1, 5, 4, 3, 1, 50, value=10**15)],
        [worker2.market("finalize", 2)],
    ]
    sealed = run_blocks(node, blocks)
    yield node, sealed, arith, edge_addresses, probe, other.address, rules, gas_probe
    node.stop()


def test_stock_py_evm_accepts_every_fast_block(scenario):
    node, sealed, *_ = scenario
    statuses = [r.state_root for block in sealed for r in block.get_receipts(node.chain.chaindb)]
    assert b"" in statuses and b"\x01" in statuses  # both failing and passing txs ran
    assert all(r.state_root == b"\x01" for block in sealed[4:]  # the mixed market blocks
               for r in block.get_receipts(node.chain.chaindb))
    # the probe's transaction ran to its end (its calls within its gas)
    assert [r.state_root for tx, r in zip(sealed[1].transactions,
                                          sealed[1].get_receipts(node.chain.chaindb), strict=True)
            if tx.to == scenario[4]] == [b"\x01"]
    stock = build_chain_class(node.blobs, fast=False).from_genesis(
        AtomicDB(), genesis_params(), genesis_state())
    accounts = [to_canonical_address(a.address) for a in dev_accounts(6)]
    for block in sealed:
        # full validation: re-executes with stock py-evm; any difference in state root,
        # receipts, logs bloom or gas used makes the import fail
        assert stock.import_block(block).imported_block.hash == block.hash
        ours, theirs = node.state_at(block.header), stock.get_vm(block.header).state
        for address in [*accounts, MARKET_ADDRESS, REWARD_POOL_ADDRESS]:
            assert (ours.get_nonce(address), ours.get_balance(address)) == \
                (theirs.get_nonce(address), theirs.get_balance(address))
    # the VM's header update per receipt (no deep copies) against Byzantium's own
    vm = node.chain.get_vm()
    for block in sealed:
        ours = theirs = block.header.copy(gas_used=0, bloom=0)
        for receipt in block.get_receipts(node.chain.chaindb):
            ours = vm.add_receipt_to_header(ours, receipt)
            theirs = ByzantiumVM.add_receipt_to_header(vm, theirs, receipt)
            assert ours == theirs and type(ours) is type(theirs)
        assert ours.hash == block.header.hash
    # the fast VM's next header against py-evm's create_header_from_parent, on every parent
    # (base fees moving up and down with the blocks' gas)
    fast_vm = type(vm)
    for block in sealed:
        parent = node.chain.get_block_header_by_hash(block.header.parent_hash)
        for timestamp in (parent.timestamp + 1, block.header.timestamp + 3600):
            ours = fast_vm.child_header(parent, REWARD_POOL_ADDRESS, timestamp)
            theirs = PragueVM.create_header_from_parent(
                parent, coinbase=REWARD_POOL_ADDRESS, timestamp=timestamp,
                gas_limit=parent.gas_limit)
            assert ours == theirs and type(ours) is type(theirs) and ours.hash == theirs.hash
    assert len({block.header.base_fee_per_gas for block in sealed}) > 2
    for a, b in zip(sealed[1].get_receipts(node.chain.chaindb),
                    stock.get_canonical_block_by_number(sealed[1].number).get_receipts(
                        stock.chaindb), strict=True):
        assert (a.state_root, a.gas_used, a.logs) == (b.state_root, b.gas_used, b.logs)


def test_calls_return_the_same_data_and_gas(scenario):
    node, sealed, arith, edges, _, caller, rules, gas_probe = scenario
    stock = build_chain_class(node.blobs, fast=False).from_genesis(
        AtomicDB(), genesis_params(), genesis_state())
    for block in sealed:
        stock.import_block(block)
    header = sealed[-1].header
    calls = [(arith, words(x, y, EDGE_WORDS[(i + j) % len(EDGE_WORDS)]), 0)
             for i, x in enumerate(EDGE_WORDS) for j, y in enumerate(EDGE_WORDS)]
    calls += [(address, b"", 0) for address in edges]
    depth = edges[list(EDGE_RUNTIMES).index("stack_depth")]
    calls += [(depth, words(n), 0) for n in (1022, 1023)]
    # (the probe runs in a block only: re-running its CREATE2 of a self-destructed child in a
    # discarded call state trips py-evm's storage journal, stock and fast alike)
    calls += [(MARKET_ADDRESS, Web3.to_bytes(hexstr=MARKET.encode_abi("getJob", args=[job])), 0)
              for job in (0, 1, 99)]
    calls += [(rules, words(routine), 0) for routine in (1, 2, 3, 0)]
    probed = call(node.chain, header, caller, gas_probe, b"")
    successes = [int.from_bytes(probed[1][i:i + 32], "big")
                 for i in range(32, len(probed[1]), 64)]
    for _, gas_values in GAS_SWEEPS:  # each sweep fails, then passes at the bound
        sweep, successes = successes[:len(gas_values)], successes[len(gas_values):]
        assert sweep[0] == 0 and sweep[-1] == 1 and sweep == sorted(sweep), (gas_values, sweep)
    calls += [(gas_probe, b"", 0)]
    outcomes = {True: 0, False: 0}
    for to, data, value in calls:
        fast = call(node.chain, header, caller, to, data, value)
        reference = call(stock, header, caller, to, data, value)
        assert fast == reference, to.hex()
        outcomes[fast[0]] += 1
    assert outcomes[True] > 5 and outcomes[False] > 5


def test_jump_destinations_match_py_evm():
    rng = np.random.default_rng(5)
    for _ in range(200):
        code = bytes(rng.choice([0x5B, 0x60, 0x61, 0x7F, 0x5F, 0x01, 0x00],
                                size=int(rng.integers(0, 120))).astype(np.uint8))
        stream = CodeStream(code)
        expected = {pc for pc in range(len(code))
                    if code[pc] == 0x5B and stream.is_valid_opcode(pc)}
        assert jump_destinations(code) == expected


def test_logs_bloom_matches_eth_bloom():
    rng = np.random.default_rng(6)
    for _ in range(200):
        entries = [(rng.bytes(20), [int.from_bytes(rng.bytes(32), "big") >> int(rng.integers(256))
                                    for _ in range(rng.integers(5))], b"")
                   for _ in range(rng.integers(4))]
        expected = BloomFilter.from_iterable(
            item for log in (Log(*entry) for entry in entries) for item in log.bloomables)
        assert logs_bloom(entries) == int(expected)
