"""Build the CPU image and run docker-compose.yml under a real container engine: a private
dockerd (Debian's docker.io 20.10) and docker-compose 1.29, whose healthchecks and
`depends_on: service_healthy` really run. Chain + two worker replicas come up healthy,
the demo service's `needle-net submit` returns a C that matches A @ B computed here.

Opt-in (`NEEDLE_NET_CONTAINER_TEST=1`), root only. No registry is reachable here, so the
base image is made with debootstrap and Python packages come from a wheelhouse built on
the host (docs/deploy.md). The base image, the wheels and Docker's layer store are cached
under /var/tmp/needle-net-ci; containers, volumes, networks and the daemon are removed at
the end."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from node.devnet import free_port

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path("/var/tmp/needle-net-ci")
MIRROR = "http://deb.debian.org/debian"
BASE_TAG = "needle-net-base:bookworm"
IMAGE_TAG = "needle-net-ci:latest"
CONTEXT_FILES = ["pyproject.toml", "CMakeLists.txt", "README.md", "Dockerfile",
                 "Dockerfile.cuda", "docker-compose.yml", ".dockerignore", "csrc", "needle",
                 "verifier", "chain", "node", "deploy"]
STEP_TIMEOUT = 600

pytestmark = pytest.mark.skipif(os.environ.get("NEEDLE_NET_CONTAINER_TEST") != "1",
                                reason="container test is opt-in: NEEDLE_NET_CONTAINER_TEST=1")


def _run(*args: str, env: dict | None = None, timeout: float = STEP_TIMEOUT,
         **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, env=env, timeout=timeout, **kwargs)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({done.returncode}):\n"
                             f"{done.stdout.decode(errors='replace')[-3000:]}\n"
                             f"{done.stderr.decode(errors='replace')[-3000:]}")
    return done


def _tools() -> None:
    if all(shutil.which(t) for t in ("dockerd", "docker-compose", "debootstrap", "iptables")):
        return
    if shutil.which("apt-get") is None:
        pytest.skip("needs dockerd, docker-compose and debootstrap (no apt-get to install them)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for args in (["apt-get", "update", "-q"],
                 ["apt-get", "install", "-y", "-q", "--no-install-recommends", "docker.io",
                  "docker-compose", "debootstrap", "iptables"]):
        done = subprocess.run(args, capture_output=True, env=env, timeout=STEP_TIMEOUT)
        if done.returncode != 0:
            pytest.skip(f"cannot install the container engine: {done.stderr.decode()[-500:]}")


def _wheelhouse() -> Path:
    """Wheels of every dependency (and the build backend), made on the host once."""
    import tomllib  # Python >= 3.11

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requirements = sorted(project["project"]["dependencies"]
                          + project["build-system"]["requires"])
    wheels = CACHE / "wheels"
    stamp = wheels / "requirements.json"
    if not (stamp.exists() and json.loads(stamp.read_text()) == requirements):
        shutil.rmtree(wheels, ignore_errors=True)
        _run(sys.executable, "-m", "pip", "wheel", "-q", "-w", str(wheels), *requirements)
        stamp.write_text(json.dumps(requirements))
    return wheels


def _base_tarball() -> Path:
    """A Debian bookworm root file system with Python 3.11 (the host's Python)."""
    tarball = CACHE / "base-bookworm.tar"
    if not tarball.exists():
        rootfs = CACHE / "rootfs.tmp"
        shutil.rmtree(rootfs, ignore_errors=True)
        _run("debootstrap", "--variant=minbase",
             "--include=python3,python3-venv,python3-pip,ca-certificates", "bookworm",
             str(rootfs), MIRROR)
        _run("tar", "-C", str(rootfs), "-cf", f"{tarball}.tmp", ".")
        os.replace(f"{tarball}.tmp", tarball)
        shutil.rmtree(rootfs)
    return tarball


class Dockerd:
    """A private Docker daemon; its layer store persists in CACHE so rebuilds are cached."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.socket = run_dir / "docker.sock"
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.socket}"}
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.run_dir / "dockerd.log", "wb")  # noqa: SIM115 - lives as long as dockerd
        self.process = subprocess.Popen(
            ["dockerd", "--data-root", str(CACHE / "docker"), "--exec-root",
             str(self.run_dir / "exec"), "-H", f"unix://{self.socket}", "--pidfile",
             str(self.run_dir / "dockerd.pid")], stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        for _ in range(120):
            if self.process.poll() is not None:
                raise AssertionError((self.run_dir / "dockerd.log").read_text()[-3000:])
            info = subprocess.run(["docker", "info"], capture_output=True, env=self.env)
            if info.returncode == 0:
                return
            time.sleep(0.5)
        raise AssertionError("dockerd did not answer within 60 s")

    def docker(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return _run("docker", *args, env=self.env, **kwargs)

    def stop(self) -> None:
        """Stop the daemon, then remove the iptables rules and the bridge it leaves behind."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for table in ("filter", "nat"):
            rules = subprocess.run(["iptables-save", "-t", table], capture_output=True,
                                   text=True).stdout
            kept = "\n".join(line for line in rules.splitlines() if "DOCKER" not in line
                             and "docker0" not in line) + "\n"
            subprocess.run(["iptables-restore", "-T", table], input=kept, text=True,
                           capture_output=True)
        subprocess.run(["ip", "link", "del", "docker0"], capture_output=True)


def _context(directory: Path, wheels: Path) -> Path:
    """A snapshot of the sources the Dockerfile copies, with the wheelhouse in deploy/wheels."""
    for name in CONTEXT_FILES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, directory / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "wheels"))
        else:
            shutil.copy2(source, directory / name)
    shutil.copytree(wheels, directory / "deploy" / "wheels")
    return directory


