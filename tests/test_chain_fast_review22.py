"""Differential fuzzing of the fast execution path against stock py-evm.

Two chains start from the same genesis (the dev network's, plus contracts of random,
structured bytecode with pre-set storage): one built with ``build_chain_class(fast=True)``,
one with ``fast=False``. Each block's transactions (calls with random call data, value, gas
and access lists, contract creations, EIP-7702 set-code transactions) are executed and
sealed on both, and everything observable must agree: every frame of every transaction
(success, return data, gas left, refund), receipts (status, cumulative gas, logs), created
contracts, self-destructs, the accounts' nonces, balances, code and storage after each
transaction, and the sealed block (its hash commits to the state, receipt and transaction
roots, bloom and gas used).

The generated code mixes the loop's inline opcodes with py-evm's: stack under- and
overflow, invalid opcodes, jumps into PUSH data, nested CALL/CALLCODE/DELEGATECALL/
STATICCALL/CREATE/CREATE2 with every kind of gas and value (self, empty and missing
accounts, precompiles, the Freivalds precompile with bad input), SSTORE's EIP-2200/3529
cases over pre-set slots, TSTORE/TLOAD, MCOPY, SELFDESTRUCT of new and old contracts,
memory expansion, RETURNDATACOPY out of bounds, EXTCODEHASH, BLOCKHASH, BASEFEE,
BLOBBASEFEE. Each generated case is a few blocks, so state carries across blocks.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import rlp
from eth.db.atomic import AtomicDB
from eth.vm import opcode_values
from eth.vm.forks.prague.transactions import PragueTransactionBuilder
from eth_hash.auto import keccak
from eth_keys import keys
from test_chain_fast_evm import asm

from chain.blobs import BlobStore
from chain.genesis import genesis_params, genesis_state
from chain.params import CHAIN_ID, FREIVALDS_ADDRESS, REWARD_POOL_ADDRESS
from chain.vm import build_chain_class

CASES = int(os.environ.get("REVIEW22_CASES", "96"))  # more for a longer hunt
KEYS = [keys.PrivateKey(keccak(b"review22 %d" % i)) for i in range(4)]
SENDERS = [key.public_key.to_canonical_address() for key in KEYS]
AUTHORITY_KEYS = [keys.PrivateKey(keccak(b"review22 authority %d" % i)) for i in range(3)]
AUTHORITIES = [key.public_key.to_canonical_address() for key in AUTHORITY_KEYS]
CONTRACTS = [bytes(18) + bytes([0xC1, i]) for i in range(6)]
MISSING = bytes(18) + b"\xde\xad"  # never has an account
FUNDED = bytes(18) + b"\xfe\xed"  # an account with balance, no code
EMPTY = bytes(18) + b"\xe0\xe0"  # an empty account in the genesis (EIP-161 removes it)
PRECOMPILES = [bytes(19) + bytes([i]) for i in range(1, 0x12)] + [FREIVALDS_ADDRESS]
PRESET_SLOTS = {0: 1, 1: 7, 2: 2**256 - 1}
SLOTS = [0, 1, 2, 3, 4, 2**255]
WORDS = [0, 1, 2, 31, 32, 255, 256, 2**255, 2**256 - 1]
SMALL_GAS = [0, 1, 2300, 2301, 5000, 25_000, 60_000]


def address_word(address: bytes) -> int:
    return int.from_bytes(address, "big")


def returning(runtime: bytes) -> bytes:
    """Initcode that returns ``runtime``."""
    prefix = asm(bytes([opcode_values.PUSH2]) + len(runtime).to_bytes(2, "big"), "DUP1",
                 bytes([opcode_values.PUSH1, 10]), "PUSH0", "CODECOPY", "PUSH0", "RETURN")
    return prefix + runtime


class CodeGenerator:
    """Random bytecode built from fragments that each exercise one rule."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def pick(self, options):
        return options[int(self.rng.integers(len(options)))]

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def offset(self) -> int:
        if self.chance(0.9):
            return int(self.rng.integers(0, 200))
        return self.pick([2**12, 2**16 + 3, 2**24, 2**32, 2**64, 2**255])

    def size(self) -> int:
        if self.chance(0.85):
            return self.pick([0, 1, 20, 32, 33, 64, 100])
        return self.pick([2**10, 2**16, 2**32, 2**256 - 1])

    def target(self) -> list:
        options = [["ADDRESS"], ["CALLER"], ["ORIGIN"], ["COINBASE"]]
        options += [[address_word(a)] for a in (*CONTRACTS, MISSING, FUNDED, EMPTY, *SENDERS,
                                                *AUTHORITIES, *PRECOMPILES)]
        options += [[address_word(bytes(19) + bytes([self.pick([0, 0x50, 0xF2])]))]]
        return self.pick(options)

    def gas(self) -> list:
        kind = int(self.rng.integers(4))
        if kind == 0:
            return ["GAS"]
        if kind == 1:
            return [self.pick(SMALL_GAS)]
        if kind == 2:
            return [int(self.rng.integers(10_000, 400_000))]
        return [2**256 - 1]

    def value(self) -> int:
        return self.pick([0, 0, 0, 1, 10**9, 2**255])

    def call(self) -> list:
        op = self.pick(["CALL", "CALLCODE", "DELEGATECALL", "STATICCALL"])
        out_size, out_offset, in_size, in_offset = (self.size(), self.offset(), self.size(),
                                                    self.offset())
        args = [out_size, out_offset, in_size, in_offset]
        if op in ("CALL", "CALLCODE"):
            args.append(self.value())
        return [*args, *self.target(), *self.gas(), op, *self.record()]

    def record(self) -> list:
        """Stores the value on top of the stack into a random slot (or memory, or a log)."""
        kind = int(self.rng.integers(4))
        if kind == 0:
            return [self.pick(SLOTS), "SSTORE"]
        if kind == 1:
            return ["MSIZE", "MSTORE"]
        if kind == 2:
            return [self.pick(SLOTS), "TSTORE"]
        return [0, "MSTORE", 32, 0, "LOG0"]

    def initcode(self) -> bytes:
        kind = int(self.rng.integers(7))
        if kind == 0:
            return returning(self.code(4, nested=False))
        if kind == 1:  # EIP-6780: destroyed in the transaction that created it
            return asm(*self.sstore(), *self.target(), "SELFDESTRUCT")
        if kind == 2:
            return returning(asm(*self.target(), "SELFDESTRUCT"))
        if kind == 3:
            return asm(*self.sstore(), 32, 0, "REVERT")
        if kind == 4:  # EIP-3541: code starting with 0xEF is refused
            return asm(0xEF, 0, "MSTORE8", 1, 0, "RETURN")
        if kind == 5:  # EIP-170: code above 24576 bytes is refused
            return asm(self.pick([24_576, 24_577]), 0, "RETURN")
        return self.code(5, nested=False)

    def create(self) -> list:
        init = self.initcode()
        code = []
        for i in range(0, len(init), 32):
            chunk = init[i:i + 32].ljust(32, b"\0")
            code += [int.from_bytes(chunk, "big"), i, "MSTORE"]
        size = len(init) if self.chance(0.9) else self.size()
        if self.chance(0.5):
            code += [self.pick([0, 1, 2]), size, 0, self.value(), "CREATE2"]
        else:
            code += [size, 0, self.value(), "CREATE"]
        if self.chance(0.5):  # call the new contract
            code += ["DUP1", 0, 0, 0, 0, self.value(), "DUP6", *self.gas(), "CALL", "POP"]
        return code + self.record()

    def sstore(self) -> list:
        value = self.pick([0, 0, 1, 7, 8, 2**256 - 1])
        return [value, self.pick(SLOTS), "SSTORE"]

    def fragment(self, nested: bool) -> list:
        if self.chance(0.08):
            return self.hazard()
        kind = int(self.rng.integers(30 if nested else 20))
        pick, offset, size = self.pick, self.offset, self.size
        if kind < 4:
            return self.sstore()
        if kind == 4:
            return [pick(SLOTS), "SLOAD", *self.record()]
        if kind == 5:
            return [pick(WORDS), pick(SLOTS), "TSTORE", pick(SLOTS), "TLOAD", *self.record()]
        if kind == 6:
            return [pick(WORDS), pick(WORDS), pick(["ADD", "SUB", "MUL", "DIV", "SDIV", "MOD",
                                                   "SMOD", "EXP", "SIGNEXTEND", "SHL", "SHR",
                                                   "SAR", "BYTE", "SLT", "SGT", "LT"]),
                    *self.record()]
        if kind == 7:
            return [size(), offset(), offset(), "MCOPY"]
        if kind == 8:
            return [pick(WORDS), offset(), pick(["MSTORE", "MSTORE8"])]
        if kind == 9:
            return [offset(), "MLOAD", *self.record()]
        if kind == 10:
            return [size(), offset(), offset(), pick(["RETURNDATACOPY", "CALLDATACOPY",
                                                      "CODECOPY"])]
        if kind == 11:
            return [*self.target(), pick(["EXTCODEHASH", "EXTCODESIZE", "BALANCE"]),
                    *self.record()]
        if kind == 12:
            return [size(), offset(), offset(), *self.target(), "EXTCODECOPY"]
        if kind == 13:
            block = pick([["NUMBER", 1, "SWAP1", "SUB"], ["NUMBER"], [0], [2**64],
                          ["NUMBER", 257, "SWAP1", "SUB"]])
            return [*block, "BLOCKHASH", *self.record()]
        if kind == 14:
            return [pick(["BASEFEE", "BLOBBASEFEE", "PUSH0", "GAS", "PC", "MSIZE",
                          "RETURNDATASIZE", "SELFBALANCE", "GASLIMIT", "CHAINID",
                          "PREVRANDAO", "TIMESTAMP", "NUMBER", "CALLVALUE",
                          "CALLDATASIZE", "CODESIZE", "GASPRICE"]), *self.record()]
        if kind == 15:
            topics = int(self.rng.integers(5))
            return [*[pick(WORDS) for _ in range(topics)], size(), offset(), f"LOG{topics}"]
        if kind == 16:
            return [size(), offset(), "SHA3", *self.record()]
        if kind == 17:
            return [pick(WORDS), "CALLDATALOAD", *self.record()]
        if kind == 18:
            return [pick([0, 1, 7]), "CALLDATALOAD", 1, "ADD", 0, "MSTORE"]
        if kind == 19:
            return [pick(["CALLER", "ADDRESS", "ORIGIN"]), *self.record()]
        if kind < 25:
            return self.call()
        if kind < 28:
            return self.create()
        return self.freivalds()

    def hazard(self) -> list:
        """A jump to a random place (JUMPDEST, PUSH data or anywhere), stack depth games, or
        a random byte (often an invalid opcode)."""
        kind = int(self.rng.integers(3))
        if kind == 0:
            return [int(self.rng.integers(0, 300)), self.pick(["JUMP", "JUMPI"])] + (
                [] if self.chance(0.5) else ["JUMPDEST"])
        if kind == 1:
            return self.pick([["DUP16"], ["SWAP16"], ["POP"], ["ADD"],
                              [1, 2, "SWAP1", "POP", "POP"]])
        return [bytes([int(self.rng.integers(256))])]

    def freivalds(self) -> list:
        """The chain's precompile called with malformed or random input."""
        words = [int(self.rng.integers(0, 2**32)) for _ in range(self.pick([0, 3, 10, 11]))]
        code = []
        for i, word in enumerate(words):
            code += [self.pick([word, 1, 64]), 32 * i, "MSTORE"]
        return code + [32, 0, 32 * len(words), 0, address_word(FREIVALDS_ADDRESS),
                       *self.gas(), "STATICCALL", *self.record()]

    def ending(self) -> list:
        kind = int(self.rng.integers(8))
        if kind == 0:
            return [self.size(), self.offset(), "REVERT"]
        if kind == 1:
            return [self.size(), self.offset(), "RETURN"]
        if kind == 2:
            return [*self.target(), "SELFDESTRUCT"]
        if kind == 3:
            return [b"\xfe"]
        return ["STOP"]

    def code(self, fragments: int, nested: bool = True) -> bytes:
        items = [item for _ in range(fragments) for item in self.fragment(nested)]
        return asm(*items, *self.ending())


