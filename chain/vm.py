"""The needle-net VM: py-evm's Prague rules plus the Freivalds precompile and PoUW rewards."""
from __future__ import annotations

from collections.abc import Sequence
from hashlib import sha256

import eth.db.chain
import eth.vm.base
import rlp
from eth._utils.address import generate_contract_address
from eth.abc import (
    BlockAPI,
    BlockHeaderAPI,
    ComputationAPI,
    MessageAPI,
    ReceiptAPI,
    SignedTransactionAPI,
    StateAPI,
    WithdrawalAPI,
)
from eth.chains.base import Chain
from eth.constants import (
    BLANK_ROOT_HASH,
    CREATE_CONTRACT_ADDRESS,
    EMPTY_SHA256,
    EMPTY_UNCLE_HASH,
    POST_MERGE_DIFFICULTY,
    POST_MERGE_MIX_HASH,
    POST_MERGE_NONCE,
)
from eth.rlp.logs import Log
from eth.rlp.receipts import Receipt
from eth.vm.forks.byzantium.constants import (
    EIP658_TRANSACTION_STATUS_CODE_FAILURE,
    EIP658_TRANSACTION_STATUS_CODE_SUCCESS,
)
from eth.vm.forks.cancun.constants import BLOB_TX_TYPE
from eth.vm.forks.london.headers import calculate_expected_base_fee_per_gas
from eth.vm.forks.prague import PragueVM
from eth.vm.forks.prague.blocks import PragueBlock, PragueBlockHeader
from eth.vm.forks.prague.computation import PragueComputation
from eth.vm.forks.prague.constants import DEPOSIT_REQUEST_TYPE
from eth.vm.forks.prague.headers import calc_excess_blob_gas_prague
from eth.vm.forks.prague.state import PragueState, PragueTransactionExecutor
from eth.vm.forks.spurious_dragon._utils import collect_touched_accounts
from eth.vm.message import Message
from eth_hash.auto import keccak
from eth_typing import Address, Hash32
from eth_utils import ValidationError
from rlp.sedes.serializable import BaseSerializable

from chain.admission import validate_fee_caps
from chain.blobs import BlobStore
from chain.consensus import PoUWConsensus, block_rewards, may_hold_work, verified_work
from chain.db import NodeChainDB
from chain.flatstate import FlatAccountDB
from chain.interpreter import FastComputation
from chain.params import CHAIN_ID, FREIVALDS_ADDRESS, REWARD_POOL_ADDRESS
from chain.precompile import make_freivalds_precompile
from chain.tries import encode_header, trie_root_and_nodes

# py-evm looks its block-trie builder up as a module global when it builds, validates and
# persists blocks; the one-pass builder gives the same roots (tests/test_chain_tries.py).
eth.vm.base.make_trie_root_and_nodes = trie_root_and_nodes
eth.db.chain.make_trie_root_and_nodes = trie_root_and_nodes


class PoUWState(PragueState):
    """Prague's state, with the transaction rule of EIP-1559 that py-evm leaves out: a block
    including a transaction that breaks it is invalid."""

    def validate_transaction(self, transaction: SignedTransactionAPI) -> None:
        validate_fee_caps(transaction)
        super().validate_transaction(transaction)


class PoUWBlock(PragueBlock):
    """Prague's block, whose copies share its transactions, uncles and withdrawals: py-evm
    copies a block several times while sealing it, and rlp's ``copy`` deep-copies every
    field not given (each of thousands of transactions), though these objects are immutable.
    """

    def copy(self, *args, **kwargs) -> PoUWBlock:
        for field in self._meta.field_names[len(args):]:
            if field != "header":
                kwargs.setdefault(field, getattr(self, field))
        return super().copy(*args, **kwargs)


def rlp_object(cls: type[rlp.Serializable], *values) -> rlp.Serializable:
    """An rlp object from all its field values in field order, without the class's keyword
    constructor (keyword merging and checks were most of the cost of a receipt or header)."""
    obj = cls.__new__(cls)
    BaseSerializable.__init__(obj, *values)
    return obj


def with_fields(header: BlockHeaderAPI, **changes) -> BlockHeaderAPI:
    """A copy of ``header`` with some fields changed, built from its field values: rlp's
    ``copy`` deep-copies the unchanged ones and checks every keyword."""
    cls = type(header)
    return rlp_object(cls, *[changes.get(name, value) for name, value in
                             zip(cls._meta.field_names, header, strict=True)])