def _healthy(engine: Dockerd, container: str) -> bool:
    state = engine.docker("inspect", "--format", "{{json .State}}", container).stdout
    return json.loads(state).get("Health", {}).get("Status") == "healthy"


@pytest.mark.timeout(1800)
def test_image_builds_and_compose_runs_a_verified_job(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root: dockerd, debootstrap and iptables")
    _tools()
    CACHE.mkdir(parents=True, exist_ok=True)
    timings = {}
    started = time.perf_counter()
    wheels = _wheelhouse()
    timings["wheelhouse"] = time.perf_counter() - started
    base = _base_tarball()
    timings["base image"] = time.perf_counter() - started - sum(timings.values())

    run_dir = Path(f"/tmp/nnci{os.getpid()}")  # short: dockerd's socket paths have a limit
    run_dir.mkdir()
    engine = Dockerd(run_dir)
    chain_port = free_port()
    project = f"nnci{os.getpid()}"
    context = _context(tmp_path_factory.mktemp("context"), wheels)
    env = {**engine.env, "COMPOSE_PROJECT_NAME": project, "NEEDLE_NET_IMAGE": IMAGE_TAG,
           "NEEDLE_NET_BASE_IMAGE": BASE_TAG, "NEEDLE_NET_PIP_NO_INDEX": "1",
           "NEEDLE_NET_PASSWORD": "container-test", "NEEDLE_NET_DEV_FAUCET": "1",
           "NEEDLE_NET_CHAIN_PORT": str(chain_port), "NEEDLE_NET_BLOCK_TIME": "0.5"}
    compose = ["docker-compose", "--project-directory", str(context), "-f",
               str(context / "docker-compose.yml")]
    try:
        engine.start()
        if BASE_TAG not in engine.docker("images", "--format", "{{.Repository}}:{{.Tag}}"
                                         ).stdout.decode():
            engine.docker("import", str(base), BASE_TAG)
        mark = time.perf_counter()
        _run(*compose, "build", "--force-rm", "chain", env=env)
        timings["image build"] = time.perf_counter() - mark

        mark = time.perf_counter()
        _run(*compose, "up", "-d", "--scale", "worker=2", env=env)
        workers = _run(*compose, "ps", "-q", "worker", env=env).stdout.decode().split()
        assert len(workers) == 2
        end = time.time() + 300
        while not all(_healthy(engine, w) for w in workers):
            assert time.time() < end, _run(*compose, "logs", env=env).stdout.decode()[-4000:]
            time.sleep(2)
        timings["compose up (healthy)"] = time.perf_counter() - mark

        info = httpx.get(f"http://127.0.0.1:{chain_port}/info", timeout=10).json()
        assert info["chain_id"] == 1414
        addresses = set()
        for worker in workers:
            port = engine.docker("port", worker, "8600").stdout.decode().split(":")[-1].strip()
            status = httpx.get(f"http://127.0.0.1:{port}/status", timeout=10).json()
            assert status["stake_wei"] > 0
            addresses.add(status["address"])
        assert len(addresses) == 2  # one key per replica

        mark = time.perf_counter()
        _run(*compose, "--profile", "demo", "run", "--rm", "demo", env=env)
        timings["demo job"] = time.perf_counter() - mark
        files = _run(*compose, "--profile", "demo", "run", "--rm", "-T", "demo", "tar", "-c",
                     "-C", "/", "opt/needle-net/demo", "var/lib/needle-net/demo",
                     env=env).stdout
        with tarfile.open(fileobj=io.BytesIO(files)) as tar:
            load = {Path(m.name).name: np.load(io.BytesIO(tar.extractfile(m).read()))
                    for m in tar.getmembers() if m.isfile()}
        np.testing.assert_allclose(load["c.npy"], load["a.npy"].astype(np.float64) @ load["b.npy"],
                                   rtol=1e-4, atol=1e-4)
    finally:
        subprocess.run([*compose, "--profile", "demo", "down", "-v", "--remove-orphans",
                        "--timeout", "20"], capture_output=True, env=env, timeout=300)
        subprocess.run(["docker", "image", "prune", "-f"], capture_output=True, env=env,
                       timeout=300)  # superseded builds; the cache behind the tag stays
        engine.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        timings["total"] = time.perf_counter() - started
        print("container test timings (s):", {k: round(v, 1) for k, v in timings.items()})
