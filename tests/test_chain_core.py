"""Chain internals in-process: blob format, sqlite atomicity, the precompile's verdicts and
consensus (a block whose verified work does not verify on the importing node is invalid)."""
import os
import shutil

import blake3
import numpy as np
import pytest
import rlp
from eth.db.atomic import AtomicDB
from eth.db.backends.memory import MemoryDB
from eth.db.chain import ChainDB
from eth.exceptions import HeaderNotFound
from eth_hash.auto import keccak
from eth_utils import ValidationError, to_canonical_address
from web3 import Web3

from chain.blobs import BlobStore, blob_hasher, blob_id, decode_array, encode_array
from chain.compile import compiled_market
from chain.db import NodeChainDB, SqliteDB
from chain.devnet import dev_accounts
from chain.genesis import genesis_params, genesis_state
from chain.node import Node, NodeConfig
from chain.params import CHAIN_ID, MARKET_ADDRESS
from chain.precompile import BAD_OPERANDS, FAIL, PASS, check_gas, verdict
from chain.replay import replay
from chain.rpc import Rpc, RpcError
from chain.vm import build_chain_class

RNG = np.random.default_rng(7)


# --- blobs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "int8", "int16", "int32", "int64"])
def test_blob_round_trip_matches_numpy(dtype):
    array = (RNG.standard_normal((3, 4, 5)) * 50).astype(dtype)
    blob = encode_array(array)
    assert blob[:4] == b"NNB1" and blob[6:8] == b"\0\0"
    assert len(blob) == 8 + 3 * 8 + array.nbytes
    back = decode_array(blob)
    assert back.dtype == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back, array)
    assert blob_id(blob) == blake3.blake3(blob).digest()


def test_blob_id_is_blake3_256():
    """The id is BLAKE3's 32-byte output: the specification's test vector for empty input,
    and the blake3 package over a 3 MiB blob fed in uneven pieces (several chunks, trees)."""
    assert blob_id(b"").hex() == \
        "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    blob = encode_array(RNG.standard_normal(3 << 18).astype(np.float32))
    hasher = blob_hasher()
    for start, end in ((0, 1), (1, 5000), (5000, 1 << 20), (1 << 20, len(blob))):
        hasher.update(memoryview(blob)[start:end])
    assert hasher.digest() == blob_id(blob) == blake3.blake3(blob).digest()


def test_blob_id_covers_shape_and_dtype():
    data = np.arange(12, dtype=np.int32)
    ids = {blob_id(encode_array(x)) for x in (data, data.reshape(3, 4), data.view(np.float32))}
    assert len(ids) == 3


@pytest.mark.parametrize("corrupt, message", [
    (lambda b: b"XXXX" + b[4:], "magic"),
    (lambda b: b[:4] + bytes([9]) + b[5:], "dtype code"),
    (lambda b: b[:-1], "needs"),
    (lambda b: b + b"\0", "needs"),
    (lambda b: b[:10], "truncated"),
    (lambda b: b[:3], "shorter"),
])
def test_corrupt_blob_is_a_clear_value_error(corrupt, message):
    blob = encode_array(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=message):
        decode_array(corrupt(blob))


def test_unsupported_dtype_named():
    with pytest.raises(ValueError, match="float64"):
        encode_array(np.ones(3))


def test_blob_store_put_get_limit(tmp_path):
    store = BlobStore(tmp_path, max_bytes=200)
    blob = encode_array(np.arange(10, dtype=np.int64))
    id_ = store.put(blob)
    assert store.has(id_) and store.get(id_) == blob and store.get("0x" + id_.hex()) == blob
    assert store.get(b"\1" * 32) is None
    with pytest.raises(ValueError, match="exceeds"):
        store.put(encode_array(np.zeros(100, np.int64)))
    with pytest.raises(ValueError, match="magic"):
        store.put(b"garbage-bytes")
    assert sorted(p.name for p in tmp_path.iterdir()) == [id_.hex()]  # no temp files left


