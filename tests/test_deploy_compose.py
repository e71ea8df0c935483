"""docker-compose.yml checked without a container engine: every variable is documented in
.env.example, every service runs a valid `needle-net` command (parsed by the real CLI),
volumes, ports and healthchecks agree with those commands, and the services' exact
commands (entrypoint included) run as processes here: a chain node, two worker replicas
sharing one key volume, the healthchecks and the demo job."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import typer
import yaml
from typer._click.exceptions import UsageError  # typer 0.29 vendors click
from typer.core import TyperGroup

from node.cli import app as needle_net_app
from node.devnet import free_port

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
VENV_BIN = Path(sys.executable).parent
NEEDLE_NET = str(VENV_BIN / "needle-net")
ENTRYPOINT = "/opt/needle-net/deploy/worker-entrypoint.sh"
EXPECTED = {"chain": ("chain", "up"), "worker": ("worker", "up"),
            "gpu-worker": ("worker", "up"), "demo": ("submit",)}
START_TIMEOUT = 120.0

_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def env_example() -> dict[str, str]:
    lines = ENV_EXAMPLE.read_text().splitlines()
    pairs = [line.split("=", 1) for line in lines if line.strip() and not line.startswith("#")]
    return {key.strip(): value.strip() for key, value in pairs}


def interpolate(value, env: dict[str, str]):
    """Compose's variable substitution (${VAR}, ${VAR:-default}, ${VAR:?error}, $$)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        name, operator, word = match.groups()
        if name is None:
            return "$"
        present = env.get(name)
        if operator in (":-", ":?") and not present or operator in ("-", "?") and present is None:
            if operator.endswith("?"):
                raise KeyError(f"{name}: {word}")
            return word
        return present or ""

    return _VARIABLE.sub(substitute, value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), env_example())


def dry_run(args: list[str]) -> tuple[tuple[str, ...], dict]:
    """Parse `needle-net ARGS` with the real CLI without running it: (command path, params).
    Unknown options, missing arguments and badly typed values raise UsageError."""
    command = typer.main.get_command(needle_net_app)
    context = typer.Context(command, info_name="needle-net")
    path: list[str] = []
    while isinstance(command, TyperGroup):
        name, *args = args
        command = command.get_command(context, name)
        if command is None:
            raise UsageError(f"no command {' '.join([*path, name])!r}")
        path.append(name)
        context = typer.Context(command, info_name=name, parent=context)
    with command.make_context(path[-1], list(args), parent=context.parent) as leaf:
        return tuple(path), leaf.params


def service_args(service: dict) -> list[str]:
    """What the container runs; the worker entrypoint appends --data-dir <slot>."""
    args = list(service["command"])
    if service.get("entrypoint") == [ENTRYPOINT]:
        args += ["--data-dir", service["environment"]["NEEDLE_NET_WORKER_ROOT"] + "/worker0"]
    return args


def mounts(service: dict) -> dict[str, str]:
    """container path -> named volume."""
    return {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}


def port_mapping(service: dict) -> tuple[str, str, str]:
    """(host address, host port, container port) of the service's one published port."""
    (spec,) = service["ports"]
    host_ip, host_port, container_port = spec.rsplit(":", 2)
    return host_ip, host_port, container_port


def healthcheck_url(service: dict) -> str:
    (url,) = re.findall(r"http://[^'\"]+", " ".join(service["healthcheck"]["test"]))
    return url


def test_every_variable_is_documented_with_its_default():
    documented = env_example()
    used = _VARIABLE.findall(COMPOSE.read_text())
    assert used
    for name, operator, word in used:
        assert name in documented, f"{name} is used by docker-compose.yml, not in .env.example"
        if operator == ":-":
            assert documented[name] == word, f"{name}: .env.example and compose disagree"
    with pytest.raises(KeyError, match="NEEDLE_NET_PASSWORD"):
        interpolate(yaml.safe_load(COMPOSE.read_text()), {})


