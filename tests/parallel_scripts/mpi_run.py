"""Launch a script of this folder on N MPI ranks, bounded in time, for the parallel tests."""
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

from needle.parallel import find_launcher

SCRIPTS = Path(__file__).resolve().parent
# the ranks run under `python -m mpi4py`: a launcher without mpi4py is none
LAUNCHER = find_launcher() if importlib.util.find_spec("mpi4py") else None
TIMEOUT_S = 90


def launch(script, *args, nprocs: int = 2, cwd=None) -> tuple[int, str]:
    """(exit code, output) of `script` on `nprocs` ranks through needle's launcher CLI; an
    AssertionError with its output if it still runs after TIMEOUT_S (the whole process group
    is killed then)."""
    cmd = [sys.executable, "-m", "needle.parallel.launch", "-n", str(nprocs), str(script)]
    cmd += [str(a) for a in args]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{script} did not finish in {TIMEOUT_S} s:\n{output}") from None
    return proc.returncode, output


def run_mpi(script: str, *args, nprocs: int = 2) -> None:
    """Run a script of this folder on `nprocs` ranks; fail with its output if it errors or
    hangs."""
    code, output = launch(SCRIPTS / script, *args, nprocs=nprocs, cwd=SCRIPTS)
    if code != 0:
        raise AssertionError(f"{script} exited with {code}:\n{output}")
