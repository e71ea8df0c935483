"""CMake configure of the project: the CUDA module is built only where a CUDA compiler exists."""

import platform
import re
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
        for path in [build_dir / "build.ninja", build_dir / "Makefile"]
        + sorted(build_dir.glob("CMakeFiles/*/flags.make"))  # Makefile generator's flags
        if path.exists()
    )
    return result.stdout + result.stderr, build_files


def cuda_targets(build_files: str) -> set[str]:
    """The real (SASS) GPU targets nvcc is asked for, e.g. {"sm_80", "sm_90a"}."""
    return set(re.findall(r"arch=compute_\w+,code=\[compute_\w+,(sm_\w+)\]", build_files))


@pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH: the CUDA path cannot be configured here")
def test_configure_with_nvcc_takes_cuda_path(tmp_path):
    output, build_files = configure(tmp_path)
    assert "needle: building the CUDA backend with" in output
    assert "skipping the CUDA backend" not in output
    assert "ndarray_backend_cuda" in build_files
    assert "ndarray_backend_cpu" in build_files
    # Ampere/Ada code (with PTX for newer GPUs) and the Hopper-only wgmma kernels by default
    assert cuda_targets(build_files) == {"sm_80", "sm_90a"}
    assert "code=[compute_80,sm_80]" in build_files


@pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH: the CUDA path cannot be configured here")
def test_cuda_architectures_can_be_overridden(tmp_path):
    _, build_files = configure(tmp_path, "-DCMAKE_CUDA_ARCHITECTURES=86")
    assert cuda_targets(build_files) == {"sm_86"}


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
    # the verifier's host loop, its kernel once per instruction set, on any x86-64 build
    if platform.machine() in ("x86_64", "AMD64"):
        assert all(f"exact_host_{isa}" in build_files for isa in ("avx2", "avx512"))