def test_every_service_runs_a_valid_needle_net_command(compose):
    assert set(compose["services"]) == set(EXPECTED)
    helped = set()
    for name, service in compose["services"].items():
        args = service_args(service)
        assert args[0] == "needle-net", name
        path, _ = dry_run(args[1:])
        assert path == EXPECTED[name], name
        if path in helped:  # the installed program too, once per command
            continue
        helped.add(path)
        shown = subprocess.run([NEEDLE_NET, *args[1:], "--help"], capture_output=True,
                               text=True, timeout=60)
        assert shown.returncode == 0, f"{name}: {shown.stdout}{shown.stderr}"
        assert "Usage:" in shown.stdout and " ".join(path) in shown.stdout, name
    # the dry run really rejects what the CLI rejects
    with pytest.raises(UsageError, match="no-such-option"):
        dry_run(["worker", "up", "--no-such-option"])
    with pytest.raises(typer.BadParameter):
        dry_run(["chain", "up", "--port", "eighty"])
    with pytest.raises(UsageError, match="no command"):
        dry_run(["wroker", "up"])


def test_volumes_ports_and_healthchecks_agree_with_the_commands(compose):
    services = compose["services"]
    used = {volume for s in services.values() for volume in mounts(s).values()}
    assert used == set(compose["volumes"])
    params = {name: dry_run(service_args(s)[1:])[1] for name, s in services.items()}

    def under_a_volume(service: dict, path: str) -> bool:
        return any(Path(path).is_relative_to(target) for target in mounts(service))

    chain = services["chain"]
    assert under_a_volume(chain, str(params["chain"]["data_dir"]))
    host_ip, host_port, container_port = port_mapping(chain)
    assert int(container_port) == params["chain"]["port"] and params["chain"]["host"] == "0.0.0.0"
    assert (host_ip, host_port) == ("127.0.0.1", "8545")  # private unless the operator opens it
    assert healthcheck_url(chain) == f"http://127.0.0.1:{params['chain']['port']}/info"

    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^COPY .*deploy/worker-entrypoint\.sh .*/opt/needle-net/deploy/$",
                     dockerfile, re.M)
    assert "demo_operands.py /opt/needle-net/demo" in dockerfile
    assert os.access(ROOT / "deploy" / "worker-entrypoint.sh", os.X_OK)
    for name in ("worker", "gpu-worker"):
        service, p = services[name], params[name]
        assert service["entrypoint"] == [ENTRYPOINT]
        assert mounts(service).get(service["environment"]["NEEDLE_NET_WORKER_ROOT"])
        assert under_a_volume(service, str(p["data_dir"]))
        host_ip, host_port, container_port = port_mapping(service)
        assert int(container_port) == p["api_port"] and p["api_host"] == "0.0.0.0"
        assert host_port == "", "a fixed host port would stop `--scale worker=N`"
        assert healthcheck_url(service) == f"http://127.0.0.1:{p['api_port']}/health"
        assert p["rpc_url"] == service["environment"]["NEEDLE_NET_RPC"] == "http://chain:8545"
        assert service["depends_on"]["chain"]["condition"] == "service_healthy"
        assert service["restart"] == "unless-stopped"
    assert chain["restart"] == "unless-stopped"

    gpu = services["gpu-worker"]
    assert gpu["profiles"] == ["gpu"] and (ROOT / gpu["build"]["dockerfile"]).exists()
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]

    demo, p = services["demo"], params["demo"]
    assert demo["profiles"] == ["demo"] and demo["restart"] == "no"
    assert under_a_volume(demo, str(p["output"]))
    assert p["rpc_url"] == "http://chain:8545"


# -- the same commands as processes ------------------------------------------------------


def _replace(args: list[str], replacements: dict[str, str]) -> list[str]:
    return [replacements.get(a, a) for a in args]


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _healthy(service: dict, port: int, default_port: int) -> bool:
    """Run the service's healthcheck command, pointed at `port` instead of its default."""
    _, executable, *args = service["healthcheck"]["test"]
    assert executable == "python"
    args = [a.replace(f":{default_port}/", f":{port}/") for a in args]
    return subprocess.run([sys.executable, *args], capture_output=True, timeout=30).returncode == 0


