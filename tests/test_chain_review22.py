"""Review of the node's transaction pool, block production and storage: bad input gets a
clear error and loses nothing. Each test fails on the node before its fix."""
import os
import re
import sqlite3
import subprocess
import sys

import httpx
import pytest
from eth.db.schema import SchemaV1
from eth_hash.auto import keccak

from chain.db import DATABASE_FILE, DataDirError
from chain.devnet import dev_accounts
from chain.node import Node, NodeConfig
from chain.params import CHAIN_ID

pytestmark = pytest.mark.timeout(120)
POOL = "0x0000000000000000000000000000000000000FEE"
MAX_TX_BYTES = 128 * 1024  # geth's txMaxSize, chain.admission.MAX_TX_BYTES


def signed(account, nonce: int, **fields) -> bytes:
    tx = {"to": POOL, "value": 1, "gas": 21_000, "maxFeePerGas": 10**11,
          "maxPriorityFeePerGas": 1, "nonce": nonce, "chainId": CHAIN_ID, "type": 2, **fields}
    return bytes(account.sign_transaction(tx).raw_transaction)


def burner(account, nonce: int, gas: int) -> bytes:
    """A creation whose initcode is INVALID: it uses all of its gas at once."""
    return signed(account, nonce, to=None, value=0, data=b"\xfe", gas=gas)


def address(account) -> bytes:
    return bytes.fromhex(account.address[2:])


def in_process(data_dir, **options) -> Node:
    """A node whose blocks the test seals itself (``seal``), no producer thread."""
    return Node(NodeConfig(data_dir, decode_process=False, **options))


# --- block production ----------------------------------------------------------------------

def test_transactions_behind_one_the_base_fee_overtook_stay_pending(tmp_path):
    """A transaction the base fee rose above before its block was dropped; the same sender's
    later transactions were then applied anyway, failed on their nonce and were dropped too,
    silently, though valid and acknowledged. Both now wait (as in geth) and are mined, in
    order, once the base fee falls back below the first one's cap."""
    node = in_process(tmp_path / "data")
    try:
        whale, sender = dev_accounts(2)
        fee = node.next_base_fee()
        node.admit(burner(whale, 0, node.head().gas_limit - 10_000))  # the block is full
        first = node.admit(signed(sender, 0, maxFeePerGas=fee))  # waits for a cheaper block
        later = node.admit(signed(sender, 1))
        assert len(node.seal().transactions) == 1
        assert node.next_base_fee() > fee
        assert node.seal().transactions == ()  # neither taken, neither dropped
        assert list(node.mempool.by_hash) == [first, later]
        assert node.pending_nonce(address(sender)) == 2
        assert node.next_base_fee() <= fee  # the empty block lowered it
        assert [tx.hash for tx in node.seal().transactions] == [first, later]
        assert node.state_at().get_nonce(address(sender)) == 2 and len(node.mempool) == 0
    finally:
        node.stop()


def test_a_stop_seals_more_than_one_block_of_admitted_transactions(tmp_path):
    """A stop sealed one last block, so what did not fit in it (the gas limit, or
    max_block_txs) was lost though acknowledged; every admitted transaction is now stored."""
    node = in_process(tmp_path / "data", max_block_txs=2)
    account = dev_accounts(1)[0]
    hashes = [node.admit(burner(account, nonce, 900_000_000)) for nonce in range(3)]  # 2/block
    hashes += [node.admit(signed(account, nonce)) for nonce in range(3, 6)]
    node.stop()
    node = in_process(tmp_path / "data")
    try:
        assert node.state_at().get_nonce(address(account)) == 6
        stored = [node.chain.chaindb.get_transaction_index(h) for h in hashes]
        assert [number for number, _ in stored] == [1, 1, 2, 2, 3, 3]
    finally:
        node.stop()


# --- the transaction pool ------------------------------------------------------------------

def test_a_full_pool_admits_only_transactions_a_block_can_take(tmp_path):
    """A transaction behind a nonce gap costs nothing until it is mined, and stayed pending
    forever: senders could fill the node's memory with them (1024 each). Beyond
    ``max_pending`` only a sender's next nonce is admitted, which the next block takes; the
    held ones are mined once their gap is filled."""
    node = in_process(tmp_path / "data", max_pending=3)
    try:
        hoarder, other = dev_accounts(2)
        held = [node.admit(signed(hoarder, nonce)) for nonce in (1, 2, 3)]
        with pytest.raises(ValueError, match="pool is full .* next nonce 0 is admitted, not 5"):
            node.admit(signed(other, 5))
        with pytest.raises(ValueError, match="pool is full .* next nonce 0 is admitted, not 4"):
            node.admit(signed(hoarder, 4))
        assert len(node.mempool) == 3
        node.admit(signed(other, 0))
        node.admit(signed(other, 1))  # its next nonce again
        assert len(node.seal().transactions) == 2
        first = node.admit(signed(hoarder, 0))
        assert [tx.hash for tx in node.seal().transactions] == [first, *held]
    finally:
        node.stop()


