"""Adversarial review of block validity and the verification precompile (chain/precompile.py,
chain/consensus.py, chain/replay.py): work a call makes every validator do against the gas it
paid, and blocks that replay must accept or refuse."""
import numpy as np
import pytest

from chain.blobs import BlobStore, encode_array
from chain.params import PRECOMPILE_BASE_GAS, PRECOMPILE_ELEMENT_GAS
from chain.precompile import BAD_OPERANDS, check_gas, verdict

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store(tmp_path):
    return BlobStore(tmp_path / "blobs")


def reads_recorded(store) -> list[bytes]:
    """The ids whose whole blob the store hands out from now on (headers are not counted)."""
    read = []
    get = store.get
    store.get = lambda id_: read.append(id_) or get(id_)
    return read


@pytest.mark.parametrize("batch, m, k, n", [(0, 1, 2048, 2048), (0, 3, 2048, 2048)])
def test_an_empty_batch_reads_no_shared_operand_it_did_not_pay_for(store, batch, m, k, n):
    """Gas pays for batch * (mk + kn + mn) elements, 0 for a batch of 0; B may be one 2-D
    (k, n) matrix shared by the batch. Any transaction calling the precompile with batch 0
    and a large shared B made every node read and decode all of B (a 256 MiB blob for 5000
    gas: ~1000x the work gas pays for, repeated in a loop up to the block's 2e9 gas). The
    verdict stays what the verifier gives an empty batch, bad operands."""
    b_id = store.put(encode_array(np.ones((k, n), np.float32)))
    a_id = store.put(encode_array(np.ones((batch, m, k), np.float32)))
    c_id = store.put(encode_array(np.ones((batch, m, n), np.float32)))
    paid_elements = (check_gas(batch, m, k, n, 8) - PRECOMPILE_BASE_GAS) // \
        (PRECOMPILE_ELEMENT_GAS * 9)
    read = reads_recorded(store)
    assert verdict(store, a_id, b_id, c_id, batch, m, k, n, 1, 8, b"\5" * 32) == BAD_OPERANDS
    assert paid_elements == 0 and b_id not in read
    # C missing: still the submitter's empty product, not the worker's failure
    assert verdict(store, a_id, b_id, b"\6" * 32, batch, m, k, n, 1, 8, b"\5" * 32) \
        == BAD_OPERANDS


def seal_on_head(chain, coinbase: bytes, raws: list[bytes]):
    """A block on ``chain``'s head built as the node builds one (its transactions, rewards,
    state root and seal), with this coinbase, stored as the new head."""
    from chain.admission import decode_transaction
    from chain.consensus import verified_work, work_seal

    parent = chain.get_canonical_head()
    vm = chain.get_vm(type(chain.get_vm()).child_header(parent, coinbase, parent.timestamp + 1))
    header, transactions, receipts = vm.get_header(), [], []
    for raw in raws:
        transaction = decode_transaction(raw)
        receipt, _ = vm.apply_transaction(header, transaction)
        header = vm.add_receipt_to_header(header, receipt)
        transactions.append(transaction)
        receipts.append(receipt)
    block = vm.seal_block(header, transactions, receipts, work_seal(verified_work(receipts)))
    chain.chaindb.persist_block(block)
    return block


def test_replay_refuses_a_block_whose_priority_fees_bypass_the_reward_pool(store):
    """docs/protocol.md: the reward pool is the block coinbase, so priority fees refill it
    (the pool pays every block reward). A block whose coinbase is another account keeps the
    tips from the pool; re-executing the chain (`chain verify`) accepted it as valid."""
    from eth.db.atomic import AtomicDB
    from eth_utils import ValidationError, to_canonical_address

    from chain.devnet import dev_accounts
    from chain.genesis import genesis_params, genesis_state
    from chain.params import CHAIN_ID, REWARD_POOL_ADDRESS
    from chain.replay import replay
    from chain.vm import build_chain_class

    sender, sealer = dev_accounts(2)
    tip = 10**9

    def transfer(nonce: int) -> bytes:
        return sender.sign_transaction({
            "to": sealer.address, "value": 1, "gas": 21_000, "maxFeePerGas": 10**11,
            "maxPriorityFeePerGas": tip, "nonce": nonce, "chainId": CHAIN_ID, "type": 2,
        }).raw_transaction

    chain = build_chain_class(store).from_genesis(AtomicDB(), genesis_params(), genesis_state())
    honest = seal_on_head(chain, REWARD_POOL_ADDRESS, [transfer(0)])
    pool = chain.get_vm().state.get_balance(REWARD_POOL_ADDRESS)
    assert replay(chain, store) == honest.number  # the node's own blocks import again
    diverted = seal_on_head(chain, to_canonical_address(sealer.address), [transfer(1)])
    assert chain.get_vm().state.get_balance(REWARD_POOL_ADDRESS) == pool  # no tip reached it
    with pytest.raises(ValidationError, match=f"block #{diverted.number} is invalid"):
        replay(chain, store)