def _wait(check, what: str, process: subprocess.Popen, log: Path) -> None:
    end = time.time() + START_TIMEOUT
    while time.time() < end:
        if process.poll() is not None:
            raise AssertionError(f"{what} exited ({process.returncode}):\n{log.read_text()}")
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} not ready after {START_TIMEOUT:.0f}s:\n{log.read_text()}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compose_commands_run_a_network_without_containers(compose, tmp_path):
    services = compose["services"]
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    processes: list[subprocess.Popen] = []

    def spawn(args: list[str], log_name: str, extra_env: dict | None = None) -> subprocess.Popen:
        with open(tmp_path / log_name, "ab") as log:
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                       env={**env, **(extra_env or {})}, start_new_session=True)
        processes.append(process)
        return process

    try:
        chain_port = free_port()
        chain_args = _replace(service_args(services["chain"]), {
            "/var/lib/needle-net/chain": str(tmp_path / "chain"), "0.0.0.0": "127.0.0.1",
            "8545": str(chain_port)})
        rpc_url = f"http://127.0.0.1:{chain_port}"
        assert not _healthy(services["chain"], chain_port, 8545)  # nothing listens yet
        chain = spawn(chain_args, "chain.log")
        _wait(lambda: _healthy(services["chain"], chain_port, 8545), "chain", chain,
              tmp_path / "chain.log")

        worker_service = services["worker"]
        worker_env = {**worker_service["environment"], "NEEDLE_NET_RPC": rpc_url,
                      "NEEDLE_NET_DEV_FAUCET": "1", "NEEDLE_NET_PASSWORD": "compose-test",
                      "NEEDLE_NET_WORKER_ROOT": str(tmp_path / "workers")}
        entrypoint = str(ROOT / "deploy" / "worker-entrypoint.sh")

        api_ports: list[int] = []  # replicas 0 and 1 start together, 2 after a restart
        while len(api_ports) < 3:  # distinct: a port is free again until its replica binds it
            if (port := free_port()) not in api_ports:
                api_ports.append(port)

        def start_replica(index: int) -> tuple[subprocess.Popen, int]:
            api_port = api_ports[index]
            args = _replace(list(worker_service["command"]), {
                "http://chain:8545": rpc_url, "0.0.0.0": "127.0.0.1", "8600": str(api_port)})
            return spawn([entrypoint, *args], f"worker{index}.log", worker_env), api_port

        replicas = [start_replica(i) for i in range(2)]
        for i, (process, api_port) in enumerate(replicas):
            _wait(lambda p=api_port: _healthy(worker_service, p, 8600)
                  and httpx.get(f"http://127.0.0.1:{p}/status").json()["stake_wei"] > 0,
                  f"worker replica {i}", process, tmp_path / f"worker{i}.log")
        # one key per replica, each in its own slot of the shared volume
        slot_address = {
            slot: "0x" + json.loads((tmp_path / "workers" / slot / "key.json").read_text())[
                "address"].lower() for slot in ("worker0", "worker1")}
        running = {httpx.get(f"http://127.0.0.1:{p}/status").json()["address"].lower()
                   for _, p in replicas}
        assert running == set(slot_address.values()) and len(running) == 2

        demo_in, demo_out = tmp_path / "demo-in", tmp_path / "demo-out"
        subprocess.run([sys.executable, str(ROOT / "deploy" / "demo_operands.py"), str(demo_in)],
                       check=True, timeout=60)
        demo_args = [a.replace("/opt/needle-net/demo", str(demo_in))
                     .replace("/var/lib/needle-net/demo", str(demo_out))
                     for a in _replace(service_args(services["demo"]), {
                         "http://chain:8545": rpc_url})]
        demo_out.mkdir()
        demo = spawn(demo_args, "demo.log")
        assert demo.wait(240) == 0, (tmp_path / "demo.log").read_text()
        c = np.load(_option(demo_args, "-o"))
        a, b = np.load(demo_in / "a.npy"), np.load(demo_in / "b.npy")
        np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)

        # a recreated container takes a free slot again and gets that slot's key back
        for process, _ in replicas:
            _stop(process)
        process, api_port = start_replica(2)
        _wait(lambda: _healthy(worker_service, api_port, 8600), "restarted replica", process,
              tmp_path / "worker2.log")
        address = httpx.get(f"http://127.0.0.1:{api_port}/status").json()["address"].lower()
        assert address == slot_address["worker0"]
    finally:
        for process in reversed(processes):
            _stop(process)