# --- database ------------------------------------------------------------------------------
def test_sqlite_db_persists_only_flushed_writes(tmp_path):
    db = SqliteDB(tmp_path / "kv.sqlite")
    db[b"a"] = b"1"
    db.flush()
    db[b"b"] = b"2"
    del db[b"a"]
    assert b"b" in db and b"a" not in db
    db.close()  # "crash" before the second flush
    reopened = SqliteDB(tmp_path / "kv.sqlite")
    assert reopened[b"a"] == b"1" and b"b" not in reopened
    reopened[b"b"] = b"2"
    del reopened[b"a"]
    reopened.flush()
    reopened.close()
    final = SqliteDB(tmp_path / "kv.sqlite")
    assert final[b"b"] == b"2" and b"a" not in final


def test_sqlite_db_cache_agrees_with_the_table(tmp_path, monkeypatch):
    """Random writes, deletes, flushes and discards: every read through the cached store
    equals a read of the table by a fresh connection (flushed state) or the pending value."""
    import chain.db

    monkeypatch.setattr(chain.db, "CACHE_ENTRIES", 5)  # evictions too
    rng = np.random.default_rng(7)
    db = SqliteDB(tmp_path / "kv.sqlite")
    flushed: dict[bytes, bytes] = {}
    pending: dict[bytes, bytes | None] = {}
    keys = [bytes([k]) for k in range(12)]
    for step in range(400):
        key = keys[rng.integers(len(keys))]
        action = rng.integers(10)
        if action < 4:
            db[key] = pending[key] = step.to_bytes(2, "big")
        elif action < 6 and key in db:
            del db[key]
            pending[key] = None
        elif action == 6:
            db.flush()
            for k, v in pending.items():
                if v is None:
                    flushed.pop(k, None)
                else:
                    flushed[k] = v
            pending = {}
        elif action == 7:
            db.discard()
            pending = {}
        expected = {**flushed, **pending}
        for k in keys:
            assert db.get(k) == expected.get(k), (step, k)
    db.flush()
    db.close()
    fresh = SqliteDB(tmp_path / "kv.sqlite")
    assert {k: fresh.get(k) for k in keys} == \
        {k: v for k, v in {**flushed, **pending}.items() if v is not None} | \
        {k: None for k in keys if {**flushed, **pending}.get(k) is None}


# --- precompile verdicts -------------------------------------------------------------------
def _store_arrays(store, *arrays):
    return [store.put(encode_array(a)) for a in arrays]


@pytest.fixture
def store(tmp_path):
    return BlobStore(tmp_path / "blobs")


def test_precompile_passes_honest_float_result(store):
    a, b = RNG.standard_normal((9, 7), np.float32), RNG.standard_normal((7, 5), np.float32)
    ids = _store_arrays(store, a, b, a @ b)
    assert verdict(store, *ids, 1, 9, 7, 5, 1, 8, b"\1" * 32) == PASS


def test_precompile_fails_wrong_float_result(store):
    a, b = RNG.standard_normal((9, 7), np.float32), RNG.standard_normal((7, 5), np.float32)
    c = a @ b
    c[4, 2] += 0.5
    ids = _store_arrays(store, a, b, c)
    assert verdict(store, *ids, 1, 9, 7, 5, 1, 8, b"\1" * 32) == FAIL


def test_precompile_exact_integers_and_batches(store):
    a = RNG.integers(-100, 100, (3, 4, 6)).astype(np.int32)
    b = RNG.integers(-100, 100, (6, 2)).astype(np.int32)
    good = np.matmul(a.astype(np.int64), b.astype(np.int64))
    bad = good.copy()
    bad[1, 3, 1] += 1
    a_id, b_id, good_id, bad_id = _store_arrays(store, a, b, good, bad)
    assert verdict(store, a_id, b_id, good_id, 3, 4, 6, 2, 0, 4, b"\2" * 32) == PASS
    assert verdict(store, a_id, b_id, bad_id, 3, 4, 6, 2, 0, 4, b"\2" * 32) == FAIL


