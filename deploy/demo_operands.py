"""Write the demo job's operands, A (256x128) and B (128x64) float32, to DIR/a.npy and
DIR/b.npy: the compose `demo` service submits them with `needle-net submit`.

Usage: python demo_operands.py DIR
"""

import sys
from pathlib import Path

import numpy as np


def write_operands(directory: Path) -> None:
    rng = np.random.default_rng(414)
    directory.mkdir(parents=True, exist_ok=True)
    np.save(directory / "a.npy", rng.standard_normal((256, 128), dtype=np.float32))
    np.save(directory / "b.npy", rng.standard_normal((128, 64), dtype=np.float32))


if __name__ == "__main__":
    write_operands(Path(sys.argv[1]))