class Pair:
    """A fast chain and a stock chain, sealed block by block with the same transactions."""

    def __init__(self, tmp_path, contracts: dict[bytes, bytes]) -> None:
        state = genesis_state()
        for sender in SENDERS:
            state[sender] = {"nonce": 0, "code": b"", "storage": {}, "balance": 10**26}
        state[FUNDED] = {"nonce": 0, "code": b"", "storage": {}, "balance": 10**18}
        state[EMPTY] = {"nonce": 0, "code": b"", "storage": {}, "balance": 0}
        for address, code in contracts.items():
            state[address] = {"nonce": 1, "code": code, "storage": dict(PRESET_SLOTS),
                              "balance": 10**15}
        store = BlobStore(tmp_path / "blobs")
        self.chains = [build_chain_class(store, fast=fast).from_genesis(
            AtomicDB(), genesis_params(), state) for fast in (True, False)]
        self.nonces = [0] * len(KEYS)
        self.watched = {*SENDERS, *AUTHORITIES, *contracts, MISSING, FUNDED, EMPTY,
                        REWARD_POOL_ADDRESS}

    def transaction(self, rng, sender: int, to: bytes, data: bytes = b"", value: int = 0,
                    gas: int = 2_000_000, access_list=(), authorizations=None):
        """A signed transaction of type 2 (EIP-1559), 4 (EIP-7702: with ``authorizations``),
        or at random 1 (EIP-2930) or 0 (legacy, EIP-155), with at least its intrinsic gas."""
        builder, nonce = PragueTransactionBuilder, self.nonces[sender]
        self.nonces[sender] += 1
        fields = dict(nonce=nonce, gas=gas, to=to, value=value, data=data)
        kind = int(rng.integers(6))
        if authorizations is not None:
            unsigned = builder.new_unsigned_set_code_transaction(
                chain_id=CHAIN_ID, max_priority_fee_per_gas=int(rng.integers(0, 3)),
                max_fee_per_gas=10**10, access_list=list(access_list),
                authorization_list=authorizations, **fields)
        elif kind == 0:
            unsigned = builder.create_unsigned_transaction(gas_price=10**10, **fields)
        elif kind == 1:
            unsigned = builder.new_unsigned_access_list_transaction(
                chain_id=CHAIN_ID, gas_price=10**10, access_list=list(access_list), **fields)
        else:
            unsigned = builder.new_unsigned_dynamic_fee_transaction(
                chain_id=CHAIN_ID, max_priority_fee_per_gas=int(rng.integers(0, 3)),
                max_fee_per_gas=10**10, access_list=list(access_list), **fields)
        if unsigned.intrinsic_gas > gas:  # enough for the intrinsic gas, maybe no more
            unsigned = unsigned.copy(gas=unsigned.intrinsic_gas + int(rng.integers(0, 3000)))
        return unsigned.as_signed_transaction(KEYS[sender], chain_id=CHAIN_ID)

    def seal(self, transactions) -> None:
        """Both chains execute and seal the block; every transaction's outcome and the
        watched accounts are compared after each, and the sealed blocks."""
        (fast, fast_block), (stock, stock_block) = [self._run(chain, transactions)
                                                    for chain in self.chains]
        for fast_outcome, stock_outcome in zip(fast, stock, strict=True):
            assert fast_outcome == stock_outcome
        assert fast_block.header == stock_block.header
        for _, created in fast:
            self.watched.update(created)

    def _run(self, chain, transactions):
        parent = chain.get_canonical_head()
        header = chain.get_vm_class_for_block_number(parent.block_number + 1).child_header(
            parent, REWARD_POOL_ADDRESS, parent.timestamp + 12)
        vm = chain.get_vm(header)
        vm.block_preprocessing(vm.get_block())
        header = vm.get_header()
        outcomes, receipts = [], []
        for tx in transactions:
            receipt, computation = vm.apply_transaction(header, tx)
            header = vm.add_receipt_to_header(header, receipt)
            receipts.append(receipt)
            created = sorted(computation.contracts_created or [])
            outcomes.append(((receipt.state_root, receipt.gas_used, receipt.logs,
                              frames(computation), self.accounts(vm.state, created)),
                             created))
        block = vm.seal_block(header, transactions, receipts, b"")  # validates it too
        chain.chaindb.persist_block(block)
        return outcomes, block

    def accounts(self, state, created) -> list:
        return [(address, state.get_nonce(address), state.get_balance(address),
                 state.get_code(address), state.account_exists(address),
                 [state.get_storage(address, slot) for slot in SLOTS])
                for address in sorted({*self.watched, *created})]