def test_precompile_missing_or_malformed_blobs_are_verdicts(store):
    a, b = RNG.standard_normal((4, 3), np.float32), RNG.standard_normal((3, 2), np.float32)
    a_id, b_id, c_id = _store_arrays(store, a, b, a @ b)
    missing = b"\7" * 32
    seed = b"\0" * 32
    assert verdict(store, a_id, b_id, missing, 1, 4, 3, 2, 1, 8, seed) == FAIL
    assert verdict(store, missing, b_id, c_id, 1, 4, 3, 2, 1, 8, seed) == BAD_OPERANDS
    # declared shapes that do not match the operands
    assert verdict(store, a_id, b_id, c_id, 1, 4, 3, 3, 1, 8, seed) == BAD_OPERANDS
    # integers declared as a float class, floats declared exact
    (int_id,) = _store_arrays(store, np.ones((4, 3), np.int32))
    assert verdict(store, int_id, b_id, c_id, 1, 4, 3, 2, 1, 8, seed) == BAD_OPERANDS
    assert verdict(store, a_id, b_id, c_id, 1, 4, 3, 2, 0, 8, seed) == BAD_OPERANDS
    # a result with the wrong shape or NaN is the worker's failure
    (wrong_shape,) = _store_arrays(store, (a @ b).T.copy())
    assert verdict(store, a_id, b_id, wrong_shape, 1, 4, 3, 2, 1, 8, seed) == FAIL
    nan = (a @ b).copy()
    nan[0, 0] = np.nan
    (nan_id,) = _store_arrays(store, nan)
    assert verdict(store, a_id, b_id, nan_id, 1, 4, 3, 2, 1, 8, seed) == FAIL


def test_precompile_judges_a_blob_by_its_header_before_reading_it(store):
    """Gas is charged for the declared shapes: a 1x1x1 job naming a 64 MiB A made every node
    read all of it to find its shape wrong. Same verdicts, and only the header is read."""
    big = store.put(encode_array(np.zeros((4096, 4096), np.float32)))
    one = store.put(encode_array(np.ones((1, 1), np.float32)))
    seed = b"\7" * 32
    read = []
    get = store.get
    store.get = lambda id_: read.append(id_) or get(id_)
    assert verdict(store, big, one, one, 1, 1, 1, 1, 1, 8, seed) == BAD_OPERANDS
    assert verdict(store, one, one, big, 1, 1, 1, 1, 1, 8, seed) == FAIL
    assert big not in read
    assert verdict(store, one, one, one, 1, 1, 1, 1, 1, 8, seed) == PASS


@pytest.mark.parametrize("a_shape, b_shape, c_shape", [
    ((4, 3), (3, 2), (1, 4, 2)), ((1, 4, 3), (3, 2), (4, 2)), ((4, 3), (1, 3, 2), (4, 2))])
def test_precompile_result_in_the_other_spelling_of_a_batch_of_1_is_the_workers_failure(
        store, a_shape, b_shape, c_shape):
    """C must have A @ B's shape (3-D if A or B is). The other spelling of a batch of 1 was
    accepted, then refused by the verifier: BAD_OPERANDS, so a worker could cancel any such
    job as the submitter's fault, unslashed."""
    a, b = RNG.standard_normal(a_shape, np.float32), RNG.standard_normal(b_shape, np.float32)
    product = np.matmul(a, b)
    a_id, b_id, honest_id, other_id = _store_arrays(store, a, b, product,
                                                    product.reshape(c_shape))
    seed = b"\4" * 32
    assert verdict(store, a_id, b_id, honest_id, 1, 4, 3, 2, 1, 8, seed) == PASS
    assert verdict(store, a_id, b_id, other_id, 1, 4, 3, 2, 1, 8, seed) == FAIL


def test_precompile_gas_is_quadratic_in_size():
    # doubling every dimension quadruples the per-element part of the cost
    base = check_gas(1, 1, 1, 1, 8) - 3 * 9
    assert check_gas(1, 64, 64, 64, 8) - base == 9 * 3 * 64 * 64
    assert check_gas(2, 128, 128, 128, 8) - base == 4 * 2 * (check_gas(1, 64, 64, 64, 8) - base)


# --- consensus: re-executing blocks re-runs the verifications ------------------------------
MARKET = Web3().eth.contract(address=Web3.to_checksum_address(MARKET_ADDRESS),
                             abi=compiled_market()["abi"])


