"""Start a training script on N processes with the MPI launcher that ships with the venv.

    python -m needle.parallel.launch -n 2 train.py [script args...]

is `mpiexec -n 2 <this python> -m needle.parallel.rank train.py ...`, with the launcher
found next to the running interpreter (the `mpich` wheel installs it there) or on PATH, in
the environment `launch_env` gives. `needle.parallel.rank` aborts the whole job when a rank
dies of an exception or a non-zero exit, before its first Communicator too: without it the
other ranks wait in their next collective, or in MPI's start-up, forever.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping

LAUNCHER_NAMES = ("mpiexec", "mpirun")


def find_launcher() -> str | None:
    """Path of an MPI launcher: next to sys.executable first, then on PATH."""
    bindir = os.path.dirname(sys.executable)
    for name in LAUNCHER_NAMES:
        candidate = os.path.join(bindir, name)
        if os.access(candidate, os.X_OK):
            return candidate
    for name in LAUNCHER_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def launch_command(nprocs: int, script: str, args: list[str]) -> list[str]:
    """The argv that runs `script` on `nprocs` ranks."""
    if nprocs < 1:
        raise ValueError(f"number of processes must be at least 1, got {nprocs}")
    launcher = find_launcher()
    if launcher is None:
        raise FileNotFoundError("no MPI launcher (mpiexec/mpirun) next to python or on PATH")
    return [launcher, "-n", str(nprocs), sys.executable, "-m", "needle.parallel.rank", script,
            *args]


# What Open MPI's singleton (MPI initialised in a process not started by mpiexec) puts in its
# process's environment, whence its children inherit it: an mpiexec started with these
# takes itself for a rank of that singleton and exits 1 without a word (Open MPI 4.1)
SINGLETON_PREFIXES = ("PMIX_", "OMPI_MCA_orte_", "OMPI_MCA_ess", "OMPI_MCA_pmix",
                      "OMPI_APP_CTX_", "ORTE_SCHIZO_")

# Every rank runs on this host, so MPICH's transports need only the loopback interface, and
# Open MPI's only shared memory; left to themselves, UCX, libfabric's TCP providers and Open
# MPI's TCP transport listen on every interface (Open MPI's even when told to use lo), where any
# machine on the network could connect to the unauthenticated endpoints that carry the gradients
LOOPBACK_ONLY = {"UCX_NET_DEVICES": "lo", "FI_TCP_IFACE": "lo", "FI_SOCKETS_IFACE": "lo",
                 "OMPI_MCA_btl": "self,vader"}


def launch_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with what MPI needs here.

    MPICH's transports listen on the loopback interface only (`LOOPBACK_ONLY`). Open MPI
    refuses to start as root (containers, the GPU machines) and binds each rank to one core,
    which starves the CPU backend's OpenMP threads and NCCL's proxy thread; MPICH ignores
    these variables. Values already set are kept, except those an Open MPI singleton in a
    parent process left (a test run or notebook that used mpi4py).
    """
    env = dict(os.environ if base is None else base)
    if env.get("OMPI_MCA_ess") == "singleton":
        env = {key: value for key, value in env.items()
               if not key.startswith(SINGLETON_PREFIXES)}
    for key, value in LOOPBACK_ONLY.items():
        env.setdefault(key, value)
    env.setdefault("OMPI_MCA_hwloc_base_binding_policy", "none")
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m needle.parallel.launch",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--nprocs", type=int, default=2)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    opts = parser.parse_args(argv)
    if not os.path.isfile(opts.script):  # else every rank fails to open it, N times over
        parser.error(f"no script {opts.script}")
    try:
        command = launch_command(opts.nprocs, opts.script, opts.args)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    return run(command, launch_env())


def run(command: list[str], env: Mapping[str, str]) -> int:
    """Run the MPI launcher to its end and return its exit status (128 + N for signal N). A
    SIGTERM or SIGHUP to this process is passed on to it (it ends the ranks), so that
    stopping the launcher stops the job instead of leaving it to train on unseen. Ctrl-C
    reaches the launcher and the ranks from the terminal itself: wait for them to end (each
    further Ctrl-C stops the launcher harder), without a traceback of this wait."""
    proc = subprocess.Popen(command, env=env)

    def forward(signum: int, _frame) -> None:
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGHUP)}
    stops = iter((signal.SIGINT, signal.SIGTERM, signal.SIGKILL))  # Ctrl-C again: harder
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:
                proc.send_signal(next(stops, signal.SIGKILL))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