def frames(computation) -> list:
    """Every frame of a transaction, depth first: (depth, address, success, output, gas
    left, refund, logs, self-destructs)."""
    out = []
    stack = [computation]
    while stack:
        frame = stack.pop()
        out.append((frame.msg.depth, frame.msg.storage_address, frame.is_success,
                    frame.output, frame.get_gas_remaining(), frame.get_gas_refund(),
                    frame.get_log_entries(), sorted(frame.get_accounts_for_deletion())))
        stack.extend(reversed(frame.children))
    return out


def authorization(rng, gen: CodeGenerator, state) -> dict:
    """An EIP-7702 authorization by one of the authorities: mostly valid (current nonce,
    this chain or any), delegating to a contract, an authority, an empty account, a
    precompile or nobody (the zero address clears the delegation)."""
    index = int(rng.integers(len(AUTHORITY_KEYS)))
    nonce = state.get_nonce(AUTHORITIES[index]) + int(rng.choice([0, 0, 0, 1]))
    chain_id = int(rng.choice([CHAIN_ID, CHAIN_ID, 0, 5]))
    target = gen.pick([*CONTRACTS, *CONTRACTS, *AUTHORITIES, MISSING, PRECOMPILES[0],
                       bytes(20)])
    message = b"\x05" + rlp.encode([chain_id, target, nonce])
    y_parity, r, s = AUTHORITY_KEYS[index].sign_msg(message).vrs
    return {"chain_id": chain_id, "address": target, "nonce": nonce, "y_parity": y_parity,
            "r": r, "s": s}