class Signer:
    def __init__(self, account):
        self.account, self.nonce = account, 0

    def tx(self, fn: str, *args, value: int = 0) -> bytes:
        data = MARKET.encode_abi(fn, args=list(args))
        tx = {"to": MARKET.address, "data": data, "value": value, "gas": 3_000_000,
              "maxFeePerGas": 10**10, "maxPriorityFeePerGas": 1, "nonce": self.nonce,
              "chainId": CHAIN_ID, "type": 2}
        self.nonce += 1
        return self.account.sign_transaction(tx).raw_transaction


def _run_job(node: Node, correct: bool, precision: int = 1) -> int:
    """Register, submit, claim, commit and finalize one job by sealing blocks directly
    (precision 1: float32 operands; 0: exact, int8 operands and an int32 result)."""
    submitter, worker = (Signer(a) for a in dev_accounts(2))
    if precision == 0:
        a, b = (RNG.integers(-128, 128, shape).astype(np.int8) for shape in ((6, 4), (4, 3)))
        c = a.astype(np.int32) @ b.astype(np.int32) + (0 if correct else 1)
    else:
        a, b = RNG.standard_normal((6, 4), np.float32), RNG.standard_normal((4, 3), np.float32)
        c = a @ b + (0 if correct else 1)
    a_id, b_id, c_id = (node.blobs.put(encode_array(x)) for x in (a, b, c))
    for raw in (worker.tx("register", value=10**18),
                submitter.tx("submitJob", a_id, b_id, 1, 6, 4, 3, precision, 50,
                             value=10**15)):
        node.admit(raw)
    node.seal()
    node.admit(worker.tx("claimJob", 0))
    node.seal()
    node.admit(worker.tx("commitResult", 0, c_id))
    node.seal()
    node.admit(worker.tx("finalize", 0))
    return node.seal().number


def test_node_chaindb_writes_what_py_evm_writes(tmp_path, monkeypatch):
    """The fast path's ChainDB: the blocks of a job and empty ones, stored by its direct
    writes for a new head, leave the same database as py-evm's persist_block (and a block off
    the head, py-evm's path in both); its cached headers equal plain reads; a block whose
    write was discarded is not found."""
    node = Node(NodeConfig(tmp_path / "a", block_time=0))
    try:
        assert isinstance(node.chain.chaindb, NodeChainDB)
        _run_job(node, correct=True)
        node.seal()
        sealed = [node.chain.get_canonical_block_by_number(n)
                  for n in range(1, node.head().block_number + 1)]
        assert sum(len(block.transactions) for block in sealed) >= 5 and not sealed[-1].transactions
        head = sealed[-1].header
        sibling = sealed[-1].copy(header=head.copy(timestamp=head.timestamp + 1))
        direct = []  # the blocks NodeChainDB stored by its own writes
        extend_head = NodeChainDB._extend_head
        monkeypatch.setattr(NodeChainDB, "_extend_head",
                            lambda self, block: direct.append(block) or extend_head(self, block))
        stores = []
        for chaindb_class in (ChainDB, NodeChainDB):
            memory = MemoryDB()
            build_chain_class(node.blobs, fast=False).from_genesis(
                AtomicDB(memory), genesis_params(), genesis_state())
            chaindb = chaindb_class(AtomicDB(memory))
            for block in [*sealed, sibling]:
                chaindb.persist_block(block)
            assert chaindb.get_canonical_head() == head
            stores.append(memory.kv_store)
        assert stores[0] == stores[1]
        # every sealed block but the first (py-evm writes the gap markers only from block 1
        # on) and not the sibling
        assert direct == sealed[1:]

        plain = ChainDB(node.chain.chaindb.db)
        for block in sealed:
            assert node.chain.chaindb.get_block_header_by_hash(block.hash) == \
                plain.get_block_header_by_hash(block.hash) == block.header
            for index, transaction in enumerate(block.transactions):
                assert plain.get_transaction_index(transaction.hash) == (block.number, index)
        vm = node.chain.get_vm(type(node.chain.get_vm()).child_header(
            head, head.coinbase, head.timestamp + 1))
        orphan = vm.seal_block(vm.get_header(), [], [], b"")
        node.chain.chaindb.persist_block(orphan)
        assert node.chain.chaindb.get_block_header_by_hash(orphan.hash) == orphan.header
        node.db.discard()
        with pytest.raises(HeaderNotFound):
            node.chain.chaindb.get_block_header_by_hash(orphan.hash)
        assert node.seal().header.parent_hash == head.hash
    finally:
        node.stop()


