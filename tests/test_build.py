"""CMake configure of the project: the CUDA module is built only where a CUDA compiler exists."""

import shutil
import subprocess
import sys
from pathlib import Path

import pybind11
import pytest

ROOT = Path(__file__).resolve().parents[1]
CMAKE = shutil.which("cmake")
NVCC = shutil.which("nvcc")

pytestmark = pytest.mark.skipif(CMAKE is None, reason="cmake is not installed")


def configure(build_dir: Path, *extra: str) -> tuple[str, str]:
    """Runs a configure-only CMake pass; returns its output and the generated build files."""
    args = [
        CMAKE,
        "-S",
        str(ROOT),
        "-B",
        str(build_dir),
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
        *extra,
    ]
    result = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    build_files = "".join(
        path.read_text()
        for name in ("build.ninja", "Makefile")
        if (path := build_dir / name).exists()
    )
    return result.stdout + result.stderr, build_files


@pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH: the CUDA path cannot be configured here")
def test_configure_with_nvcc_takes_cuda_path(tmp_path):
    output, build_files = configure(tmp_path)
    assert "needle: building the CUDA backend with" in output
    assert "skipping the CUDA backend" not in output
    assert "ndarray_backend_cuda" in build_files
    assert "ndarray_backend_cpu" in build_files


@pytest.mark.parametrize(
    "flag",
    ["-DNEEDLE_CUDA=OFF", "-DCMAKE_CUDA_COMPILER="],
    ids=["option-off", "no-cuda-compiler"],
)
def test_configure_without_cuda_skips_it_cleanly(tmp_path, flag):
    output, build_files = configure(tmp_path, flag)
    assert "needle: no CUDA compiler found, skipping the CUDA backend" in output
    assert "building the CUDA backend" not in output
    assert "ndarray_backend_cuda" not in build_files
    assert "ndarray_backend_cpu" in build_files