def random_transactions(rng, gen: CodeGenerator, pair: Pair, count: int) -> list:
    """Calls of the random contracts, creations with random initcode, plain transfers and
    set-code transactions, with random gas, value and access lists."""
    txs = []
    for _ in range(count):
        sender = int(rng.integers(len(KEYS)))
        kind = int(rng.integers(12))
        gas = int(rng.choice([60_000, 300_000, 2_000_000, 30_000_000]))
        value = int(rng.choice([0, 0, 1, 10**18]))
        access = []
        if rng.random() < 0.3:
            access = [(gen.pick([*CONTRACTS, MISSING, *PRECOMPILES[:3]]),
                       [gen.pick(SLOTS) for _ in range(int(rng.integers(3)))])
                      for _ in range(int(rng.integers(1, 3)))]
        if kind < 7:
            data = b"".join(int(gen.pick(WORDS)).to_bytes(32, "big")
                            for _ in range(int(rng.integers(3))))
            txs.append(pair.transaction(rng, sender, gen.pick(CONTRACTS), data, value, gas,
                                        access))
        elif kind < 9:
            txs.append(pair.transaction(rng, sender, b"", gen.initcode(), value, gas, access))
        elif kind < 10:
            txs.append(pair.transaction(rng, sender, gen.pick([MISSING, FUNDED, EMPTY, *SENDERS]),
                                        b"", value, 21_000 + 2_000))
        else:  # set-code, mostly sent to an authority (whose delegation it may set)
            state = pair.chains[0].get_vm().state
            authorizations = [authorization(rng, gen, state)
                              for _ in range(int(rng.integers(1, 4)))]
            to = gen.pick([*AUTHORITIES, *AUTHORITIES, gen.pick(CONTRACTS)])
            data = int(gen.pick(WORDS)).to_bytes(32, "big")
            txs.append(pair.transaction(rng, sender, to, data, value, gas, access,
                                        authorizations))
    return txs