def test_next_base_fee_is_the_one_the_sealed_block_gets(tmp_path):
    """Admission and eth_gasPrice take the next base fee from EIP-1559's formula on the head
    alone; py-evm's header creation in seal() must arrive at the same fee, after blocks with
    transactions and after empty ones (the fee moves)."""
    from chain.node import PRIORITY_FEE

    node = Node(NodeConfig(tmp_path / "a", block_time=0))
    try:
        _run_job(node, correct=True)
        fees = []
        for _ in range(4):
            expected = node.next_base_fee()
            assert node.gas_price == expected + PRIORITY_FEE
            assert node.seal().header.base_fee_per_gas == expected
            fees.append(expected)
        assert fees == sorted(fees, reverse=True) and fees[0] > fees[-1]
    finally:
        node.stop()


def test_seal_commits_to_verified_work_and_replay_reverifies(tmp_path):
    node = Node(NodeConfig(tmp_path / "a", block_time=0))
    final = _run_job(node, correct=True)
    block = node.chain.get_canonical_block_by_number(final)
    worker = to_canonical_address(dev_accounts(2)[1].address)
    flops = 2 * 6 * 4 * 3
    assert block.header.extra_data == keccak(rlp.encode([[0, worker, flops]]))

    honest = BlobStore(tmp_path / "copy")
    for path in node.blobs.directory.iterdir():
        honest.put(path.read_bytes())
    assert replay(node.chain, honest) == final  # every block imports again

    # a node whose copy of C is corrupt re-runs the check, the job fails: block invalid
    tampered_dir = tmp_path / "tampered"
    shutil.copytree(honest.directory, tampered_dir)
    job_c = [p for p in tampered_dir.iterdir()
             if decode_array(p.read_bytes()).shape == (6, 3)]
    assert len(job_c) == 1
    wrong = decode_array(job_c[0].read_bytes()) + np.float32(1)
    job_c[0].write_bytes(encode_array(wrong))  # content no longer matches its name
    with pytest.raises(ValidationError, match=f"block #{final} is invalid"):
        replay(node.chain, BlobStore(tampered_dir))
    node.stop()


def test_exact_jobs_are_checked_with_one_round(tmp_path):
    """The market asks the precompile for 1 round on exact jobs (false accept <= 1/p) and 8
    on float ones: the finalize blocks differ by 7 rounds of precompile gas, and an exact
    result off by one is still caught."""
    used = {}
    for precision in (0, 1):
        node = Node(NodeConfig(tmp_path / str(precision), block_time=0))
        final = _run_job(node, correct=True, precision=precision)
        used[precision] = node.chain.get_canonical_block_by_number(final).header.gas_used
        assert node.chain.get_canonical_block_by_number(final).header.extra_data != \
            keccak(rlp.encode([]))  # verified work in the seal
        node.stop()
    rounds_gas = check_gas(1, 6, 4, 3, 8) - check_gas(1, 6, 4, 3, 1)  # 7 * elements * 24
    assert abs((used[1] - used[0]) - rounds_gas) < 100  # the rest: one branch in the contract
    node = Node(NodeConfig(tmp_path / "wrong", block_time=0))
    final = _run_job(node, correct=False, precision=0)
    assert node.chain.get_canonical_block_by_number(final).header.extra_data == \
        keccak(rlp.encode([]))
    node.stop()


def test_block_with_forged_seal_is_rejected(tmp_path):
    node = Node(NodeConfig(tmp_path / "a", block_time=0))
    final = _run_job(node, correct=True)
    fresh = build_chain_class(node.blobs).from_genesis(AtomicDB(), genesis_params(),
                                                       genesis_state())
    for number in range(1, final):
        fresh.import_block(node.chain.get_canonical_block_by_number(number))
    block = node.chain.get_canonical_block_by_number(final)
    forged = block.copy(header=block.header.copy(extra_data=keccak(rlp.encode([]))))
    with pytest.raises(ValidationError, match="seal"):
        fresh.import_block(forged)
    node.stop()


