"""Review of the worker's products (node/compute.py), its keystore (node/keys.py) and the
market client (node/market.py). Products are checked against exact references and
`verifier.verify` itself (a C it fails is a 50 % slash); keystores with real files and
processes; the market against a real chain node process."""
import errno
import json
import multiprocessing
import os
import queue
import socket
import stat
import threading

import numpy as np
import pytest
from eth_account import Account

from chain.devnet import dev_account
from node import compute, keys
from node.market import Market, TxReverted, finalize_gas, is_transient
from verifier import verify
from verifier.rng import P

pytestmark = pytest.mark.timeout(120)
ETHER = 10**18
EXACT_LIMIT = (P - 1) // 2  # exact jobs need k max|A| max|B| below (2^61 - 1) / 2


# --- products --------------------------------------------------------------------------------
@pytest.mark.parametrize("big", ["A", "B"])
def test_float_operands_of_either_byte_order_are_multiplied(device, big):
    """check_operands takes a big-endian float32 operand (its dtype's type is float32); the
    product refused it beside a native one ("operand dtypes differ"), after the claim."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 5, 7), np.float32), rng.standard_normal((7, 3), np.float32)
    if big == "A":
        a = a.astype(">f4")
    else:
        b = b.astype(">f4")
    compute.check_operands(a, b, (2, 5, 7, 3), exact=False)
    c = compute.matmul(a, b, device)
    assert c.dtype == np.float32 and c.dtype.isnative and c.shape == (2, 5, 3)
    assert verify(a, b, c, precision="fp32", seed=b"order").passed


def _at_bound(dtype_a, dtype_b, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Operands as large as an exact job allows for this k and these dtypes, both signs, one
    row and one column at the extreme."""
    bound_a = min(-int(np.iinfo(dtype_a).min), (EXACT_LIMIT - 1) // k)
    bound_b = min(-int(np.iinfo(dtype_b).min), (EXACT_LIMIT - 1) // (k * bound_a))
    a = rng.integers(-bound_a, bound_a, (3, k), endpoint=True).clip(*_range(dtype_a))
    b = rng.integers(-bound_b, bound_b, (k, 2), endpoint=True).clip(*_range(dtype_b))
    a[0], b[:, 1] = max(-bound_a, np.iinfo(dtype_a).min), min(bound_b, np.iinfo(dtype_b).max)
    return a.astype(dtype_a), b.astype(dtype_b)


def _range(dtype) -> tuple[int, int]:
    return int(np.iinfo(dtype).min), int(np.iinfo(dtype).max)


@pytest.mark.parametrize("dtype_a", [np.int8, np.int16, np.int32, np.int64])
@pytest.mark.parametrize("dtype_b", [np.int8, np.int64])
@pytest.mark.parametrize("k", [1, 255, 257, 1025])
def test_exact_products_at_the_verifiers_bound_pass_its_check(dtype_a, dtype_b, k):
    """Every slice and limb bound of the float-BLAS exact product, at the largest entries a
    job may hold: C equals the integer product and the chain's check passes it."""
    a, b = _at_bound(dtype_a, dtype_b, k, np.random.default_rng(k))
    compute.check_operands(a, b, (1, 3, k, 2), exact=True)
    c = compute.matmul(a, b)
    assert c.dtype == np.int64
    assert (c.astype(object) == a.astype(object) @ b.astype(object)).all()
    assert verify(a, b, c, precision="exact", seed=b"edge").passed


# --- keystores -------------------------------------------------------------------------------
def test_a_new_key_is_private_whatever_was_left_beside_it(tmp_path):
    """A temporary file left where the keystore is written (a crash, another program)
    kept its mode through O_CREAT, and the key landed world-readable."""
    path = tmp_path / "key.json"
    leftover = tmp_path / "key.json.tmp"
    leftover.write_text("{}")
    leftover.chmod(0o644)
    old_umask = os.umask(0)
    try:
        keys.load_or_create(path, "pw", iterations=2)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key.json", "key.json.tmp"]


def _create_each(barrier, paths: list[str], answers) -> None:
    for path in paths:
        barrier.wait(timeout=10)
        answers.put((path, keys.load_or_create(path, "pw", iterations=2).address))


def test_workers_creating_one_keystore_at_once_all_get_the_key_it_holds(tmp_path):
    """Two workers started on one data dir both found no key.json, both created an account
    and both renamed their file onto it: one ran (and staked) with a key nobody kept, or
    crashed on the temporary file the other had renamed."""
    context = multiprocessing.get_context("fork")
    paths = [str(tmp_path / f"key{attempt}.json") for attempt in range(10)]
    barrier, answers = context.Barrier(4), context.Queue()
    workers = [context.Process(target=_create_each, args=(barrier, paths, answers))
               for _ in range(4)]
    for worker in workers:
        worker.start()
    try:
        got = [answers.get(timeout=10) for _ in range(len(paths) * len(workers))]
    except queue.Empty:
        pytest.fail(f"a worker crashed: exit codes {[w.join(10) or w.exitcode for w in workers]}")
    for worker in workers:
        worker.join(10)
    for path in paths:
        assert {address for p, address in got if p == path} == {
            keys.load_keystore(path, "pw").address}, path


def test_a_new_keystore_is_on_disk_before_it_has_its_name(tmp_path, monkeypatch):
    """Without fsync a power loss soon after the first start could leave key.json empty,
    its staked account's key lost."""
    path = tmp_path / "key.json"
    events = []
    real_fsync, real_link, real_replace = os.fsync, os.link, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def named(kind, real):
        def call(src, dst, *args, **kwargs):
            events.append((kind, str(src), str(dst)))
            return real(src, dst, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", named("name", real_link))
    monkeypatch.setattr(os, "replace", named("name", real_replace))
    keys.load_or_create(path, "pw", iterations=2)
    keys.save_keystore(Account.create(), path, "pw", iterations=2)
    for first, second in ((0, 1), (3, 4)):
        (_, synced), (kind, tmp, target), (_, directory) = events[first:second + 2]
        assert synced == tmp and target == str(path) and directory == str(tmp_path), events


def test_a_dangling_link_in_place_of_the_keystore_is_never_replaced(tmp_path):
    """key.json linked to a volume not mounted yet: a fresh key replaced the link."""
    path = tmp_path / "key.json"
    path.symlink_to(tmp_path / "volume" / "key.json")
    with pytest.raises(keys.KeystoreError, match="cannot read keystore .*key.json"):
        keys.load_or_create(path, "pw", iterations=2)
    assert path.is_symlink()


def test_keystores_of_other_versions_and_unwritable_places_are_clear_errors(tmp_path):
    path = tmp_path / "key.json"
    keyfile = Account.encrypt(Account.create().key, "pw", kdf="pbkdf2", iterations=2)
    path.write_text(json.dumps({**keyfile, "version": 1}))  # eth-keyfile: NotImplementedError
    with pytest.raises(keys.KeystoreError, match=f"{path} is a keystore of version 1"):
        keys.load_or_create(path, "pw")
    blocker = tmp_path / "file"
    blocker.write_text("")
    for save in (lambda p: keys.load_or_create(p, "pw", iterations=2),
                 lambda p: keys.save_keystore(Account.create(), p, "pw", iterations=2)):
        with pytest.raises(keys.KeystoreError, match="cannot write keystore .*file/key.json"):
            save(blocker / "key.json")  # was a bare FileExistsError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "key.json"]


# --- the market client -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def market(node):
    client = Market(node.url, dev_account(6))
    yield client
    client.close()


@pytest.fixture
def cut_answers():
    """A server that sends half of every answer and closes (the node dying mid-answer)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 200\r\n\r\n{"jsonrpc"')

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


def _reconnect(market: Market, host: str, port: int) -> None:
    connections = market.w3.provider.connections
    connections.close()
    connections._local.conn = None
    connections.host, connections.port = host, port


def test_network_failures_are_transient_and_reverts_are_not(node, market, cut_answers):
    """An answer cut off mid-body (IncompleteRead), a name that does not resolve and a
    network that is down ended a held job's retries at once: a claim left to expire."""
    with pytest.raises(TxReverted) as reverted:  # no job 10**9: reverts on chain
        market.send_with_gas(200_000, "claimJob", 10**9)
    assert not is_transient(reverted.value)
    try:
        _reconnect(market, "127.0.0.1", cut_answers)
        for call in (lambda: market.stake_of(market.address), lambda: market.follow(1, 1)):
            with pytest.raises(Exception) as cut:
                call()
            assert is_transient(cut.value), repr(cut.value)
        _reconnect(market, "no-such-chain-node.invalid", 8545)
        with pytest.raises(OSError) as unresolved:
            market.block_number()
        assert is_transient(unresolved.value), repr(unresolved.value)
    finally:
        _reconnect(market, "127.0.0.1", int(node.url.rsplit(":", 1)[1]))
    assert market.block_number() >= 0
    assert is_transient(OSError(errno.ENETUNREACH, os.strerror(errno.ENETUNREACH)))
    assert not is_transient(OSError(errno.EACCES, os.strerror(errno.EACCES)))


def test_finalize_gas_of_a_large_job_fits_a_block_and_suffices(market):
    """Doubling the check's cost asked 2.04e9 gas for a 6144^3 float job: above the block gas
    limit (2e9), so the node refused the worker's finalize. The limit must stay enough for
    the precompile's whole charge (the blobs are missing here: charged, then cancelled)."""
    market.send("register", value=2 * ETHER)
    missing = bytes(range(32))
    for precision, (m, k, n) in ((1, (6144, 6144, 6144)), (0, (1, 1 << 27, 1))):
        receipt = market.send("submitJob", missing, missing, 1, m, k, n, precision, 50,
                              value=10**15)
        job_id = market.events_in(receipt, "JobSubmitted")[0]["jobId"]
        market.send("claimJob", job_id)
        market.send("commitResult", job_id, missing)
        job = market.job(job_id)
        receipt = market.send_with_gas(finalize_gas(job), "finalize", job_id)
        assert market.verdicts_in(receipt)[job_id].cancelled
        assert receipt["gasUsed"] < finalize_gas(job) < 2 * 10**9
