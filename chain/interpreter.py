"""A faster EVM loop inside py-evm: the hot opcodes inline, every other one py-evm's own.

py-evm runs each opcode as an object call that charges gas through the gas meter and moves
values through its typed ``Stack``; for the market's ~345 opcodes per ``submitJob`` that
overhead is most of the execution time. This loop keeps the program counter and the gas in
locals and works on the stack's list directly. The inline opcodes (stack, arithmetic,
comparison, bitwise, jumps, memory words, call data, SHA3, the three memory copies, LOGs,
RETURN)
follow py-evm's semantics and charge the static gas of py-evm's own opcode table (and its word
gas for hashing and copying); SLOAD and SSTORE charge EIP-2929's warm/cold access
and EIP-2200/3529's gas and refunds, with py-evm's state calls in py-evm's order; every other
opcode is py-evm's function, called with the gas and program counter written back first and
read again after. Memory expansion (inline and py-evm's opcodes alike) is py-evm's rule
without its per-call argument checks and debug strings.

Why errors need no more care: every VM error but ``Revert`` burns all the gas of the frame,
and ``REVERT`` is py-evm's own, so the kind of error raised here never changes an outcome.
``tests/test_chain_fast_evm.py`` executes the same transactions through stock py-evm and
through this loop and compares state roots, gas, logs, receipts and return data.
"""
from __future__ import annotations

from functools import lru_cache

from eth._utils.numeric import ceil32
from eth.abc import ComputationAPI, MessageAPI, StateAPI, TransactionContextAPI
from eth.constants import GAS_COPY, GAS_LOGDATA, GAS_LOGTOPIC, GAS_SHA3WORD
from eth.exceptions import (
    FullStack,
    Halt,
    InsufficientStack,
    InvalidJumpDestination,
    OutOfGas,
    WriteProtection,
)
from eth.vm.computation import NO_RESULT, memory_gas_cost
from eth.vm.forks.berlin.constants import COLD_SLOAD_COST, WARM_STORAGE_READ_COST
from eth.vm.forks.london.storage import GAS_SCHEDULE_EIP3529
from eth.vm.forks.prague.computation import PragueComputation
from eth.vm.logic.invalid import InvalidOpcode
from eth_hash.auto import keccak

UINT256_MAX = 2**256 - 1
UINT256_CEILING = 2**256
INT256_MAX = 2**255 - 1
STACK_LIMIT = 1024

STOP, ADD, MUL, SUB, MOD = 0x00, 0x01, 0x02, 0x03, 0x06
LT, GT, SLT, SGT, EQ, ISZERO, AND, OR, XOR, NOT = range(0x10, 0x1A)
SHL, SHR = 0x1B, 0x1C
SHA3 = 0x20
CALLER, CALLVALUE, CALLDATALOAD, CALLDATASIZE, CALLDATACOPY = 0x33, 0x34, 0x35, 0x36, 0x37
CODECOPY = 0x39
POP, MLOAD, MSTORE, SLOAD, SSTORE = 0x50, 0x51, 0x52, 0x54, 0x55
JUMP, JUMPI = 0x56, 0x57
JUMPDEST, MCOPY = 0x5B, 0x5E
PUSH0, PUSH32 = 0x5F, 0x7F
DUP1, DUP16 = 0x80, 0x8F
SWAP1, SWAP16 = 0x90, 0x9F
LOG0, LOG4 = 0xA0, 0xA4
RETURN = 0xF3

INLINE = frozenset([
    STOP, ADD, MUL, SUB, MOD, LT, GT, SLT, SGT, EQ, ISZERO, AND, OR, XOR, NOT, SHL, SHR, SHA3,
    CALLER, CALLVALUE, CALLDATALOAD, CALLDATASIZE, CALLDATACOPY, CODECOPY, POP, MLOAD, MSTORE,
    SLOAD, SSTORE, JUMP, JUMPI, JUMPDEST, MCOPY, RETURN, *range(LOG0, LOG4 + 1),
    *range(PUSH0, PUSH32 + 1), *range(DUP1, DUP16 + 1), *range(SWAP1, SWAP16 + 1),
])


@lru_cache(maxsize=1024)
def jump_destinations(code: bytes) -> frozenset[int]:
    """Positions of JUMPDEST opcodes that are not inside PUSH data (yellow paper 9.4.3)."""
    valid = []
    pc, length = 0, len(code)
    while pc < length:
        op = code[pc]
        if op == JUMPDEST:
            valid.append(pc)
        pc += 1 + (op - PUSH0 if PUSH0 < op <= PUSH32 else 0)
    return frozenset(valid)