def requests_hash(block_requests: Sequence[bytes]) -> Hash32:
    """EIP-7685's commitment to a block's requests (py-evm's ``compute_requests_hash``):
    sha256 over the sha256 of each request that carries data beyond its type byte."""
    outer = sha256()
    for request in block_requests:
        if len(request) > 1:
            outer.update(sha256(request).digest())
    return Hash32(outer.digest())


class PoUWVMBase(PragueVM):
    """Prague, with block rewards paid from the pool to the block's verified workers."""

    fork = "prague-pouw"
    block_class = PoUWBlock
    consensus_class = PoUWConsensus

    def _assign_block_rewards(self, block: BlockAPI) -> None:
        if not may_hold_work(block.header):
            return
        work = verified_work(self.block_receipts(block))
        rewards = block_rewards(work, self.state.get_balance(REWARD_POOL_ADDRESS))
        for worker, amount in rewards.items():
            self.state.delta_balance(REWARD_POOL_ADDRESS, -amount)
            self.state.delta_balance(worker, amount)

    def validate_transaction_against_header(self, base_header: BlockHeaderAPI,
                                            transaction: SignedTransactionAPI) -> None:
        """Frontier's checks plus EIP-155's replay protection, which py-evm leaves to the
        client: a transaction signed for another chain, or for none (a pre-EIP-155 legacy
        signature), makes the block invalid, not only its admission refused."""
        if transaction.chain_id != CHAIN_ID:
            raise ValidationError(f"transaction 0x{transaction.hash.hex()} is signed for chain "
                                  f"id {transaction.chain_id}, not {CHAIN_ID}")
        super().validate_transaction_against_header(base_header, transaction)

    def block_receipts(self, block: BlockAPI) -> Sequence[ReceiptAPI]:
        """The block's receipts, read back from the database."""
        return block.get_receipts(self.chaindb)

    @classmethod
    def child_header(cls, parent: BlockHeaderAPI, coinbase: Address,
                     timestamp: int) -> BlockHeaderAPI:
        """The header of the block to build on ``parent`` (same gas limit), before any
        transaction."""
        return cls.create_header_from_parent(parent, coinbase=coinbase, timestamp=timestamp,
                                             gas_limit=parent.gas_limit)

    def seal_block(self, header: BlockHeaderAPI, transactions: Sequence[SignedTransactionAPI],
                   receipts: Sequence[ReceiptAPI], extra_data: bytes) -> BlockAPI:
        """The block of these transactions and receipts (``header``: after the last one),
        finalised (requests, rewards, state root) and validated."""
        block = self.set_block_transactions_and_withdrawals(self.get_block(), header,
                                                            transactions, receipts)
        return self.mine_block(self.block_postprocessing(block), extra_data=extra_data).block

    def add_receipt_to_header(self, old_header: BlockHeaderAPI,
                              receipt: ReceiptAPI) -> BlockHeaderAPI:
        """Byzantium's, with the new header built from the old one's fields: rlp's ``copy``
        deep-copies all 21 of them, for every transaction of the block."""
        return with_fields(old_header, bloom=old_header.bloom | receipt.bloom,
                           gas_used=receipt.gas_used)

    def process_deposit_request_data(self, block: BlockAPI) -> None:
        """No deposit contract exists on this chain: an empty deposit list, no receipt scan."""
        block.block_requests.append(DEPOSIT_REQUEST_TYPE)


def logs_bloom(log_entries: Sequence[tuple[bytes, Sequence[int], bytes]]) -> int:
    """The yellow paper's 2048-bit log bloom (M3:2048 over each log's address and topics),
    eth_bloom's result without its per-bit function calls."""
    bloom = 0
    for address, topics, _ in log_entries:
        for item in (address, *[topic.to_bytes(32, "big") for topic in topics]):
            digest = keccak(item)
            for i in (0, 2, 4):
                bloom |= 1 << (((digest[i] << 8) | digest[i + 1]) & 2047)
    return bloom