def fuzz_case(tmp_path, seed: int, blocks: int = 3, per_block: int = 8) -> None:
    """Random contracts in the genesis, then blocks of random transactions."""
    rng = np.random.default_rng(seed)
    gen = CodeGenerator(rng)
    contracts = {address: gen.code(int(rng.integers(3, 14))) for address in CONTRACTS}
    pair = Pair(tmp_path / str(seed), contracts)
    for _ in range(blocks):
        pair.seal(random_transactions(rng, gen, pair, per_block))


@pytest.mark.parametrize("seed", range(CASES))
def test_random_blocks_agree(tmp_path, seed):
    fuzz_case(tmp_path, seed)


def test_recreated_contract_storage(tmp_path):
    """EIP-6780: a contract created and destroyed in one transaction, created again at the
    same address (CREATE2) by a later transaction of the block, writes its slots as new
    ones."""
    factory = CONTRACTS[0]
    create2 = asm("CALLDATASIZE", 0, 0, "CALLDATACOPY", 0, "CALLDATASIZE", 0, "CALLVALUE",
                  "CREATE2", 0, "SSTORE")
    # stores 5 in slot 0, then self-destructs if sent value, else returns no code
    init = asm(5, 0, "SSTORE", "CALLVALUE", 9, "JUMPI", "STOP", "JUMPDEST", "CALLER",
               "SELFDESTRUCT")
    pair = Pair(tmp_path, {factory: create2})
    rng = np.random.default_rng(0)
    pair.seal([pair.transaction(rng, 0, factory, init, value=1),
               pair.transaction(rng, 0, factory, init),
               pair.transaction(rng, 1, factory, init)])


