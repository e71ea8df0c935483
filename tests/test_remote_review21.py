"""Review of the client side of remote matmul jobs (node/client.py, needle/remote.py):
settings and inputs a user gets wrong, and results committed by a worker that is not this
project's (a third-party or faulty one: the network is open to any staked worker).

Against a real chain node process on 127.0.0.1 (the `node` fixture: blocks only when
transactions are pending), its real contract and blob store. The "worker" here is a dev
account sending claimJob / commitResult / finalize itself, so that exactly the C under test
is committed; numpy is the reference for every result."""
import math
import threading

import numpy as np
import pytest
from helpers import finalize_when_due, wait_for

from chain.devnet import dev_account
from needle.remote import Network
from node.client import JobClient, RemoteJobError
from node.devnet import free_port
from node.market import JOB_DONE, Market, is_transient

pytestmark = pytest.mark.timeout(120)
ETHER = 10**18


@pytest.fixture(scope="module")
def worker(node):
    """A staked dev account acting as a worker by hand (4 ETH: a 50 % slash leaves it able
    to claim)."""
    market = Market(node.url, dev_account(11))
    market.send("register", value=4 * ETHER)
    yield market
    market.close()


def _commit(market: Market, job_id: int, c: np.ndarray) -> None:
    market.send("claimJob", job_id)
    market.send("commitResult", job_id, market.put_array(c))


# -- settings and inputs ----------------------------------------------------------------------


def test_a_network_without_a_chain_node_says_how_to_start_one():
    """`Network()` with no chain node running (the first thing a new user does) used to end
    in a bare httpx ConnectError, "[Errno 111] Connection refused", naming neither the URL
    nor what to do."""
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError) as raised:
        Network(url)
    message = str(raised.value)
    assert url in message and "needle-net devnet up" in message
    assert is_transient(raised.value)  # still the kind of error callers retry


@pytest.mark.parametrize("setting,match", [
    ({"timeout": math.nan}, "timeout"),       # used to wait forever: no deadline ever passed
    ({"timeout": 0}, "timeout"),
    ({"fee_wei": -1}, "fee_wei"),             # used to fail at submit: "ABI Not Found!"
    ({"fee_wei": 1.5e15 + 0.5}, "fee_wei"),
    ({"timeout_blocks": 0}, "timeout_blocks"),  # used to revert on chain, for gas
    ({"timeout_blocks": 100_001}, "timeout_blocks"),
])
def test_bad_client_settings_are_refused_before_connecting(setting, match):
    """Checked before anything is connected or paid (no node listens at this URL: a setting
    check that came later would raise ConnectError instead)."""
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=match):
        JobClient(url, **setting)


def test_a_fee_written_as_a_float_is_paid_in_wei(node, worker):
    """`Network(fee_wei=1e15)` is how people write 10^15; it used to reach the signing and
    fail there ("MismatchedABI: ABI Not Found!") after the operands were uploaded."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((4, 3), np.float32), rng.standard_normal((3, 2), np.float32)
    client = JobClient(node.url, dev_account(3), fee_wei=2e15, timeout=30, poll_interval=0.2)
    try:
        (p,) = client.submit([(a, b)])
        assert client.market.job(p.job_id).fee_wei == 2 * 10**15
        _commit(worker, p.job_id, a @ b)
        finalize_when_due(worker, p.job_id)
        (c,) = client.wait([p])
    finally:
        client.close()
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


def test_more_jobs_than_one_transaction_holds_are_refused_before_any_upload(node):
    """submitJobs opens at most 256 jobs (ComputeMarket.MAX_BATCH_JOBS). A bigger batch used
    to upload every operand and then revert on chain, for gas, with "('execution reverted',
    '0x')" and no word of the limit."""
    pairs = [(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))] * 257
    client = JobClient(node.url, dev_account(4), timeout=30)
    try:
        jobs, balance = client.market.job_count(), client.market.balance_of(client.address)
        with pytest.raises(RemoteJobError, match="256") as raised:
            client.matmul_batch(pairs)
        assert raised.value.stage == "validate"
        assert client.market.job_count() == jobs
        assert client.market.balance_of(client.address) == balance  # no gas spent
    finally:
        client.close()


# -- results a worker committed ---------------------------------------------------------------


def test_a_committed_result_of_the_wrong_dtype_does_not_end_the_wait(node, worker):
    """A worker commits an int64 C for a float32 job. The chain fails it (the worker is
    slashed, the job reopens) and an honest commit is then verified. The client's early
    check of the bad C used to raise verify's TypeError out of wait(): the user lost the
    job that was then done and paid for."""
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((6, 5), np.float32), rng.standard_normal((5, 4), np.float32)
    client = JobClient(node.url, dev_account(5), timeout=40, poll_interval=0.2)
    box = {}

    def follow():
        try:
            box["result"] = client.wait(pending)
        except BaseException as err:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = err

    try:
        pending = client.submit([(a, b)])
        job_id = pending[0].job_id
        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        _commit(worker, job_id, np.rint(a @ b).astype(np.int64))
        wait_for(lambda: pending[0].early is not None or not thread.is_alive(), 20,
                 "the client to fetch and check the committed C")
        assert "error" not in box, f"wait() ended on a C the chain had not judged: {box}"
        finalize_when_due(worker, job_id)  # FAIL: the job reopens
        _commit(worker, job_id, a @ b)
        finalize_when_due(worker, job_id)
        thread.join(30)
        assert not thread.is_alive() and "error" not in box, box
    finally:
        client.close()
    (c,) = box["result"]
    assert c.dtype == np.float32 and c.shape == (6, 4)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


def test_an_exact_result_comes_back_as_int64_whatever_integer_type_was_committed(node,
                                                                               worker):
    """An exact job's C may be any integer type: the chain checks it mod p, and verifies an
    int32 C. It came back as int32, where the same job done by this project's worker gives
    int64 (docs/node.md): the dtype a user got depended on which worker took the job."""
    rng = np.random.default_rng(3)
    a, b = (rng.integers(-100, 100, s).astype(np.int8) for s in ((3, 4), (4, 2)))
    expected = a.astype(np.int64) @ b  # numpy's int8 product would wrap
    client = JobClient(node.url, dev_account(6), timeout=30, poll_interval=0.2)
    try:
        (p,) = client.submit([(a, b)])
        _commit(worker, p.job_id, expected.astype(np.int32))
        finalize_when_due(worker, p.job_id)
        assert client.market.job(p.job_id).status == JOB_DONE  # verified and paid
        (c,) = client.wait([p])
    finally:
        client.close()
    assert c.dtype == np.int64
    np.testing.assert_array_equal(c, expected)


def test_a_job_left_unclaimed_says_when_its_product_may_overflow(node):
    """Workers compute a float product that may overflow float32 before claiming it and skip
    it if it does (the chain fails an Inf C, slashing the worker), so the client only timed
    out with "no worker moved the job on". The timeout now says why it may have been passed
    over, and not for a job that could not overflow."""
    client = JobClient(node.url, dev_account(12), timeout=2)
    try:
        huge = np.full((2, 3), 1e20, np.float32)
        with pytest.raises(RemoteJobError, match="may overflow float32.*scale A or B down"):
            client.matmul(huge, huge.T.copy())
        small = np.ones((2, 3), np.float32)
        with pytest.raises(RemoteJobError, match=r"no worker moved the job on\)") as raised:
            client.matmul(small, small.T.copy())
        assert "overflow" not in str(raised.value)
    finally:
        client.close()
