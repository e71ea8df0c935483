"""bench/ scripts whose reference (PyTorch, CuPy, a GPU) is missing, or whose options leave
nothing to measure, stop with one clear line instead of a traceback or a second run of the
whole benchmark (each script run as a user runs it, in a subprocess); bench/verify.py's
best-of leaves a cold first call out."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_bench(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=BENCH.parent)


def load_bench(script: str):
    spec = importlib.util.spec_from_file_location(f"bench_{Path(script).stem}", BENCH / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("script, module", [
    ("core_overhead.py", "torch"), ("train_cpu.py", "torch"), ("matmul_cuda.py", "torch"),
    ("resnet9_cuda.py", "torch"), ("sgemm_sweep.py", "torch"), ("verify_profile.py", "cupy"),
])
def test_a_missing_reference_is_named_without_a_traceback(script: str, module: str) -> None:
    if installed(module):
        pytest.skip(f"{module} is installed here")
    proc = run_bench(script, "--help")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "not installed" in proc.stderr and script in proc.stderr


def test_verify_gpu_without_cupy_says_so() -> None:
    if installed("cupy"):
        pytest.skip("cupy is installed here")
    proc = run_bench("verify.py", "--gpu", "--sizes", "8", "--repeats", "1")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "CuPy is not installed" in proc.stderr


def test_parallel_on_cuda_without_a_gpu_says_so() -> None:
    import needle as ndl

    if ndl.cuda().enabled():
        pytest.skip("a CUDA GPU is present")
    proc = run_bench("parallel.py", "--device", "cuda", "--batch", "2", "--steps", "1",
                     "--warmup", "0", "--repeats", "1")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "device cuda is not available here" in proc.stderr


@pytest.mark.parametrize("args, message", [
    # a child process timed the reference with --reference-only 0, which it took for "not
    # the child": it ran the whole benchmark again, then its output failed to parse
    (["--reference-txs", "0"], "--reference-txs must be at least 1"),
    (["--txs", "1"], "--txs must be at least --senders"),  # no transaction to send: IndexError
    (["--seal-block-txs", "1"], "--seal-block-txs must be at least --senders"),  # empty blocks
])
def test_chain_tps_refuses_sizes_with_nothing_to_measure(args: list[str], message: str) -> None:
    proc = run_bench("chain_tps.py", "--txs", "8", "--senders", "2", "--many-txs", "2",
                     "--seal-blocks", "1", "--seal-block-txs", "2", "--reference-txs", "2",
                     *args, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_verify_best_time_leaves_the_cold_first_call_out(monkeypatch) -> None:
    """A call that builds a plan first (5 s on a clock the test drives) and then takes 2 ms:
    best of 1 is 2 ms, not the cold call, which also stopped the count of short calls."""
    bench = load_bench("verify.py")
    now, calls = [0.0], []

    def call() -> None:
        calls.append(now[0])
        now[0] += 5.0 if len(calls) == 1 else 2e-3

    monkeypatch.setattr(bench, "clock", lambda: now[0])
    assert bench.best_time(call, 1) == pytest.approx(2e-3)
    assert len(calls) == 2