def test_set_code_transaction_calls_its_new_delegation(tmp_path):
    """EIP-7702: a set-code transaction sent to one of its own authorities runs the code the
    authorization just delegated to (py-evm applies the authorizations before it reads the
    destination's code; the fast executor read it first and ran the authority's old, empty
    code)."""
    delegate = CONTRACTS[0]
    pair = Pair(tmp_path, {delegate: asm(0x77, 0, "SSTORE", 32, 0, "RETURN")})
    rng = np.random.default_rng(0)
    authority = AUTHORITIES[0]
    message = b"\x05" + rlp.encode([CHAIN_ID, delegate, 0])
    y_parity, r, s = AUTHORITY_KEYS[0].sign_msg(message).vrs
    tx = pair.transaction(rng, 0, authority, authorizations=[
        {"chain_id": CHAIN_ID, "address": delegate, "nonce": 0, "y_parity": y_parity,
         "r": r, "s": s}])
    pair.seal([tx])
    state = pair.chains[0].get_vm().state
    assert state.get_code(authority) == b"\xef\x01\x00" + delegate
    assert state.get_storage(authority, 0) == 0x77


def test_deep_nesting(tmp_path):
    """A contract calling itself with all its gas (63/64 forwarded at each level) as deep as
    the block's gas allows (~800 frames: the 1024 limit is out of reach with 2e9 gas), the
    innermost frames running out of gas at their SSTORE."""
    recursive = CONTRACTS[0]
    pair = Pair(tmp_path, {recursive: asm(0, 0, 0, 0, 0, "ADDRESS", "GAS", "CALL",
                                          "CALLDATASIZE", "SSTORE")})
    rng = np.random.default_rng(0)
    pair.seal([pair.transaction(rng, 0, recursive, gas=gas)
               for gas in (1_999_000_000, 30_000_000)])
