"""`needle-net` against a real chain node process on 127.0.0.1: user mistakes and an
unreachable node end in one `error:` line (no traceback, nothing spent); a job nobody
delivers is cancelled and refunded on timeout or Ctrl-C; `cancel` and `fetch`. Where a
worker is needed it is driven by hand with signed transactions, so each step is known.
Money is checked against balances read from the chain and the gas its receipts report."""

import json
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import keystore_options
from helpers import one_error_line as _one_error_line
from helpers import run_cli as _cli

from chain.client import ChainClient
from chain.devnet import dev_account
from chain.launch import free_port
from node import keys
from node.client import JobClient, RemoteJobError, validate_operands
from node.market import JOB_CANCELLED, JOB_CLAIMED, Market

pytestmark = pytest.mark.timeout(300)
ETHER = 10**18
FEE = 10**15
SUBMITTER = 12  # dev account that submits through the CLI
WORKER = 13  # dev account driven by hand as a worker
STRANGER = 14  # dev account that did not submit


@pytest.fixture(scope="module")
def chain(node):
    """A view of the node (dev account 7) and a hand-driven worker with its stake."""
    observer = Market(node.url, dev_account(7))
    worker = ChainClient(node.url, dev_account(WORKER).key)
    worker.send(worker.market.functions.register(), value=ETHER)
    yield observer, worker
    worker.close()
    observer.close()


def _operands(tmp_path, a, b) -> tuple:
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    return tmp_path / "a.npy", tmp_path / "b.npy"


def _gas_paid(observer, event: str, job_id: int) -> int:
    """Wei the sender paid for gas in the transaction that emitted `event` for `job_id`."""
    [log] = getattr(observer.contract.events, event).get_logs(
        argument_filters={"jobId": job_id}, from_block=0)
    receipt = observer.w3.eth.get_transaction_receipt(log["transactionHash"])
    return receipt["gasUsed"] * receipt["effectiveGasPrice"]


def _wait_for_job(observer, count: int, alive) -> int:
    """Wait until the market has more than `count` jobs (the CLI submitted); the new id."""
    end = time.monotonic() + 60
    while observer.job_count() == count:
        assert alive(), "the CLI exited before submitting"
        assert time.monotonic() < end, "no job was submitted"
        observer.wait_for_block(observer.block_number() + 1, 0.5)
    return count


def _in_thread(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=fn()), daemon=True)
    thread.start()

    def join():
        thread.join(120)
        assert not thread.is_alive(), "the CLI did not finish"
        return box["result"]

    return thread.is_alive, join


def _deliver(worker, job_id: int, c: np.ndarray) -> None:
    """Commit `c` as the claimed job's result and finalise it, as a worker would."""
    f = worker.market.functions
    worker.send(f.commitResult(job_id, worker.put_blob(c)))
    worker.send(f.finalize(job_id))


# -- output path (bug 1) ---------------------------------------------------------------


def test_a_result_that_cannot_be_written_names_its_job_and_fetch_gets_it(chain, tmp_path,
                                                                         node):
    """The output's directory removed while the job ran (as a full disk would fail the
    write): the job is done and paid for, and the error said only "cannot write", with no
    job id to fetch it by. It now names the job and the fetch command; a success names the
    job too."""
    observer, worker = chain
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((5, 3), np.float32), rng.standard_normal((3, 4), np.float32)
    a_path, b_path = _operands(tmp_path, a, b)
    out = tmp_path / "out"
    out.mkdir()

    def delivered(output, before_delivery=lambda: None):
        """`submit` to `output`, its job claimed and delivered by hand: (job id, result)."""
        jobs = observer.job_count()
        alive, join = _in_thread(lambda: _cli(
            "submit", a_path, b_path, "-o", output, "--timeout", "60", "--rpc-url", node.url,
            *keystore_options(tmp_path, SUBMITTER)))
        job_id = _wait_for_job(observer, jobs, alive)
        worker.send(worker.market.functions.claimJob(job_id))
        before_delivery()
        _deliver(worker, job_id, a @ b)
        return job_id, join()

    job_id, failed = delivered(out / "c.npy", out.rmdir)
    line = _one_error_line(failed)
    assert line.startswith(f"error: cannot write {out / 'c.npy'}: "), line
    assert line.endswith(f"; job {job_id}'s result is verified and paid for: `needle-net "
                         f"fetch {job_id} -o FILE` writes it to FILE"), line
    fetched = _cli("fetch", job_id, "-o", tmp_path / "again.npy", "--rpc-url", node.url)
    assert fetched.exit_code == 0, fetched.output
    np.testing.assert_array_equal(np.load(tmp_path / "again.npy"), a @ b)

    job_id, done = delivered(tmp_path / "c2.npy")
    assert done.exit_code == 0, done.output
    assert f"wrote {tmp_path / 'c2.npy'} (5, 4) float32: job {job_id}'s result, verified" \
        in " ".join(done.output.split())


