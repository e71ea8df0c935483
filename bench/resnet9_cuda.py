"""One ResNet9 training step (batch 128, 3 x 32 x 32) in needle on `cuda` against PyTorch.

    PYTHONPATH=$PWD python3 bench/resnet9_cuda.py [--batch 128] [--steps 10] [--profile]

Same architecture (CMU needle's ResNet9), loss and optimiser (SGD, momentum 0.9) in both, float32
with TF32 off in PyTorch; prints the median step time of each and the ratio.
"""

import argparse
import statistics
import time

import numpy as np

try:
    import torch
    from torch import nn as tnn
except ImportError:  # the reference
    raise SystemExit("resnet9_cuda.py compares with PyTorch, which is not installed: "
                     "pip install torch") from None

import needle as ndl
from needle import nn
from needle.models import ResNet9


def conv_bn(a: int, b: int, k: int, s: int) -> tnn.Module:
    return tnn.Sequential(
        tnn.Conv2d(a, b, k, s, padding=k // 2), tnn.BatchNorm2d(b), tnn.ReLU()
    )


class TorchResidual(tnn.Module):
    def __init__(self, fn: tnn.Module):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x) + x


def torch_resnet9(num_classes: int = 10) -> tnn.Module:
    return tnn.Sequential(
        conv_bn(3, 16, 7, 4),
        conv_bn(16, 32, 3, 2),
        TorchResidual(tnn.Sequential(conv_bn(32, 32, 3, 1), conv_bn(32, 32, 3, 1))),
        conv_bn(32, 64, 3, 2),
        conv_bn(64, 128, 3, 2),
        TorchResidual(tnn.Sequential(conv_bn(128, 128, 3, 1), conv_bn(128, 128, 3, 1))),
        tnn.Flatten(),
        tnn.Linear(128, 128),
        tnn.ReLU(),
        tnn.Linear(128, num_classes),
    )


def median_step_ms(step, steps: int, warmup: int = 3) -> float:
    """`step` must return only once the device has finished the step."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def needle_step(x: np.ndarray, y: np.ndarray, losses: list[float]):
    """One training step of needle's ResNet9 that returns once the device has finished it."""
    device = ndl.cuda()
    model = ResNet9(device=device, dtype="float32")
    model.train()
    opt = ndl.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.SoftmaxLoss()
    xs, ys = ndl.Tensor(x, device=device), ndl.Tensor(y, device=device)

    def step():
        opt.reset_grad()
        loss = loss_fn(model(xs), ys)
        loss.backward()
        opt.step()
        losses.append(float(loss.numpy()))  # copies to the host: waits for the whole step

    return step


def needle_step_ms(x: np.ndarray, y: np.ndarray, steps: int) -> tuple[float, float]:
    losses: list[float] = []
    return median_step_ms(needle_step(x, y, losses), steps), losses[0]


def profile_needle(x: np.ndarray, y: np.ndarray, steps: int, top: int = 15) -> None:
    """Where a needle step's GPU time goes: kernels by total time per step, against wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step = needle_step(x, y, [])
    for _ in range(3):
        step()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    per_step = sorted(
        ((e.self_device_time_total / 1e3 / steps, e.count / steps, e.key) for e in kernels),
        reverse=True,
    )
    busy = sum(ms for ms, _, _ in per_step)
    launches = sum(n for _, n, _ in per_step)
    print(
        f"needle step under the profiler: {wall_ms:.2f} ms wall, {busy:.2f} ms in "
        f"{launches:.0f} kernels and copies ({busy / wall_ms:.0%} of the step)"
    )
    for ms, count, name in per_step[:top]:
        print(f"  {ms:7.3f} ms {count:5.0f}x  {name[:90]}")


def torch_step_ms(x: np.ndarray, y: np.ndarray, steps: int) -> tuple[float, float]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = torch_resnet9().cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = tnn.CrossEntropyLoss()
    xs, ys = torch.from_numpy(x).cuda(), torch.from_numpy(y.astype(np.int64)).cuda()
    losses = []

    def step():
        opt.zero_grad()
        loss = loss_fn(model(xs), ys)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # waits for the whole step

    return median_step_ms(step, steps), losses[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="also list needle's top kernels")
    args = parser.parse_args()
    if not ndl.cuda().enabled():
        raise SystemExit("no CUDA GPU")

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, 3, 32, 32), dtype=np.float32)
    y = rng.integers(0, 10, args.batch).astype(np.float32)
    if args.profile:
        profile_needle(x, y, args.steps)
    t_needle, loss_needle = needle_step_ms(x, y, args.steps)
    t_torch, loss_torch = torch_step_ms(x, y, args.steps)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"ResNet9 train step, batch {args.batch}, median of {args.steps}:")
    print(f"  needle cuda {t_needle:8.2f} ms  (first loss {loss_needle:.3f})")
    print(f"  PyTorch     {t_torch:8.2f} ms  (first loss {loss_torch:.3f})")
    print(f"  ratio needle / PyTorch time: {t_needle / t_torch:.1f}x")


if __name__ == "__main__":
    main()