@lru_cache(maxsize=16)
def _inline_gas(computation_class: type[ComputationAPI]) -> tuple[int, ...]:
    """Static gas of each inline opcode from the fork's opcode table; 0 for the others
    (py-evm's opcode functions charge their own)."""
    table = computation_class.opcodes
    return tuple(table[op].gas_cost if op in INLINE else 0 for op in range(256))


# EIP-2200 as amended by EIP-2929 (cold slots) and EIP-3529 (smaller clearing refund)
SSTORE_STIPEND = 2300  # SSTORE fails when no more than the call stipend is left
SSTORE_NOOP_GAS = GAS_SCHEDULE_EIP3529.sload_gas
SSTORE_SET_GAS = GAS_SCHEDULE_EIP3529.sstore_set_gas
SSTORE_RESET_GAS = GAS_SCHEDULE_EIP3529.sstore_reset_gas
SSTORE_CLEAR_REFUND = GAS_SCHEDULE_EIP3529.sstore_clears_schedule


def sstore_gas(original: int, current: int, new: int) -> tuple[int, int]:
    """Gas and refund (may be negative) of writing ``new`` over ``current``, the slot holding
    ``original`` when the transaction began; the cold-slot surcharge is charged apart."""
    if current == new:
        return SSTORE_NOOP_GAS, 0
    if original == current:
        if original == 0:
            return SSTORE_SET_GAS, 0
        return SSTORE_RESET_GAS, SSTORE_CLEAR_REFUND if new == 0 else 0
    refund = 0
    if original != 0:
        if current == 0:
            refund -= SSTORE_CLEAR_REFUND
        if new == 0:
            refund += SSTORE_CLEAR_REFUND
    if original == new:
        refund += (SSTORE_SET_GAS if original == 0 else SSTORE_RESET_GAS) - SSTORE_NOOP_GAS
    return SSTORE_NOOP_GAS, refund


def _signed(value: int) -> int:
    return value if value <= INT256_MAX else value - UINT256_CEILING


