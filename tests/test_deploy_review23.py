"""The images' runtime stage: it took all of deploy/, the offline build's wheelhouse (64 MB
of wheels the runtime never reads) included; every deploy/ file the compose file or the
image's own build steps name must still be there."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPLOYED = "/opt/needle-net/deploy/"


def runtime_copies(dockerfile: Path) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY in the last stage that is not --from another."""
    stages = re.split(r"^FROM .*$", dockerfile.read_text(), flags=re.M)
    copies = []
    for line in stages[-1].splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            copies.append((words[1:-1], words[-1]))
    return copies


def named_deploy_files() -> set[str]:
    """The files under /opt/needle-net/deploy/ that the compose file and Dockerfiles use."""
    text = "".join(p.read_text() for p in (ROOT / "docker-compose.yml", ROOT / "Dockerfile",
                                            ROOT / "Dockerfile.cuda",
                                            ROOT / "deploy" / "worker-entrypoint.sh"))
    beside = r'\$\(dirname "\$0"\)/([\w.-]+)'  # what the entrypoint runs from its own folder
    return set(re.findall(re.escape(DEPLOYED) + r"([\w.-]+)", text) + re.findall(beside, text))


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_the_runtime_stage_takes_the_deploy_scripts_without_the_wheelhouse(name):
    copies = [(sources, dest) for sources, dest in runtime_copies(ROOT / name)
              if dest.startswith(DEPLOYED.rstrip("/"))]
    sources = [source for group, _ in copies for source in group]
    assert sources and all(s.startswith("deploy/") and s != "deploy/" for s in sources), sources
    assert not any(s.rstrip("/") in ("deploy", "deploy/wheels") for s in sources)
    copied = {Path(s).name for s in sources}
    needed = named_deploy_files()
    assert {"worker-entrypoint.sh", "demo_operands.py", "dev_faucet.py"} <= needed
    assert needed <= copied, f"{name} does not copy {needed - copied}"
    assert all((ROOT / s).is_file() for s in sources)
