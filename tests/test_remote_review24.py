"""Review of sending matmuls to the network from Python (node/client.py, needle/remote.py):
a batch that fails with some of its jobs already done and paid for, operands numpy spells
in another way, and settings a user gets wrong.

Against a real chain node process on 127.0.0.1 (the `node` fixture: blocks only when
transactions are pending), its real contract and blob store. The "worker" is a staked dev
account sending claimJob / commitResult / finalize itself, so that exactly the jobs under
test are done; numpy is the reference for every result."""
import array
import math

import numpy as np
import pytest
from helpers import finalize_when_due

from chain.devnet import dev_account
from needle.remote import Network
from node.client import JobClient, RemoteJobError
from node.devnet import free_port
from node.market import JOB_CANCELLED, Market

pytestmark = pytest.mark.timeout(120)
ETHER = 10**18


@pytest.fixture(scope="module")
def worker(node):
    """A staked dev account acting as a worker by hand."""
    market = Market(node.url, dev_account(11))
    market.send("register", value=2 * ETHER)
    yield market
    market.close()


def _do(market: Market, job_id: int, c: np.ndarray) -> None:
    """Claim, commit `c` and finalise: the job verified and its fee paid."""
    market.send("claimJob", job_id)
    market.send("commitResult", job_id, market.put_array(c))
    finalize_when_due(market, job_id)


def _two_pairs(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((5, 4), np.float32), rng.standard_normal((4, 3), np.float32))
            for _ in range(2)]


class _InterruptedOnceOneIsDone(JobClient):
    """Ctrl-C while following a batch of which one job is done (verified, fetched)."""

    def _nudge(self, p, head):
        raise KeyboardInterrupt


# -- a batch that fails part way ---------------------------------------------------------------


def test_a_batch_that_times_out_keeps_the_results_its_finished_jobs_were_paid_for(node, worker):
    """Job 0 of a batch is verified (its fee paid to the worker) and fetched; job 1 is never
    claimed and the wait times out. The error named and cancelled job 1 but said nothing of
    job 0: its verified C, paid for, was dropped with the error, and nothing told the user
    which job to fetch again."""
    pairs = _two_pairs(1)
    client = JobClient(node.url, dev_account(3), timeout=3, poll_interval=0.2)
    try:
        done, stuck = client.submit(pairs)
        _do(worker, done.job_id, pairs[0][0] @ pairs[0][1])
        with pytest.raises(RemoteJobError) as raised:
            client.wait([done, stuck])
        assert client.market.job(stuck.job_id).status == JOB_CANCELLED
    finally:
        client.close()
    err = raised.value
    assert err.job_id == stuck.job_id and err.stage == "submitted"
    assert f"job {stuck.job_id} cancelled" in str(err)
    assert f"needle-net fetch {done.job_id} -o C.npy" in str(err)
    assert list(err.results) == [done.job_id]
    np.testing.assert_allclose(err.results[done.job_id],
                               pairs[0][0].astype(np.float64) @ pairs[0][1], rtol=1e-5,
                               atol=1e-5)


def test_an_interrupted_batch_says_which_of_its_jobs_finished(node, worker):
    """The same with a Ctrl-C: "interrupted: job N cancelled" named only the cancelled job."""
    pairs = _two_pairs(2)
    client = _InterruptedOnceOneIsDone(node.url, dev_account(4), timeout=30, poll_interval=0.2)
    try:
        done, stuck = client.submit(pairs)
        _do(worker, done.job_id, pairs[0][0] @ pairs[0][1])
        with pytest.raises(KeyboardInterrupt) as raised:
            client.wait([done, stuck])
    finally:
        client.close()
    message = str(raised.value)
    assert f"job {stuck.job_id} cancelled" in message
    assert f"needle-net fetch {done.job_id} -o C.npy" in message


# -- operands ----------------------------------------------------------------------------------


def test_int64_operands_of_numpy_s_longlong_type_are_an_exact_job(node, worker):
    """On Linux numpy has two int64 types, int64 ('l') and longlong ('q', what array('q'),
    struct and some readers give). A longlong pair was refused as "unsupported dtype int64:
    use ... or int64 for exact jobs", a message that contradicts itself."""
    a = np.asarray(array.array("q", range(-6, 6))).reshape(3, 4)
    b = np.asarray(array.array("q", range(8))).reshape(4, 2)
    assert a.dtype == np.int64 and a.dtype.type is not np.int64
    client = JobClient(node.url, dev_account(5), timeout=30, poll_interval=0.2)
    try:
        (p,) = client.submit([(a, b)])
        _do(worker, p.job_id, a.astype("l") @ b.astype("l"))
        (c,) = client.wait([p])
    finally:
        client.close()
    assert c.dtype == np.int64
    np.testing.assert_array_equal(c, a.astype(object) @ b.astype(object))


# -- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [None, "60", [60]])
def test_a_timeout_that_is_not_a_number_is_refused_with_a_clear_message(timeout):
    """`Network(timeout=None)` (meant as "no timeout") or a string from a config file used to
    end in "TypeError: '>' not supported between instances of 'NoneType' and 'int'", naming
    neither the setting nor what it takes. No node listens at this URL: the check comes
    first."""
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds"):
        Network(url, timeout=timeout)
    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds"):
        JobClient(url, timeout=timeout)


def test_an_infinite_timeout_is_still_taken():
    """docs/node.md: `inf` waits for good (checked before connecting: ConnectionError)."""
    with pytest.raises(ConnectionError):
        Network(f"http://127.0.0.1:{free_port()}", timeout=math.inf)


@pytest.mark.parametrize("n,hinted", [(600, True), (64, False)])
def test_a_large_job_nobody_claimed_names_its_deadline(node, n, hinted):
    """Workers claim a large job only where its deadline leaves them time (a claim that
    expires costs 10 % of their stake): a large job timed out unclaimed said only "no worker
    moved the job on", where a larger deadline is what the user can change. Nothing else
    runs on this node's module but hand-driven workers, so nobody claims here."""
    a = np.ones((n, n), np.float32)
    client = JobClient(node.url, dev_account(13), fee_wei=10**15, timeout=2, timeout_blocks=3)
    try:
        with pytest.raises(RemoteJobError, match="stage submitted") as caught:
            client.matmul(a, a)
    finally:
        client.close()
    assert ("a larger --deadline (timeout_blocks) lets them" in str(caught.value)) == hinted
    assert "3 blocks after the claim" in str(caught.value) or not hinted


def test_network_without_a_url_uses_needle_net_rpc_as_the_cli_does(node, monkeypatch):
    """The CLI's --rpc-url falls back to $NEEDLE_NET_RPC (compose sets it); Network() went
    to 127.0.0.1:8545 whatever it said."""
    monkeypatch.setenv("NEEDLE_NET_RPC", node.url)
    network = Network(timeout=5)
    try:
        assert network.client.market.client.url == node.url
    finally:
        network.close()