@pytest.mark.parametrize("where", ["missing_dir/c.npy", "."])
def test_unwritable_output_is_refused_before_submitting(chain, tmp_path, node, where):
    observer, _ = chain
    a, b = _operands(tmp_path, np.ones((3, 2), np.float32), np.ones((2, 4), np.float32))
    jobs = observer.job_count()
    balance = observer.balance_of(dev_account(SUBMITTER).address)
    line = _one_error_line(_cli("submit", a, b, "-o", tmp_path / where, "--rpc-url", node.url,
                                *keystore_options(tmp_path, SUBMITTER)))
    assert "does not exist" in line or "is a directory" in line
    assert observer.job_count() == jobs
    assert observer.balance_of(dev_account(SUBMITTER).address) == balance


def test_result_is_written_to_exactly_the_given_name(chain, tmp_path, node):
    observer, worker = chain
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((5, 3), np.float32), rng.standard_normal((3, 4), np.float32)
    a_path, b_path = _operands(tmp_path, a, b)
    out = tmp_path / "outnoext"
    jobs = observer.job_count()
    alive, join = _in_thread(lambda: _cli("submit", a_path, b_path, "-o", out, "--rpc-url",
                                          node.url, *keystore_options(tmp_path, SUBMITTER)))
    job_id = _wait_for_job(observer, jobs, alive)
    worker.send(worker.market.functions.claimJob(job_id))
    _deliver(worker, job_id, a @ b)
    result = join()
    assert result.exit_code == 0, result.output
    assert f"wrote {out} " in result.output and not (tmp_path / "outnoext.npy").exists()
    np.testing.assert_allclose(np.load(out), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


# -- timeout, Ctrl-C, cancel, fetch (bug 2) --------------------------------------------


def test_timeout_cancels_an_open_job_and_refunds_the_fee(chain, tmp_path, node):
    observer, _ = chain
    a, b = _operands(tmp_path, np.ones((3, 2), np.float32), np.ones((2, 4), np.float32))
    submitter = dev_account(SUBMITTER).address
    jobs, balance = observer.job_count(), observer.balance_of(submitter)
    line = _one_error_line(_cli("submit", a, b, "-o", tmp_path / "c.npy", "--timeout", "2",
                                "--rpc-url", node.url, *keystore_options(tmp_path, SUBMITTER)))
    assert f"[job {jobs}, stage submitted] timed out after 2s" in line
    assert f"job {jobs} cancelled, its 0.001 ETH fee refunded" in line
    assert observer.job(jobs).status == JOB_CANCELLED
    gas = _gas_paid(observer, "JobSubmitted", jobs) + _gas_paid(observer, "JobCancelled", jobs)
    assert observer.balance_of(submitter) == balance - gas  # the fee came back


def test_timeout_after_a_claim_names_the_job_and_fetch_gets_its_result(chain, tmp_path, node):
    observer, worker = chain
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((4, 6), np.float32), rng.standard_normal((6, 2), np.float32)
    a_path, b_path = _operands(tmp_path, a, b)
    jobs = observer.job_count()
    alive, join = _in_thread(lambda: _cli(
        "submit", a_path, b_path, "-o", tmp_path / "c.npy", "--timeout", "8", "--rpc-url",
        node.url, *keystore_options(tmp_path, SUBMITTER)))
    job_id = _wait_for_job(observer, jobs, alive)
    worker.send(worker.market.functions.claimJob(job_id))
    line = _one_error_line(join())
    assert f"job {job_id} was taken by a worker and cannot be cancelled now" in line
    assert f"needle-net fetch {job_id} -o {tmp_path / 'c.npy'}`" in line  # the user's -o
    assert observer.job(job_id).status == JOB_CLAIMED

    not_yet = _one_error_line(_cli("fetch", job_id, "-o", tmp_path / "c.npy", "--rpc-url",
                                   node.url))
    assert f"job {job_id} is claimed: only a done job" in not_yet
    _deliver(worker, job_id, a @ b)
    fetched = _cli("fetch", job_id, "-o", tmp_path / "c.npy", "--rpc-url", node.url)
    assert fetched.exit_code == 0, fetched.output
    np.testing.assert_allclose(np.load(tmp_path / "c.npy"), a.astype(np.float64) @ b,
                               rtol=1e-5, atol=1e-5)


def test_ctrl_c_cancels_the_open_job(chain, tmp_path, node):
    observer, _ = chain
    a, b = _operands(tmp_path, np.ones((3, 2), np.float32), np.ones((2, 4), np.float32))
    submitter = dev_account(SUBMITTER).address
    jobs, balance = observer.job_count(), observer.balance_of(submitter)
    cli = subprocess.Popen(
        [sys.executable, "-m", "node", "submit", str(a), str(b), "-o", str(tmp_path / "c.npy"),
         "--timeout", "300", "--rpc-url", node.url, *keystore_options(tmp_path, SUBMITTER)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        job_id = _wait_for_job(observer, jobs, lambda: cli.poll() is None)
        cli.send_signal(signal.SIGINT)
        output, _ = cli.communicate(timeout=60)
    finally:
        cli.kill()
    assert cli.returncode == 130, output
    assert f"error: interrupted: job {job_id} cancelled, its 0.001 ETH fee refunded" in output
    assert "Traceback" not in output
    assert observer.job(job_id).status == JOB_CANCELLED
    gas = _gas_paid(observer, "JobSubmitted", job_id) + _gas_paid(observer, "JobCancelled",
                                                                  job_id)
    assert observer.balance_of(submitter) == balance - gas


def test_cancel_refunds_only_the_submitters_open_job(chain, tmp_path, node):
    observer, worker = chain
    client = JobClient(node.url, dev_account(SUBMITTER), fee_wei=FEE)
    [mine, taken] = client.submit([(np.ones((2, 2), np.float32),) * 2] * 2)
    client.close()
    worker.send(worker.market.functions.claimJob(taken.job_id))
    submitter = dev_account(SUBMITTER).address
    as_submitter = ["--rpc-url", node.url, *keystore_options(tmp_path, SUBMITTER)]

    stranger = _one_error_line(_cli("cancel", mine.job_id, "--rpc-url", node.url,
                                    *keystore_options(tmp_path, STRANGER)))
    assert f"job {mine.job_id} was submitted by {submitter}" in stranger
    claimed = _one_error_line(_cli("cancel", taken.job_id, *as_submitter))
    assert f"job {taken.job_id} is claimed: only an open job can be cancelled" in claimed
    missing = _one_error_line(_cli("cancel", observer.job_count(), *as_submitter))
    assert "no job" in missing

    balance = observer.balance_of(submitter)
    done = _cli("cancel", mine.job_id, *as_submitter)
    assert done.exit_code == 0 and f"cancelled job {mine.job_id}: 0.001 ETH" in done.output
    assert observer.job(mine.job_id).status == JOB_CANCELLED
    assert observer.balance_of(submitter) == \
        balance + FEE - _gas_paid(observer, "JobCancelled", mine.job_id)
    again = _one_error_line(_cli("cancel", mine.job_id, *as_submitter))
    assert "is cancelled: only an open job can be cancelled" in again


# -- operands out of the verifier's range, blob limit (bugs 3, 4) ------------------------


def test_exact_operands_beyond_the_verifiers_bound_are_refused_before_the_chain(
        chain, tmp_path, node):
    observer, _ = chain
    big = np.full((3, 3), 2**62, np.int64)
    a, b = _operands(tmp_path, big, big)
    jobs = observer.job_count()
    balance = observer.balance_of(dev_account(SUBMITTER).address)
    line = _one_error_line(_cli("submit", a, b, "-o", tmp_path / "c.npy", "--rpc-url",
                                node.url, *keystore_options(tmp_path, SUBMITTER)))
    assert "[stage validate]" in line and "k * max|A| * max|B| = " in line
    assert observer.job_count() == jobs
    assert observer.balance_of(dev_account(SUBMITTER).address) == balance


@pytest.mark.parametrize("scale", [2**29, 2**30])
def test_exact_bound_matches_the_verifier(scale):
    """k * max|A| * max|B| at 2^60 is checkable, at 2^61 not: the client refuses exactly
    what `verifier.verify` cannot check."""
    from verifier import verify

    a = np.full((2, 2), scale, np.int64)
    b = np.full((2, 2), 2**29, np.int64)
    try:
        verify(a, b, a @ b, precision="exact")
    except ValueError:
        with pytest.raises(ValueError, match="exact job out of range"):
            validate_operands(a, b, 1 << 20)
    else:
        assert validate_operands(a, b, 1 << 20) == (1, 2, 2, 2)


def test_operand_over_the_nodes_blob_limit_is_refused_before_upload(chain, node):
    observer, _ = chain
    client = JobClient(node.url, dev_account(SUBMITTER), fee_wei=FEE)
    a = np.zeros((264 * 1024, 256), np.float32)  # 264 MiB, never touched: pages stay unmapped
    jobs = observer.job_count()
    with pytest.raises(RemoteJobError, match="over the node's 268435456-byte") as err:
        client.matmul(a, np.zeros((256, 2), np.float32))
    client.close()
    assert err.value.stage == "validate" and "264.0 MiB" in str(err.value)
    assert observer.job_count() == jobs


def test_the_client_takes_the_blob_limit_the_node_advertises(tmp_path):
    """A node started with --max-blob-mb 1: its /info says so, and the client refuses a
    2 MiB operand at validation instead of uploading it into a 413."""
    from chain.launch import NodeProcess

    with NodeProcess(tmp_path / "data", block_time=0, extra_args=("--max-blob-mb", "1")) as small:
        client = JobClient(small.url, dev_account(SUBMITTER), fee_wei=FEE)
        assert client.market.max_blob_bytes == 1 << 20
        with pytest.raises(RemoteJobError, match="over the node's 1048576-byte") as err:
            client.matmul(np.zeros((1024, 512), np.float32), np.zeros((512, 2), np.float32))
        with pytest.raises(RemoteJobError, match="C is a blob of 2097176 bytes"):
            client.matmul(np.zeros((1024, 2), np.int32), np.zeros((2, 256), np.int32))
        client.close()
        assert err.value.stage == "validate"


# -- unreachable nodes, keystores, amounts, reverts (bug 5) ------------------------------


@pytest.mark.parametrize("url,message", [
    ("unreachable", "cannot reach the chain node at http://127.0.0.1:"),
    ("notaurl", "not a chain node URL"),
    ("ftp://x", "not a chain node URL"),
])
@pytest.mark.parametrize("command", [
    ["submit", "A", "B", "-o", "OUT"], ["jobs"], ["balance"], ["stake", "1"], ["withdraw"],
    ["send", dev_account(1).address, "1", "--yes"], ["cancel", "0"], ["fetch", "0", "-o", "OUT"],
], ids=lambda c: c[0])
def test_unreachable_or_malformed_node_url_is_one_error_line(tmp_path, command, url, message):
    a, b = _operands(tmp_path, np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
    paths = {"A": a, "B": b, "OUT": tmp_path / "c.npy"}
    args = [paths.get(arg, arg) for arg in command]
    if url == "unreachable":  # a port picked at run time: collection must not vary (xdist)
        url = f"http://127.0.0.1:{free_port()}"
    assert message in _one_error_line(_cli(*args, "--rpc-url", url))


def test_chain_info_on_an_unreachable_node_is_one_error_line():
    line = _one_error_line(_cli("chain", "info", "--url", f"http://127.0.0.1:{free_port()}"))
    assert "cannot reach the chain node" in line


@pytest.mark.parametrize("content,message", [
    (json.dumps({"foo": 1}), "not an encrypted keystore (Web3 secret storage v3)"),
    ("[1, 2]", "a JSON object was expected, found list"),
    ("0x" + "ab" * 32, "not a keystore JSON file"),
    (b"\x89PNG\r\n\x1a\n\xff\xfe", "not a keystore JSON file"),
    (None, "wrong password"),
    ("missing", "no keystore password"),
])
def test_keystore_problems_are_one_error_line(node, tmp_path, monkeypatch, content, message):
    monkeypatch.delenv(keys.PASSWORD_ENV, raising=False)
    options = keystore_options(tmp_path, STRANGER)
    if content == "missing":
        options = options[:2]
    elif content is None:
        (tmp_path / f"pw{STRANGER}").write_text("not the password")
    else:
        path = tmp_path / f"key{STRANGER}.json"
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    assert message in _one_error_line(_cli("withdraw", "--rpc-url", node.url, *options))


def test_keys_new_without_or_with_an_empty_password_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(keys.PASSWORD_ENV, raising=False)
    path = tmp_path / "k.json"
    assert "no keystore password" in _one_error_line(_cli("keys", "new", path))
    (tmp_path / "empty").write_text("\n")
    line = _one_error_line(_cli("keys", "new", path, "--password-file", tmp_path / "empty"))
    assert "empty password" in line and not path.exists()


@pytest.mark.parametrize("command,message", [
    (["send", dev_account(1).address, "nan", "--yes"], "amount must be positive"),
    (["send", dev_account(1).address, "inf", "--yes"], "amount must be positive"),
    (["stake", "nan"], "amount must be positive"),
    (["stake", "--", "-1"], "amount must be positive"),
    (["balance", "0x1234"], "'0x1234' is not an address"),
    (["submit", "A", "B", "-o", "OUT", "--fee", "nan"], "--fee must be zero or more"),
    (["stake", "1e9"], "insufficient funds: "),
    (["stake", "0.5"], "a stake of 0.5 ETH is below the minimum of 1 ETH"),
])
def test_bad_amounts_and_addresses_spend_nothing(chain, tmp_path, node, command, message):
    observer, _ = chain
    a, b = _operands(tmp_path, np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
    paths = {"A": a, "B": b, "OUT": tmp_path / "c.npy"}
    address = dev_account(STRANGER).address
    balance, nonce = observer.balance_of(address), observer.w3.eth.get_transaction_count(address)
    options = ["--rpc-url", node.url, *keystore_options(tmp_path, STRANGER)]
    args = [paths.get(arg, arg) for arg in command]
    at = args.index("--") if "--" in args else len(args)  # options before the end of options
    assert message in _one_error_line(_cli(*args[:at], *options, *args[at:]))
    assert observer.balance_of(address) == balance
    assert observer.w3.eth.get_transaction_count(address) == nonce


@pytest.mark.parametrize("command,reason", [
    (["withdraw"], "no stake"),
])
def test_a_revert_prints_the_contracts_reason_alone(chain, tmp_path, node, command, reason):
    observer, _ = chain
    address = dev_account(STRANGER).address
    nonce = observer.w3.eth.get_transaction_count(address)
    line = _one_error_line(_cli(*command, "--rpc-url", node.url,
                                *keystore_options(tmp_path, STRANGER)))
    assert line == f"error: {reason}"
    assert observer.w3.eth.get_transaction_count(address) == nonce


def test_validation_errors_show_the_job_stage_and_a_single_space(chain, tmp_path, node):
    a, b = _operands(tmp_path, np.ones((3, 2), np.float32), np.ones((3, 2), np.float32))
    line = _one_error_line(_cli("submit", a, b, "-o", tmp_path / "c.npy", "--rpc-url",
                                node.url))
    assert line.startswith("error: [stage validate] pair 0: shape mismatch")


# -- messages (bug 6) --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint8, np.uint64, np.bool_])
def test_unsupported_dtypes_name_the_accepted_ones(tmp_path, node, dtype):
    a, b = _operands(tmp_path, np.ones((2, 2), dtype), np.ones((2, 2), dtype))
    line = _one_error_line(_cli("submit", a, b, "-o", tmp_path / "c.npy", "--rpc-url",
                                node.url))
    assert f"unsupported dtype {np.dtype(dtype)}: use float32 for float jobs, or int8, int16, " \
           "int32 or int64 for exact jobs" in line


def test_big_endian_operands_are_submitted_in_native_order(chain, node):
    observer, _ = chain
    rng = np.random.default_rng(3)
    a = rng.standard_normal((3, 4)).astype(">f4")
    b = rng.standard_normal((4, 2)).astype(np.float32)  # mixed with a native one
    client = JobClient(node.url, dev_account(SUBMITTER), fee_wei=FEE)
    [pending] = client.submit([(a, b)])
    job = observer.job(pending.job_id)
    np.testing.assert_array_equal(observer.get_array(job.a_id), a.astype(np.float32))
    np.testing.assert_array_equal(observer.get_array(job.b_id), b)
    assert client.abandon([pending]) == f"job {pending.job_id} cancelled, its 0.001 ETH fee " \
                                        "refunded"
    client.close()


def test_a_text_file_operand_is_named_as_not_npy(tmp_path, node):
    (tmp_path / "a.txt").write_text("1 2\n3 4\n")
    np.save(tmp_path / "b.npy", np.ones((2, 2), np.float32))
    line = _one_error_line(_cli("submit", tmp_path / "a.txt", tmp_path / "b.npy", "-o",
                                tmp_path / "c.npy", "--rpc-url", node.url))
    assert line == f"error: {tmp_path / 'a.txt'} is not a .npy array file (numpy.save writes one)"


def test_keys_show_on_a_binary_file(tmp_path):
    (tmp_path / "k.bin").write_bytes(bytes(range(256)))
    line = _one_error_line(_cli("keys", "show", tmp_path / "k.bin"))
    assert line == f"error: {tmp_path / 'k.bin'} is not a keystore JSON file"


@pytest.mark.parametrize("command,option", [
    (["worker", "up", "--max-in-flight", "0"], "--max-in-flight"),
    (["jobs", "--limit", "-5"], "--limit"),
])
def test_out_of_range_options_are_usage_errors(tmp_path, command, option):
    result = _cli(*command, "--rpc-url", f"http://127.0.0.1:{free_port()}")
    assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output


@pytest.mark.parametrize("timeout", ["nan", "inf", "-1", "0"])
def test_submit_refuses_a_timeout_that_never_or_always_expires(tmp_path, timeout):
    a, b = _operands(tmp_path, np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
    line = _one_error_line(_cli("submit", a, b, "-o", tmp_path / "c.npy", "--timeout", timeout,
                                "--rpc-url", f"http://127.0.0.1:{free_port()}"))
    assert line.startswith("error: --timeout must be a positive number of seconds")