def test_an_oversized_transaction_is_refused_and_the_node_serves_on(node):
    """No size limit: a transaction of megabytes (the JSON-RPC body may be 64 MiB) was
    admitted and kept in memory, behind a nonce gap for ever. Above geth's 128 KiB it is
    refused with the reason; one just below is mined."""
    account = dev_accounts(15)[14]
    data = b"\x01" * MAX_TX_BYTES
    big = signed(account, 1, data=data, gas=6_000_000)  # behind a gap: it would stay
    assert len(big) > MAX_TX_BYTES
    reply = httpx.post(node.url, timeout=30, json={
        "jsonrpc": "2.0", "id": 1, "method": "eth_sendRawTransaction",
        "params": ["0x" + big.hex()]}).json()
    assert reply["error"]["code"] == -32000, reply
    assert f"oversized transaction: {len(big)} bytes" in reply["error"]["message"]
    fitting = signed(account, 0, data=data[:MAX_TX_BYTES - 200], gas=6_000_000)
    reply = httpx.post(f"{node.url}/wait", timeout=60, params={"timeout": 30},
                       json="0x" + fitting.hex()).json()
    assert reply["receipt"]["transactionHash"] == "0x" + keccak(fitting).hex(), reply
    assert reply["receipt"]["status"] == "0x1"


# --- storage -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stored_chain(tmp_path_factory):
    """A data dir holding a few sealed blocks, each test corrupting its own copy."""
    data_dir = tmp_path_factory.mktemp("stored") / "data"
    node = in_process(data_dir)
    node.admit(signed(dev_accounts(1)[0], 0))
    for _ in range(3):
        node.seal()
    node.stop()
    return (data_dir / DATABASE_FILE).read_bytes()


def _truncate(path):
    os.truncate(path, path.stat().st_size // 2)


def _garble(path):
    path.write_bytes(os.urandom(path.stat().st_size))


def _lose_the_head(path):
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM kv WHERE key = ?",
                     (SchemaV1.make_canonical_head_hash_lookup_key(),))


@pytest.mark.parametrize("damage, reason", [
    (_truncate, "cannot be read (database disk image is malformed)"),
    (_garble, "cannot be read (file is not a database)"),
    (_lose_the_head, "holds data but no chain head"),
])
def test_a_damaged_database_is_a_clear_error_and_is_left_alone(stored_chain, tmp_path, damage,
                                                              reason):
    """A truncated or garbled chain.sqlite ended the start with sqlite's traceback; one
    whose head was lost got a new genesis written over it (a silent reset). Now it is a
    DataDirError naming the file, nothing is written to it, and the data dir is unlocked."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    path = data_dir / DATABASE_FILE
    path.write_bytes(stored_chain)
    damage(path)
    damaged = path.read_bytes()
    for _ in range(2):  # the first attempt released the data dir's lock
        with pytest.raises(DataDirError, match=re.escape(f"database {path} {reason}")):
            in_process(data_dir)
    assert path.read_bytes() == damaged


def test_up_and_verify_name_a_damaged_database_in_one_line(stored_chain, tmp_path):
    """The command line's view of the same: one `error:` line, exit status 1."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / DATABASE_FILE).write_bytes(stored_chain)
    _truncate(data_dir / DATABASE_FILE)
    for command in (["up", "--port", "0"], ["verify"]):
        done = subprocess.run([sys.executable, "-m", "chain", *command, "--data-dir",
                               str(data_dir)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, done
        assert done.stderr == f"error: database {data_dir / DATABASE_FILE} cannot be read " \
            "(database disk image is malformed): it is damaged, truncated or not a chain " \
            "database\n", done.stderr


def test_a_transaction_held_for_its_fee_survives_a_restart(tmp_path):
    """A stop stores what it cannot seal; the next start admitted it again only if its max
    fee still covered the base fee, so one the base fee had overtook was dropped at the
    restart (logged), though the running node kept it. It is kept, and mined once the base
    fee falls."""
    node = in_process(tmp_path / "data")
    whale, sender = dev_accounts(2)
    fee = node.next_base_fee()
    node.admit(burner(whale, 0, node.head().gas_limit - 10_000))  # the block is full
    held = node.admit(signed(sender, 0, maxFeePerGas=fee))
    assert len(node.seal().transactions) == 1
    node.admit(burner(whale, 1, node.head().gas_limit - 10_000))
    assert len(node.seal().transactions) == 1  # two full blocks: the base fee up 12.5 % twice
    assert list(node.mempool.by_hash) == [held]
    node.stop()  # its last (empty) block lowers the base fee once, not below the cap
    node = in_process(tmp_path / "data")
    try:
        assert node.next_base_fee() > fee and list(node.mempool.by_hash) == [held]
        for _ in range(4):  # empty blocks until the base fee is back under the cap
            if [tx.hash for tx in node.seal().transactions] == [held]:
                break
        assert node.state_at().get_nonce(address(sender)) == 1
    finally:
        node.stop()
