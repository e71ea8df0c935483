"""Compile the Vyper market contract once per source version (cached by source hash)."""
from __future__ import annotations

import hashlib
import json
import os
from functools import cache
from pathlib import Path

CONTRACT_SOURCE = Path(__file__).parent / "contracts" / "ComputeMarket.vy"


def cache_dir() -> Path:
    root = os.environ.get("NEEDLE_NET_CACHE") or Path.home() / ".cache" / "needle-net"
    return Path(root) / "vyper"


@cache
def compiled_market() -> dict:
    """{'abi': [...], 'bytecode': bytes, 'runtime': bytes, 'path': cache file} for the market."""
    source = CONTRACT_SOURCE.read_text()
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = cache_dir() / f"ComputeMarket-{digest}.json"
    if not path.exists():
        import vyper

        out = vyper.compile_code(source, output_formats=["abi", "bytecode", "bytecode_runtime"])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(out))
        os.replace(tmp, path)
    out = json.loads(path.read_text())
    return {
        "abi": out["abi"],
        "bytecode": bytes.fromhex(out["bytecode"][2:]),
        "runtime": bytes.fromhex(out["bytecode_runtime"][2:]),
        "path": str(path),
    }
