"""`needle-net` review 25, against a real chain node process on 127.0.0.1: a result file
that appeared while the job ran is not replaced without --force (it was, silently); a
submission the node refuses (insufficient funds) is one readable line, not web3's raw
JSON-RPC dict; an operand whose header declares more than memory holds is one error line,
not a MemoryError traceback."""

import numpy as np
import pytest
from helpers import keystore_options, submit_as_declared
from helpers import one_error_line as _one_error_line
from helpers import run_cli as _cli

from chain.client import ChainClient
from chain.devnet import dev_account
from node.market import JOB_DONE, Market

pytestmark = pytest.mark.timeout(300)
ETHER = 10**18
FEE = 10**15
SUBMITTER, WORKER, POOR = 1, 2, 3  # genesis-funded dev accounts, 10000 ETH each


def _done_job(url: str, a: np.ndarray, b: np.ndarray) -> int:
    """A job finalised with the true A @ B, a dev account acting as its worker."""
    market = Market(url, dev_account(SUBMITTER))
    worker = ChainClient(url, dev_account(WORKER).key)
    try:
        if market.stake_of(worker.account.address) == 0:
            worker.send(worker.market.functions.register(), value=ETHER)
        [job_id] = submit_as_declared(market, FEE, [(a, b, (1, *a.shape, b.shape[1]), 1)])
        f = worker.market.functions
        worker.send(f.claimJob(job_id))
        worker.send(f.commitResult(job_id, worker.put_blob(a @ b)))
        worker.send(f.finalize(job_id))
        assert market.job(job_id).status == JOB_DONE
    finally:
        worker.close()
        market.close()
    return job_id


def test_an_output_created_while_the_result_was_fetched_is_not_replaced(node, tmp_path,
                                                                        monkeypatch):
    """The output is checked before the job (no file yet), written after it, minutes later
    for a submit. A file another command wrote there meanwhile (a second `submit -o c.npy`)
    was replaced without a word; now it stays, and the result, paid for, is kept in the
    file the error names."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4), np.float32), rng.standard_normal((4, 2), np.float32)
    job_id = _done_job(node.url, a, b)
    out = tmp_path / "c.npy"
    real_get_array = Market.get_array

    def get_array_while_another_writes(self, c_id):
        out.write_bytes(b"another command's result")  # while this command waits
        return real_get_array(self, c_id)

    monkeypatch.setattr(Market, "get_array", get_array_while_another_writes)
    line = _one_error_line(_cli("fetch", job_id, "-o", out, "--rpc-url", node.url))
    assert out.read_bytes() == b"another command's result"
    [kept] = [p for p in tmp_path.iterdir() if p != out]
    assert line == (f"error: output {out} was created by something else while the job ran; "
                    f"not overwritten: the result is in {kept}")
    np.testing.assert_allclose(np.load(kept), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


def test_an_output_created_meanwhile_is_replaced_with_force(node, tmp_path, monkeypatch):
    """--force still overwrites, whenever the file appeared."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    job_id = _done_job(node.url, a, a.T.copy())
    out = tmp_path / "c.npy"
    real_get_array = Market.get_array

    def get_array_while_another_writes(self, c_id):
        out.write_bytes(b"another command's result")
        return real_get_array(self, c_id)

    monkeypatch.setattr(Market, "get_array", get_array_while_another_writes)
    result = _cli("fetch", job_id, "-o", out, "--force", "--rpc-url", node.url)
    assert result.exit_code == 0, result.output
    np.testing.assert_array_equal(np.load(out), a @ a.T)
    assert [p.name for p in tmp_path.iterdir()] == ["c.npy"]


def test_a_submission_the_node_refuses_is_one_readable_line(node, tmp_path):
    """A fee above the account's balance: the node refuses the transaction. The error read
    "[stage submit] Web3RPCError: eth_sendRawTransaction refused: {'code': -32000,
    'message': 'insufficient funds: ...'}" and named no account."""
    a = np.ones((2, 2), np.float32)
    np.save(tmp_path / "a.npy", a)
    line = _one_error_line(_cli("submit", tmp_path / "a.npy", tmp_path / "a.npy", "-o",
                                tmp_path / "c.npy", "--fee", 20_000, "--rpc-url", node.url,
                                *keystore_options(tmp_path, POOR)))
    assert line.startswith("error: [stage submit] the chain node refused: insufficient "
                           "funds"), line
    assert "{" not in line and "Web3RPCError" not in line, line
    assert dev_account(POOR).address in line
    assert not (tmp_path / "c.npy").exists()


def test_an_operand_declaring_more_than_memory_holds_is_one_error_line(tmp_path):
    """A .npy header (truncated or corrupt file) declaring a 3.6 TiB array: np.load's
    MemoryError ended `submit` in a traceback, before any node was asked."""
    path = tmp_path / "a.npy"
    with path.open("wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<f4", "fortran_order": False, "shape": (10**6, 10**6)})
        f.write(bytes(64))
    line = _one_error_line(_cli("submit", path, path, "-o", tmp_path / "c.npy", "--rpc-url",
                                "http://127.0.0.1:1"))
    assert line.startswith(f"error: cannot read operand {path}: "), line


def test_a_missing_keystore_is_named_before_any_password_is_asked_for(tmp_path, monkeypatch):
    """With no password given, a mistyped --keystore said only that no password was set."""
    monkeypatch.delenv("NEEDLE_NET_PASSWORD", raising=False)
    line = _one_error_line(_cli("balance", "--keystore", tmp_path / "missing.json"))
    assert "missing.json does not exist" in line, line


def test_a_stake_below_the_minimum_names_the_amounts_and_sends_nothing(node, tmp_path):
    """It said only the contract's "stake below minStake" (from the gas estimate), without
    the amounts."""
    account = dev_account(POOR)
    market = Market(node.url, account)
    try:
        minimum, nonce = market.min_stake(), market.client.w3.eth.get_transaction_count(
            account.address)
        assert market.stake_of(account.address) == 0
        line = _one_error_line(_cli("stake", "0.01", "--rpc-url", node.url,
                                    *keystore_options(tmp_path, POOR)))
        assert f"minimum of {minimum / ETHER:g} ETH" in line, line
        assert market.client.w3.eth.get_transaction_count(account.address) == nonce
    finally:
        market.close()
