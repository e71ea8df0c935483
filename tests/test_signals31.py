"""Stopping long work from outside: SIGTERM to needle's MPI launcher ends the ranks too (they
trained on, re-parented, after the launcher had gone), Ctrl-C on it leaves no traceback of
the launcher's wait, and Ctrl-C during `python -m needle.train` is one 'interrupted' line."""
import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest
from parallel_scripts.mpi_run import SCRIPTS

from needle.parallel import find_launcher

pytestmark = pytest.mark.timeout(180)
needs_mpi = pytest.mark.skipif(
    find_launcher() is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs mpi4py and an MPI launcher")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has ended
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait(condition, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def _start_ranks(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "needle.parallel.launch", "-n", "2", str(SCRIPTS / "review31.py"),
         str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    pids = [tmp_path / f"pid{rank}" for rank in range(2)]
    assert _wait(lambda: all(p.exists() for p in pids), 60), "the ranks did not start"
    return proc, [int(p.read_text()) for p in pids]


@needs_mpi
def test_sigterm_to_the_launcher_ends_the_ranks(tmp_path):
    proc, ranks = _start_ranks(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        assert proc.returncode != 0
        assert _wait(lambda: not any(_alive(pid) for pid in ranks), 20), "ranks train on"
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@needs_mpi
def test_ctrl_c_on_the_launcher_leaves_no_traceback(tmp_path):
    proc, ranks = _start_ranks(tmp_path)
    try:
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        output, _ = proc.communicate(timeout=30)
        assert "Traceback" not in output, output
        assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_ctrl_c_during_training_is_one_line(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "needle.train", "--model", "mlp", "--epochs", "1000",
         "--save", str(tmp_path / "ck.npz")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert _wait(lambda: (tmp_path / "ck.npz").exists(), 90), "no epoch finished"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.rstrip().endswith("needle.train: interrupted"), err


def test_a_key_error_is_not_shown_as_its_repr(tmp_path):
    first = subprocess.run([sys.executable, "-m", "needle.train", "--epochs", "1", "--save",
                            str(tmp_path / "r1.npz")], capture_output=True, text=True,
                           timeout=120)
    assert first.returncode == 0, first.stderr
    again = subprocess.run([sys.executable, "-m", "needle.train", "--optimizer", "sgd",
                            "--resume", str(tmp_path / "r1.npz")], capture_output=True,
                           text=True, timeout=120)
    last = again.stderr.strip().splitlines()[-1]
    assert again.returncode == 1 and last.startswith("needle.train: ") and "state" in last, \
        again.stderr
    assert not last.startswith('needle.train: "'), last
