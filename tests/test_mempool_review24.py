"""Review of the node's mempool and block sealing under heavy or adversarial load: one sender
flooding blocks, a transaction too large for what a block has left, a pool filled with large
transactions behind nonce gaps. Counted in transactions and bytes, never timed; each test
fails on the node before its fix."""
import pytest

from chain.admission import MAX_TX_BYTES
from chain.devnet import dev_accounts
from chain.node import Node, NodeConfig
from chain.params import CHAIN_ID

pytestmark = pytest.mark.timeout(300)
POOL = "0x0000000000000000000000000000000000000FEE"
POOL_BYTES = 64 << 20  # NodeConfig.max_pending_bytes: what a full pool holds at most


def signed(account, nonce: int, **fields) -> bytes:
    tx = {"to": POOL, "value": 1, "gas": 21_000, "maxFeePerGas": 10**11,
          "maxPriorityFeePerGas": 1, "nonce": nonce, "chainId": CHAIN_ID, "type": 2, **fields}
    return bytes(account.sign_transaction(tx).raw_transaction)


def burner(account, nonce: int, gas: int, **fields) -> bytes:
    """A creation whose initcode is INVALID: it uses all of its gas at once."""
    return signed(account, nonce, to=None, value=0, data=b"\xfe", gas=gas, **fields)


def in_process(data_dir, **options) -> Node:
    """A node whose blocks the test seals itself (``seal``), no producer thread."""
    return Node(NodeConfig(data_dir, block_time=0, decode_process=False, **options))


def senders(block) -> list[int]:
    """Which dev account (by index) sent each transaction of a block."""
    index = {bytes.fromhex(a.address[2:]): i for i, a in enumerate(dev_accounts(20))}
    return [index[tx.sender] for tx in block.transactions]


# --- which pending transactions a block takes -------------------------------------------------

def test_a_sender_topping_up_its_queue_does_not_starve_others(tmp_path):
    """Blocks took senders in the order they first had something pending, each with all its
    consecutive nonces: a sender that always kept one transaction pending and topped its
    queue up after every block filled every block, and another sender's transaction, sent
    before the top-ups, waited for ever. Blocks now take transactions in the order they were
    admitted (each sender's nonces in order): it is in the second block."""
    node = in_process(tmp_path / "data", max_block_txs=3)
    try:
        flooder, victim = dev_accounts(2)
        for nonce in range(4):
            node.admit(signed(flooder, nonce))
        node.admit(signed(victim, 0))
        blocks = []
        for _ in range(3):
            blocks.append(senders(node.seal()))
            top_up = node.pending_nonce(bytes.fromhex(flooder.address[2:]))
            for nonce in range(top_up, top_up + 3):  # after every block, 3 more
                node.admit(signed(flooder, nonce))
        assert blocks == [[0, 0, 0], [0, 1, 0], [0, 0, 0]]
    finally:
        node.stop()


def test_a_transaction_too_large_for_the_rest_of_a_block_does_not_end_it(tmp_path):
    """A transaction whose gas did not fit in what the block had left ended the block: the
    small transactions of other senders after it waited for the next one (and for ever, if
    the large one never fit after a busy sender's). It is now skipped with its sender's later
    transactions, and the block goes on with the others."""
    node = in_process(tmp_path / "data")
    try:
        big, large, small = dev_accounts(3)
        limit = node.head().gas_limit
        node.admit(burner(big, 0, limit * 6 // 10))
        node.admit(burner(large, 0, limit // 2))  # does not fit after the first
        node.admit(signed(large, 1))  # its sender's next: waits with it
        transfer = node.admit(signed(small, 0))
        first = node.seal()
        assert senders(first) == [0, 2]
        assert first.transactions[-1].hash == transfer
        assert senders(node.seal()) == [1, 1]
        assert len(node.mempool) == 0
    finally:
        node.stop()


# --- what the pool holds ----------------------------------------------------------------------

def test_large_transactions_behind_nonce_gaps_cannot_fill_the_memory(tmp_path):
    """The pool was bounded by its count of transactions only (16384): transactions of 128
    KiB behind nonce gaps, never mined and so never paid for, held 2 GiB of the node's
    memory (16 funded senders; the dev accounts' keys are public). The pool's bytes are
    bounded too: past them only a sender's next nonce is admitted."""
    node = in_process(tmp_path / "data")
    try:
        accounts = dev_accounts(4)
        data = b"\x01" * (MAX_TX_BYTES - 1024)
        gas = 21_000 + 40 * len(data)  # the calldata floor (EIP-7623)
        held = refused = 0
        for nonce in range(1, 1025):  # nonce 0 left open: none of these can be mined
            if refused or held > POOL_BYTES + MAX_TX_BYTES:  # bounded on the unfixed node too
                break
            for account in accounts:
                raw = signed(account, nonce, data=data, gas=gas)
                try:
                    node.admit(raw)
                    held += len(raw)
                except ValueError as exc:
                    assert "transaction pool is full" in str(exc)
                    refused += 1
        assert refused and held <= POOL_BYTES
        assert node.admit(signed(accounts[0], 0))  # the sender's next nonce is still taken
    finally:
        node.stop()
