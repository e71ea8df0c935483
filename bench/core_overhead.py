"""Per-op cost of needle's core (Tensor -> Op -> NDArray -> backend) against PyTorch.

    .venv/bin/python bench/core_overhead.py [--repeats 5]

Two workloads, forward + backward, measured in the same run for needle (numpy and
cpu backends) and PyTorch (CPU): a chain of small elementwise/broadcast/reduction
ops on 16 x 16 tensors (dominated by per-op framework overhead), and an MLP step
at batch 256 (dominated by the matmuls). Prints microseconds per step (wall and
process CPU time) and the ratios needle / PyTorch.
"""

import argparse
import time

import numpy as np

try:
    import torch
except ImportError:  # the reference every figure is a ratio against
    raise SystemExit("core_overhead.py compares with PyTorch, which is not installed: "
                     "pip install -e '.[bench]'") from None

import needle as ndl
from needle import ops


def small_chain_needle(x, w):
    h = x
    for _ in range(10):
        h = ops.tanh(h * w + ops.broadcast_to(ops.summation(h, (0,), keepdims=True), h.shape))
    return h.sum()


def small_chain_torch(x, w):
    h = x
    for _ in range(10):
        h = torch.tanh(h * w + h.sum(0, keepdim=True).expand(h.shape))
    return h.sum()


def mlp_needle(x, w1, w2):
    return ops.logsumexp(ops.relu(x @ w1) @ w2, (1,)).sum()


def mlp_torch(x, w1, w2):
    return torch.logsumexp(torch.relu(x @ w1) @ w2, 1).sum()


def best_time(step, repeats: int, inner: int) -> tuple[float, float]:
    """Best over `repeats` of the mean (wall, process CPU) seconds per step over `inner` steps.

    CPU time (all threads of this process) is the steadier figure on a machine shared
    with other jobs; wall time is what a user waits.
    """
    step()
    wall, cpu = float("inf"), float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(inner):
            step()
        wall = min(wall, (time.perf_counter() - start) / inner)
        cpu = min(cpu, (time.process_time() - start_cpu) / inner)
    return wall, cpu


def needle_step(fn, arrays, device):
    tensors = [ndl.Tensor(a, device=device) for a in arrays]

    def step():
        fn(*tensors).backward()

    return step


def torch_step(fn, arrays):
    tensors = [torch.tensor(a, requires_grad=True) for a in arrays]

    def step():
        for t in tensors:
            t.grad = None
        fn(*tensors).backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    f32 = np.float32
    workloads = [
        ("small chain (16x16, 50 ops)", small_chain_needle, small_chain_torch,
         [rng.standard_normal((16, 16)).astype(f32), rng.standard_normal((16, 16)).astype(f32)],
         200),
        ("MLP step (256x512x512x10)", mlp_needle, mlp_torch,
         [rng.standard_normal((256, 512)).astype(f32),
          (rng.standard_normal((512, 512)) / 20).astype(f32),
          (rng.standard_normal((512, 10)) / 20).astype(f32)],
         10),
    ]  # fmt: skip
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads; per step: wall / CPU time")
    for name, fn_needle, fn_torch, arrays, inner in workloads:
        ref_wall, ref_cpu = best_time(torch_step(fn_torch, arrays), args.repeats, inner)
        line = f"{name:28s} pytorch {ref_wall * 1e6:8.0f} / {ref_cpu * 1e6:8.0f} us"
        for device in (ndl.cpu_numpy(), ndl.cpu()):
            wall, cpu = best_time(needle_step(fn_needle, arrays, device), args.repeats, inner)
            line += (
                f" | {device.name} {wall * 1e6:8.0f} / {cpu * 1e6:8.0f} us"
                f" ({wall / ref_wall:4.2f}x / {cpu / ref_cpu:4.2f}x)"
            )
        print(line)


if __name__ == "__main__":
    main()