def test_wrong_result_is_not_rewarded_and_seal_is_empty(tmp_path):
    node = Node(NodeConfig(tmp_path / "a", block_time=0))
    final = _run_job(node, correct=False)
    block = node.chain.get_canonical_block_by_number(final)
    assert block.header.extra_data == keccak(rlp.encode([]))
    worker = to_canonical_address(dev_accounts(2)[1].address)
    state = node.state_at()
    assert state.get_balance(MARKET_ADDRESS) == 10**18 // 2 + 10**15  # half the stake + fee
    assert state.get_nonce(worker) == 4
    node.stop()


def test_admission_rejects_before_the_mempool(tmp_path):
    node = Node(NodeConfig(tmp_path / "a", block_time=0))
    signer = Signer(dev_accounts(1)[0])
    raw = signer.tx("cancel", 0)
    node.admit(raw)
    with pytest.raises(ValueError, match="already known"):
        node.admit(raw)
    node.seal()
    with pytest.raises(ValueError, match="nonce too low"):
        node.admit(raw)
    with pytest.raises(ValueError, match="decoded"):
        node.admit(os.urandom(50))
    node.stop()


def test_precompile_unverifiable_exact_operands_are_the_submitters(store):
    # k * max|A| * max|B| beyond what the modular check can bound: not the worker's fault
    a = np.full((2, 3), 2**31 - 1, np.int64)
    b = np.full((3, 2), 2**31 - 1, np.int64)
    c = np.zeros((2, 2), np.int64)
    ids = _store_arrays(store, a, b, c)
    assert verdict(store, *ids, 1, 2, 3, 2, 0, 4, b"\3" * 32) == BAD_OPERANDS


# --- submitJob's argument checks (the hot path packs them into few comparisons) -------------
@pytest.mark.parametrize("dims, message", [
    ((1, 6, 4, 3), None),
    ((1, 2**32 - 1, 4, 3), None),
    ((0, 6, 4, 3), "empty shape"),
    ((1, 6, 0, 3), "empty shape"),
    ((1, 6, 4, 2**32), "dim above 2\\*\\*32-1"),
    ((2**33 + 1, 6, 4, 3), "dim above 2\\*\\*32-1"),
    ((1, 2**63, 4, 3), "dim above 2\\*\\*32-1"),
])
def test_submit_job_shape_checks(tmp_path, dims, message):
    node = Node(NodeConfig(tmp_path / "a", block_time=0))
    call = {"from": dev_accounts(1)[0].address, "to": MARKET.address, "value": hex(10**12),
            "data": MARKET.encode_abi("submitJob", args=[b"\1" * 32, b"\2" * 32, *dims, 1, 50])}
    if message is None:  # the first job's id
        assert int(Rpc(node).rpc_eth__call(call), 16) == 0
    else:
        with pytest.raises(RpcError, match=message):
            Rpc(node).rpc_eth__call(call)
    node.stop()


def test_a_stopped_node_seals_what_it_admitted(tmp_path):
    """A transaction whose hash the node answered is in a block after a plain stop (it was
    lost unless a block happened to be sealed first; only a crash may lose it), and a
    restarted node serves it from the database."""
    config = NodeConfig(tmp_path / "a", block_time=3600, seal_on_pending=False)
    node = Node(config)
    node.start()
    payer, payee = dev_accounts(2)
    raw = payer.sign_transaction({
        "to": payee.address, "value": 12345, "gas": 21_000, "maxFeePerGas": 10**10,
        "maxPriorityFeePerGas": 1, "nonce": 0, "chainId": CHAIN_ID, "type": 2,
    }).raw_transaction
    tx_hash = node.admit(raw)
    head = node.head().block_number
    node.stop()
    node = Node(config)
    try:
        assert node.head().block_number == head + 1
        block = node.chain.get_canonical_block_by_number(head + 1)
        assert [tx.hash for tx in block.transactions] == [tx_hash]
        state = node.chain.get_vm().state
        assert state.get_nonce(bytes.fromhex(payer.address[2:])) == 1
    finally:
        node.stop()
