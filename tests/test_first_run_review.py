"""A new user's first run, from a review: `needle-net demo` stopped by SIGTERM or Ctrl-C
stops its chain node and workers and removes its temporary data dir; without scikit-learn
it stops before starting anything; `devnet up` interrupted while starting says so and
stops what it started; a data dir that cannot be created is one error line
from `devnet up` and `demo`; scripts/install.sh says
when there is no C++ compiler before it makes anything, and recreates a venv left without
pip instead of failing with "No module named pip"."""
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parent.parent
INSTALL = ROOT / "scripts" / "install.sh"


def _children(pid: int) -> list[int]:
    """The pids whose parent is `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie waiting to be reaped."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _wait_for_line(lines: queue.Queue, text: str, timeout: float) -> list[str]:
    seen = []
    while True:
        line = lines.get(timeout=timeout)  # queue.Empty: bounded
        if line is None:
            raise AssertionError(f"exited before printing {text!r}:\n{''.join(seen)}")
        seen.append(line)
        if text in line:
            return seen


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_demo_stopped_mid_run_stops_its_processes_and_removes_its_temp_dir(tmp_path, sig):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    demo = subprocess.Popen([sys.executable, "-m", "node", "demo", "--workers", "1"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(demo.stdout, lines), daemon=True).start()
    children: list[int] = []
    try:
        _wait_for_line(lines, "chain at http://", 180)  # the devnet is up, the job starts
        children = _children(demo.pid)
        assert len(children) == 2  # the chain node and the worker
        demo.send_signal(sig)
        demo.wait(timeout=120)
        rest = []
        while (line := lines.get(timeout=30)) is not None:
            rest.append(line)
        output = "".join(rest)
        assert "stopping the chain node and workers" in output, output
        assert "Traceback" not in output, output
        assert demo.returncode != 0
        assert [pid for pid in children if _running(pid)] == []
        assert list(tmp.iterdir()) == []  # keystores, password and chain state removed
    finally:
        for pid in [demo.pid, *children]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        demo.wait(timeout=30)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_devnet_up_interrupted_while_starting_says_so_and_stops_what_started(tmp_path):
    """Ctrl-C once the chain node runs but before the workers are up: the message comes
    before the shutdown (it was typer's bare "Aborted!" after it), and nothing is left."""
    devnet = subprocess.Popen([sys.executable, "-m", "node", "devnet", "up", "--port", "0",
                               "--workers", "2", "--data-dir", str(tmp_path / "devnet")],
                              cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children: list[int] = []
    try:
        log = tmp_path / "devnet" / "chain.log"
        for _ in range(600):  # the chain node has started logging: workers come next
            if log.exists() and log.stat().st_size > 0 or devnet.poll() is not None:
                break
            threading.Event().wait(0.1)
        children = _children(devnet.pid)
        assert children, "no chain node started"
        devnet.send_signal(signal.SIGINT)
        output, _ = devnet.communicate(timeout=120)
        assert "stopping the chain node and workers" in output, output
        assert "Traceback" not in output, output
        assert [pid for pid in children + _children(devnet.pid) if _running(pid)] == []
    finally:
        for pid in [devnet.pid, *children]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        devnet.wait(timeout=30)


@pytest.mark.parametrize("command", [["devnet", "up", "--port", "0"], ["demo"]], ids=" ".join)
def test_a_data_dir_that_cannot_be_created_is_one_error_line(tmp_path, command):
    (tmp_path / "a-file").write_text("not a directory")
    data_dir = tmp_path / "a-file" / "devnet"
    result = subprocess.run([sys.executable, "-m", "node", *command, "--data-dir",
                             str(data_dir)], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "COLUMNS": "300"})
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 1, result.stdout + result.stderr
    assert lines[-1] == f"error: cannot use data dir {data_dir}: Not a directory", lines
    assert "Traceback" not in result.stdout + result.stderr


def test_demo_without_scikit_learn_says_so_before_starting_anything(tmp_path):
    hidden = tmp_path / "hide"  # an environment where scikit-learn cannot be imported
    (hidden / "sklearn").mkdir(parents=True)
    (hidden / "sklearn" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'sklearn'\")\n")
    env = {**os.environ, "PYTHONPATH": str(hidden), "COLUMNS": "300"}
    result = subprocess.run([sys.executable, "-m", "node", "demo", "--data-dir",
                             str(tmp_path / "demo")], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=env)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 1, output
    assert output.splitlines() == ["error: the demo's training step needs scikit-learn (pip "
                                   "install scikit-learn): No module named 'sklearn'"]
    assert not (tmp_path / "demo").exists()


def _install(venv: Path, path: str) -> subprocess.CompletedProcess:
    """scripts/install.sh with pip kept off the network (no index: nothing is installed)."""
    env = {**os.environ, "PATH": path, "CXX": "", "NEEDLE_VENV": str(venv),
           "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull,
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run(["/bin/bash", str(INSTALL)], env=env, capture_output=True, text=True,
                          timeout=240)


def test_install_without_a_cxx_compiler_says_so_before_making_anything(tmp_path):
    bin_dir = tmp_path / "bin"  # a PATH with the tools the script runs, but no compiler
    bin_dir.mkdir()
    for tool in ("dirname", "python3"):
        (bin_dir / tool).symlink_to(sys.executable if tool == "python3" else f"/usr/bin/{tool}")
    result = _install(tmp_path / "venv", str(bin_dir))
    assert result.returncode == 1
    assert result.stderr.startswith("error: no C++ compiler found"), result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "venv").exists()


def test_install_recreates_a_venv_left_without_pip(tmp_path):
    venv = tmp_path / "venv"
    python3 = subprocess.run(["bash", "-c", "command -v python3"], capture_output=True,
                             text=True).stdout.strip()
    if not python3 or subprocess.run([python3, "-c", "import ensurepip"]).returncode:
        pytest.skip("no python3 with ensurepip")
    # what `python3 -m venv` leaves where ensurepip is missing (Debian without python3-venv)
    subprocess.run([python3, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    result = _install(venv, os.environ["PATH"])
    # pip runs now; without an index the build tools cannot be installed, and that is the
    # error this run ends with
    assert "No module named pip" not in result.stderr, result.stderr
    assert "== creating the virtual environment" in result.stdout
    assert subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--version"],
                          capture_output=True, timeout=60).returncode == 0
    assert result.returncode != 0 and "scikit-build-core" in result.stderr, result.stderr