class PoUWFastVM(PoUWVMBase):
    """The VM of the fast path: receipts built with ``logs_bloom`` and not re-checked, and
    kept for the block's rewards (a full block's receipts decoded back from the database
    were an eighth of sealing it)."""

    _receipts: tuple[Hash32, Sequence[ReceiptAPI]] = (b"", ())  # receipt root, receipts

    @classmethod
    def child_header(cls, parent: BlockHeaderAPI, coinbase: Address,
                     timestamp: int) -> BlockHeaderAPI:
        """py-evm's ``create_header_from_parent`` for Prague after the merge, built from its
        field values: py-evm builds and copies the header once for every fork since
        Frontier (a third of a millisecond per block; tests/test_chain_fast_evm.py compares
        the two)."""
        return rlp_object(
            PragueBlockHeader, parent.hash, EMPTY_UNCLE_HASH, coinbase, parent.state_root,
            BLANK_ROOT_HASH, BLANK_ROOT_HASH, 0, POST_MERGE_DIFFICULTY,
            parent.block_number + 1, parent.gas_limit, 0, timestamp, b"", POST_MERGE_MIX_HASH,
            POST_MERGE_NONCE, calculate_expected_base_fee_per_gas(parent), BLANK_ROOT_HASH, 0,
            calc_excess_blob_gas_prague(parent), BLANK_ROOT_HASH, EMPTY_SHA256)

    def seal_block(self, header: BlockHeaderAPI, transactions: Sequence[SignedTransactionAPI],
                   receipts: Sequence[ReceiptAPI], extra_data: bytes) -> BlockAPI:
        """py-evm's ``set_block_transactions_and_withdrawals``, ``block_postprocessing`` and
        ``mine_block`` (pack, finalise, validate) with the header and the block built twice
        instead of at every step (rlp copies), the two block tries' nodes written together,
        and no debug line formatting the block (its hash) whether or not debug logging is
        on. The same block: tests/test_chain_fast_evm.py imports it into stock py-evm."""
        transaction_root, nodes = trie_root_and_nodes(transactions)
        receipt_root, receipt_nodes = trie_root_and_nodes(receipts)
        self.chaindb.persist_trie_data_dict({**nodes, **receipt_nodes})
        self._receipts = (receipt_root, receipts)
        block_class = self.get_block_class()
        block = block_class(with_fields(header, transaction_root=transaction_root,
                                        receipt_root=receipt_root), transactions)
        self.process_deposit_request_data(block)  # Prague's block_postprocessing
        self.process_withdrawal_request_data(block)
        self.process_consolidation_request_data(block)
        self._assign_block_rewards(block)  # finalize_block's
        self.state.persist()
        sealed_header = with_fields(
            block.header, requests_hash=requests_hash(block.block_requests),
            extra_data=extra_data, state_root=self.state.state_root)
        sealed_header._cached_rlp = encode_header(sealed_header)  # rlp.encode's own cache
        sealed = block_class(sealed_header, transactions)
        self.validate_block(sealed)
        return sealed

    def set_block_transactions_and_withdrawals(
            self, base_block: BlockAPI, new_header: BlockHeaderAPI,
            transactions: Sequence[SignedTransactionAPI], receipts: Sequence[ReceiptAPI],
            withdrawals: Sequence[WithdrawalAPI] | None = None) -> BlockAPI:
        block = super().set_block_transactions_and_withdrawals(
            base_block, new_header, transactions, receipts, withdrawals)
        self._receipts = (block.header.receipt_root, receipts)
        return block

    def block_receipts(self, block: BlockAPI) -> Sequence[ReceiptAPI]:
        """The receipts this VM put into the block (its receipt root commits to them), else
        the database's."""
        root, receipts = self._receipts
        return receipts if root == block.header.receipt_root else super().block_receipts(block)

    def apply_transaction(self, header: BlockHeaderAPI, transaction: SignedTransactionAPI
                          ) -> tuple[ReceiptAPI, ComputationAPI]:
        """py-evm's, less ``validate_receipt``: the receipt was made from the computation's
        logs one line before (bloom from the same logs, status one of the two codes)."""
        self.validate_transaction_against_header(header, transaction)
        self.state.lock_changes()  # the transaction's changes start un-revertable
        computation = self.state.apply_transaction(transaction)
        return self.make_receipt(header, transaction, computation, self.state), computation

    @classmethod
    def make_receipt(cls, base_header: BlockHeaderAPI, transaction: SignedTransactionAPI,
                     computation: ComputationAPI, state: StateAPI) -> ReceiptAPI:
        """Byzantium's receipt (EIP-658 status, cumulative gas, logs; EIP-2718 type)."""
        entries = computation.get_log_entries()
        receipt = rlp_object(
            Receipt,
            (EIP658_TRANSACTION_STATUS_CODE_FAILURE if computation.is_error
             else EIP658_TRANSACTION_STATUS_CODE_SUCCESS),
            base_header.gas_used + cls.finalize_gas_used(transaction, computation),
            logs_bloom(entries),
            [rlp_object(Log, address, topics, data) for address, topics, data in entries])
        type_id = getattr(transaction, "type_id", None)
        if type_id is None:
            return receipt
        return cls.get_receipt_builder().typed_receipt_class(type_id, receipt)


