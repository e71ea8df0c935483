"""`chain` CLI start-up refusals, run as the real command next to a real node: a taken port
or data dir, a directory that holds no chain, out-of-range options. Each ends at once with
a short error (no traceback) and a non-zero exit, and creates nothing; the running node
goes on serving its chain."""
import subprocess
import sys

import httpx
import pytest

from chain.launch import free_port

pytestmark = pytest.mark.timeout(300)
COMMAND_TIMEOUT = 60  # a refusal is immediate; a node that starts instead fails the test


def chain(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "chain", *args], capture_output=True,
                              text=True, timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"`chain {' '.join(args)}` did not refuse: it ran on ({exc.stdout!r})")


def assert_refused(result: subprocess.CompletedProcess, *words: str, code: int = 1) -> None:
    assert result.returncode == code, result
    assert "Traceback" not in result.stderr, result.stderr
    assert all(word in result.stderr for word in words), result.stderr


def head(node) -> int:
    return httpx.get(f"{node.url}/info", timeout=10).json()["head"]


def test_a_taken_port_is_refused_before_anything_is_created(node, tmp_path):
    fresh = tmp_path / "fresh"
    result = chain("up", "--data-dir", str(fresh), "--port", str(node.port))
    assert_refused(result, "error: port", f"{node.port} is in use")
    result = chain("up", "--data-dir", str(fresh), "--port", str(free_port()),
                   "--blob-port", str(node.port))
    assert_refused(result, "error: blob port", f"{node.port} is in use")
    assert not fresh.exists()
    assert result.stdout == ""  # nothing opened: no head printed


def test_a_data_dir_in_use_is_refused_naming_its_node(node):
    before = head(node)
    result = chain("up", "--data-dir", str(node.data_dir), "--port", "0", "--blob-port", "0")
    assert_refused(result, f"data dir {node.data_dir} is in use",
                   f"pid {node.proc.pid}")
    assert result.stdout == ""
    assert head(node) == before  # no other producer sealed into its database
    assert node.proc.poll() is None


def test_verify_refuses_what_is_not_a_chain_data_dir(tmp_path):
    assert_refused(chain("verify", "--data-dir", str(tmp_path / "nosuchdir")),
                   "error:", "nosuchdir is not a chain data dir")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_refused(chain("verify", "--data-dir", str(empty)), "is not a chain data dir")
    assert list(empty.iterdir()) == []


def test_up_refuses_a_regular_file_as_data_dir(tmp_path):
    regular = tmp_path / "file"
    regular.write_text("not a directory")
    result = chain("up", "--data-dir", str(regular), "--port", "0", "--blob-port", "0")
    assert_refused(result, f"error: data dir {regular} is not a directory")
    assert regular.read_text() == "not a directory"


@pytest.mark.parametrize("args", [
    pytest.param(("up", "--port", "99999"), id="port-above-65535"),
    pytest.param(("up", "--port", "-1"), id="negative-port"),
    pytest.param(("up", "--port", "0", "--blob-port", "70000"), id="blob-port-above-65535"),
    pytest.param(("up", "--port", "0", "--max-blob-mb", "-1"), id="negative-max-blob"),
    pytest.param(("up", "--port", "0", "--block-time", "-1"), id="negative-block-time"),
    pytest.param(("up", "--port", "0", "--block-time", "inf"), id="infinite-block-time"),
    pytest.param(("up", "--port", "0", "--block-time", "nan"), id="nan-block-time"),
    pytest.param(("accounts", "--count", "-1"), id="negative-account-count"),
])
def test_out_of_range_options_are_usage_errors(tmp_path, args):
    data_dir = tmp_path / "data"
    extra = ("--data-dir", str(data_dir)) if args[0] == "up" else ()
    result = chain(*args, *extra)
    option = next(arg for arg in reversed(args) if arg.startswith("--"))
    assert_refused(result, f"Invalid value for '{option}'", code=2)
    assert not data_dir.exists()