def execute_code(computation: ComputationAPI) -> None:
    """Run the frame's code until it halts; VM errors propagate (the computation's
    ``__exit__`` records them and burns the gas, exactly as for py-evm's own loop)."""
    code = computation.msg.code
    code_stream = computation.code
    opcodes = computation.opcodes
    inline_gas = _inline_gas(type(computation))
    destinations = jump_destinations(code)
    stack = computation._stack.values
    push, pop = stack.append, stack.pop
    memory = computation._memory
    meter = computation._gas_meter
    state, storage_address = computation.state, computation.msg.storage_address
    gas = meter.gas_remaining
    pc, end = 0, len(code)
    try:
        while pc < end:
            op = code[pc]
            pc += 1
            cost = inline_gas[op]
            if cost > gas:
                raise OutOfGas(f"Out of gas: needed {cost}, remaining {gas} (opcode {op:#x})")
            gas -= cost
            if PUSH0 <= op <= PUSH32:
                size = op - PUSH0
                if len(stack) >= STACK_LIMIT:
                    raise FullStack("Stack limit reached")
                # (a PUSH cut short by the end of the code is the last instruction: the
                # missing bytes are never read)
                push(int.from_bytes(code[pc:pc + size], "big"))
                pc += size
            elif DUP1 <= op <= DUP16:
                if len(stack) >= STACK_LIMIT:
                    raise FullStack("Stack limit reached")
                push(stack[DUP1 - 1 - op])
            elif SWAP1 <= op <= SWAP16:
                other = SWAP1 - 2 - op
                stack[-1], stack[other] = stack[other], stack[-1]
            elif op == MLOAD:
                start = pop()
                if start + 32 > len(memory._bytes):
                    meter.gas_remaining = gas
                    computation.extend_memory(start, 32)
                    gas = meter.gas_remaining
                push(int.from_bytes(memory._bytes[start:start + 32], "big"))
            elif op == MSTORE:
                start, value = pop(), pop()
                if start + 32 > len(memory._bytes):
                    meter.gas_remaining = gas
                    computation.extend_memory(start, 32)
                    gas = meter.gas_remaining
                memory._bytes[start:start + 32] = value.to_bytes(32, "big")
            elif op == JUMPI:
                dest, condition = pop(), pop()
                if condition:
                    if dest not in destinations:
                        raise InvalidJumpDestination("Invalid Jump Destination")
                    pc = dest
            elif op == JUMP:
                dest = pop()
                if dest not in destinations:
                    raise InvalidJumpDestination("Invalid Jump Destination")
                pc = dest
            elif op == JUMPDEST:
                pass
            elif op == POP:
                pop()
            elif op == ISZERO:
                push(0 if pop() else 1)
            elif op == OR:
                push(pop() | pop())
            elif op == AND:
                push(pop() & pop())
            elif op == XOR:
                push(pop() ^ pop())
            elif op == NOT:
                push(UINT256_MAX ^ pop())
            elif op == SHL:
                shift, value = pop(), pop()
                push((value << shift) & UINT256_MAX if shift < 256 else 0)
            elif op == SHR:
                shift, value = pop(), pop()
                push(value >> shift if shift < 256 else 0)
            elif op == ADD:
                push((pop() + pop()) & UINT256_MAX)
            elif op == SUB:
                left, right = pop(), pop()
                push((left - right) & UINT256_MAX)
            elif op == MUL:
                push((pop() * pop()) & UINT256_MAX)
            elif op == LT:
                left, right = pop(), pop()
                push(1 if left < right else 0)
            elif op == GT:
                left, right = pop(), pop()
                push(1 if left > right else 0)
            elif op == SLT:
                left, right = pop(), pop()
                push(1 if _signed(left) < _signed(right) else 0)
            elif op == SGT:
                left, right = pop(), pop()
                push(1 if _signed(left) > _signed(right) else 0)
            elif op == EQ:
                push(1 if pop() == pop() else 0)
            elif op == CALLDATALOAD:
                start = pop()
                push(int.from_bytes(computation.msg.data_as_bytes[start:start + 32]
                                    .ljust(32, b"\0"), "big"))
            elif op == CALLVALUE:
                if len(stack) >= STACK_LIMIT:
                    raise FullStack("Stack limit reached")
                push(computation.msg.value)
            elif op == CALLER:
                if len(stack) >= STACK_LIMIT:
                    raise FullStack("Stack limit reached")
                push(int.from_bytes(computation.msg.sender, "big"))
            elif op == CALLDATASIZE:
                if len(stack) >= STACK_LIMIT:
                    raise FullStack("Stack limit reached")
                push(len(computation.msg.data_as_bytes))
            elif op == SLOAD:
                slot = pop()
                if state.is_storage_warm(storage_address, slot):
                    cost = WARM_STORAGE_READ_COST
                else:
                    state.mark_storage_warm(storage_address, slot)
                    cost = COLD_SLOAD_COST
                if cost > gas:
                    raise OutOfGas(f"Out of gas: SLOAD needed {cost}, remaining {gas}")
                gas -= cost
                push(state.get_storage(storage_address, slot))
            elif op == SSTORE:  # in py-evm's order of checks, reads and writes
                if computation.msg.is_static:
                    raise WriteProtection("SSTORE inside a STATICCALL context")
                if gas <= SSTORE_STIPEND:
                    raise OutOfGas(f"SSTORE with {gas} gas left, at most the call stipend")
                slot, value = pop(), pop()
                current = state.get_storage(storage_address, slot)
                original = state.get_storage(storage_address, slot, from_journal=False)
                cost, refund = sstore_gas(original, current, value)
                if cost > gas:
                    raise OutOfGas(f"Out of gas: SSTORE needed {cost}, remaining {gas}")
                gas -= cost
                if refund:
                    meter.refund_gas(refund)
                state.set_storage(storage_address, slot, value)
                if not state.is_storage_warm(storage_address, slot):
                    state.mark_storage_warm(storage_address, slot)
                    if COLD_SLOAD_COST > gas:
                        raise OutOfGas(f"Out of gas: cold SSTORE slot, remaining {gas}")
                    gas -= COLD_SLOAD_COST
            elif op == SHA3 or op == RETURN:
                start, size = pop(), pop()
                if size and start + size > len(memory._bytes):
                    meter.gas_remaining = gas
                    computation.extend_memory(start, size)
                    gas = meter.gas_remaining
                data = bytes(memory._bytes[start:start + size])
                if op == RETURN:
                    computation.output = data
                    break
                cost = GAS_SHA3WORD * ((size + 31) // 32)
                if cost > gas:
                    raise OutOfGas(f"Out of gas: SHA3 word gas {cost}, remaining {gas}")
                gas -= cost
                push(int.from_bytes(keccak(data), "big"))
            elif op == CALLDATACOPY or op == CODECOPY or op == MCOPY:
                # py-evm's order: memory expansion (MCOPY: to the farther of its two ends),
                # copy gas, then the copy (source bytes past the end read as zeros)
                target, source, size = pop(), pop(), pop()
                reach = max(target, source) if op == MCOPY else target
                if size and reach + size > len(memory._bytes):
                    meter.gas_remaining = gas
                    computation.extend_memory(reach, size)
                    gas = meter.gas_remaining
                cost = GAS_COPY * ((size + 31) // 32)
                if cost > gas:
                    raise OutOfGas(f"Out of gas: copy gas {cost}, remaining {gas}")
                gas -= cost
                if size:
                    if op == MCOPY:
                        data = memory._bytes[source:source + size]
                    else:
                        data = (computation.msg.data_as_bytes if op == CALLDATACOPY
                                else code)[source:source + size].ljust(size, b"\0")
                    memory._bytes[target:target + size] = data
            elif LOG0 <= op <= LOG4:  # py-evm's order: static check, topic and data gas,
                if computation.msg.is_static:  # memory expansion, the entry
                    raise WriteProtection("LOG inside a STATICCALL context")
                start, size = pop(), pop()
                topics = tuple([pop() for _ in range(op - LOG0)])
                cost = GAS_LOGDATA * size + GAS_LOGTOPIC * len(topics)
                if cost > gas:
                    raise OutOfGas(f"Out of gas: LOG needed {cost}, remaining {gas}")
                gas -= cost
                if size and start + size > len(memory._bytes):
                    meter.gas_remaining = gas
                    computation.extend_memory(start, size)
                    gas = meter.gas_remaining
                computation.add_log_entry(storage_address, topics,
                                          bytes(memory._bytes[start:start + size]))
            elif op == MOD:
                value, modulus = pop(), pop()
                push(value % modulus if modulus else 0)
            elif op == STOP:
                break
            else:  # py-evm's own opcode function charges its gas and may move the pc
                meter.gas_remaining = gas
                code_stream.program_counter = pc
                function = opcodes.get(op)
                try:
                    (function or InvalidOpcode(op))(computation=computation)
                except Halt:
                    return
                gas = meter.gas_remaining
                pc = code_stream.program_counter
                if stack and isinstance(stack[-1], bytes):  # py-evm may push bytes
                    stack[-1] = int.from_bytes(stack[-1], "big")
    except IndexError as exc:  # a pop or DUP/SWAP below the bottom of the stack
        raise InsufficientStack(f"stack underflow at pc {pc - 1}") from exc
    meter.gas_remaining = gas


class FastComputation(PragueComputation):
    """Prague's computation with ``execute_code`` as its opcode loop."""

    def extend_memory(self, start_position: int, size: int) -> None:
        """py-evm's memory expansion (same gas, same growth) without its argument checks
        (the arguments are stack words, uint256 by construction) and its debug strings."""
        if not size:
            return
        memory = self._memory
        before_size, after_size = len(memory), ceil32(start_position + size)
        if after_size > before_size:
            fee = memory_gas_cost(after_size) - memory_gas_cost(before_size)
            meter = self._gas_meter
            if fee > meter.gas_remaining:
                raise OutOfGas(f"Out of gas: expanding memory to {after_size} bytes needs "
                               f"{fee}, remaining {meter.gas_remaining}")
            meter.gas_remaining -= fee
            memory.extend(start_position, size)

    @classmethod
    def apply_computation(
        cls,
        state: StateAPI,
        message: MessageAPI,
        transaction_context: TransactionContextAPI,
        parent_computation: ComputationAPI | None = None,
    ) -> ComputationAPI:
        # the same frame set-up as py-evm's BaseComputation.apply_computation
        with cls(state, message, transaction_context) as computation:
            if computation.is_origin_computation:
                computation.contracts_created = []
                if message.is_create:
                    cls.consume_initcode_gas_cost(computation)
            if parent_computation is not None:
                computation.contracts_created = parent_computation.contracts_created
            if message.is_create:
                computation.contracts_created.append(message.storage_address)
            precompile = computation.precompiles.get(message.code_address, NO_RESULT)
            if precompile is not NO_RESULT:
                if not message.is_delegation:
                    precompile(computation)
                return computation
            execute_code(computation)
        return computation