class PoUWTransactionExecutor(PragueTransactionExecutor):
    """Prague's executor; its message set-up and finalisation skip py-evm's debug lines,
    which format the transaction, a hash of its data and the hex of the contract's whole
    code, or fetch a logger and format addresses, on every transaction even with debug
    logging off (~35 us of a ~1.5 ms ``submitJob``, then a logger lookup twice per
    transaction)."""

    def finalize_computation(self, transaction: SignedTransactionAPI,
                             computation: ComputationAPI) -> ComputationAPI:
        """Frontier's and Spurious Dragon's finalisation as Prague runs them: the refund
        (EIP-3529 cap) and EIP-7623 data floor, unused gas back to the sender, the tip to
        the coinbase, self-destructs, EIP-161 clearing of touched empty accounts."""
        state = self.vm_state
        gas_remaining = computation.get_gas_remaining()
        gas_used = transaction.gas - gas_remaining
        gas_refund = self.calculate_gas_refund(computation, gas_used)
        floor = computation.data_floor_gas = self.calc_data_floor_gas(transaction, gas_used,
                                                                      gas_refund)
        refund_amount = (gas_refund + gas_remaining - floor) * \
            computation.transaction_context.gas_price
        if refund_amount:
            state.delta_balance(computation.msg.sender, refund_amount)
        charged = transaction.gas - gas_remaining - gas_refund + floor
        state.delta_balance(state.coinbase, charged * state.get_tip(transaction))
        for account in computation.get_accounts_for_deletion():
            state.delete_account(account)
        for account in collect_touched_accounts(computation):
            if state.account_exists(account) and state.account_is_empty(account):
                state.delete_account(account)
        return computation

    def build_evm_message(self, transaction: SignedTransactionAPI) -> MessageAPI:
        """Cancun's ``build_evm_message`` (Prague's overrides included) less that line."""
        state, sender = self.vm_state, transaction.sender
        gas_fee = transaction.gas * state.get_gas_price(transaction)
        blob_fee = self.calc_data_fee(transaction) if transaction.type_id == BLOB_TX_TYPE else 0
        state.delta_balance(sender, -1 * (gas_fee + blob_fee))
        state.increment_nonce(sender)
        # EIP-7702: the authorizations are applied (and their refund counted) before the
        # code at the destination is read, which may be a delegation they just set
        refund = self.calc_message_refund(transaction)
        if transaction.to == CREATE_CONTRACT_ADDRESS:
            create_address = generate_contract_address(sender, state.get_nonce(sender) - 1)
            data, code, delegation_address = b"", transaction.data, None
        else:
            create_address, data = None, transaction.data
            code, delegation_address = self.get_code_at_address(transaction.to)
        return Message(gas=transaction.gas - transaction.intrinsic_gas, to=transaction.to,
                       sender=sender, value=transaction.value, data=data, code=code,
                       create_address=create_address, refund=refund,
                       is_delegation=delegation_address is not None)


def build_chain_class(store: BlobStore, fast: bool = True) -> type[Chain]:
    """A Chain class whose VM verifies matmul results against this blob store. ``fast``: the
    opcode loop of ``chain.interpreter``, the flat state of ``chain.flatstate`` (tries
    updated once per block), the node's block finishing (``PoUWFastVM``) and ChainDB
    (``chain.db.NodeChainDB``); ``fast=False``: stock py-evm for all of them (same blocks,
    tested)."""
    computation = type(
        "PoUWComputation",
        (FastComputation if fast else PragueComputation,),
        {"_precompiles": {**PragueComputation.get_precompiles(),
                          FREIVALDS_ADDRESS: make_freivalds_precompile(store)}},
    )
    state = type("PoUWState", (PoUWState,), {
        "computation_class": computation,
        "account_db_class": FlatAccountDB if fast else PragueState.account_db_class,
        "transaction_executor_class": (PoUWTransactionExecutor if fast
                                       else PragueState.transaction_executor_class),
    })
    vm = type("PoUWVM", (PoUWFastVM if fast else PoUWVMBase,), {"_state_class": state})
    return Chain.configure(
        __name__="NeedleNetChain", vm_configuration=((0, vm),), chain_id=CHAIN_ID,
        chaindb_class=NodeChainDB if fast else Chain.chaindb_class,
    )
