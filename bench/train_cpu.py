"""One training epoch on scikit-learn's digits in needle (`cpu` backend) and in PyTorch (CPU),
same model, same batches, same optimiser, measured in the same run.

    .venv/bin/python bench/train_cpu.py [--repeats 7] [--batch-size 64] [--threads 1]

Prints milliseconds per epoch for each framework, as wall time and as process CPU time (the
best of `repeats` epochs each, the two frameworks alternating so that both see the same machine
load), and the ratios needle / PyTorch, for the MLP (64-128-10) and the small conv net
(models.SmallResNet). --threads caps both PyTorch's intra-op threads and the OpenMP threads of
needle's C++ backend; with one thread each, CPU time is the figure a busy machine disturbs
least.
"""
import argparse
import time

import numpy as np

try:
    import torch
    from threadpoolctl import threadpool_limits
except ImportError as err:  # the reference and the thread caps
    raise SystemExit(f"train_cpu.py needs {err.name}, which is not installed: "
                     "pip install -e '.[bench]'") from None

import needle as ndl
from needle import models, nn, optim
from needle.train import load_digits


def batches(X, y, batch_size, seed):
    order = np.random.default_rng(seed).permutation(len(X))
    return [(X[order[i : i + batch_size]], y[order[i : i + batch_size]])
            for i in range(0, len(X), batch_size)]


def needle_epoch(model, opt, data, device):
    loss_fn = nn.SoftmaxLoss()
    model.train()
    for xb, yb in data:
        X = ndl.Tensor(xb, device=device, requires_grad=False)
        y = ndl.Tensor(yb, device=device, requires_grad=False)
        opt.reset_grad()
        loss = loss_fn(model(X), y)
        loss.backward()
        opt.step()
    return float(loss.numpy())


def torch_epoch(model, opt, data):
    loss_fn = torch.nn.CrossEntropyLoss()
    model.train()
    for xb, yb in data:
        X, y = torch.from_numpy(xb), torch.from_numpy(yb.astype(np.int64))
        opt.zero_grad()
        loss = loss_fn(model(X), y)
        loss.backward()
        opt.step()
    return float(loss.detach())


def torch_mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def torch_small_resnet(width=16):
    def block(a, b):
        return [torch.nn.Conv2d(a, b, 3, padding=1, bias=False), torch.nn.BatchNorm2d(b),
                torch.nn.ReLU()]

    class Residual(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, x):
            return self.fn(x) + x

    return torch.nn.Sequential(
        *block(1, width),
        Residual(torch.nn.Sequential(*block(width, width), *block(width, width))),
        torch.nn.MaxPool2d(2),
        *block(width, 2 * width),
        torch.nn.AvgPool2d(4),
        torch.nn.Flatten(),
        torch.nn.Linear(2 * width, 10),
    )


def compare(name, needle_model, torch_model, data, repeats, device, lr):
    # CMU needle's SGD momentum is u = m u + (1 - m) g: PyTorch's dampening = m matches it.
    n_opt = optim.SGD(needle_model.parameters(), lr=lr, momentum=0.9)
    t_opt = torch.optim.SGD(torch_model.parameters(), lr=lr, momentum=0.9, dampening=0.9)
    runs = {"needle": lambda: needle_epoch(needle_model, n_opt, data, device),
            "pytorch": lambda: torch_epoch(torch_model, t_opt, data)}
    best = {(f, clock): float("inf") for f in runs for clock in ("wall", "cpu")}
    for rep in range(repeats + 1):  # the first round warms up and is not counted
        for framework, epoch in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            epoch()
            if rep:
                best[framework, "wall"] = min(best[framework, "wall"], time.perf_counter() - wall)
                best[framework, "cpu"] = min(best[framework, "cpu"], time.process_time() - cpu)
    for clock in ("wall", "cpu"):
        needle_s, torch_s = best["needle", clock], best["pytorch", clock]
        print(f"{name:13s} {clock:4s} needle cpu {needle_s * 1e3:8.1f} ms/epoch   pytorch "
              f"{torch_s * 1e3:8.1f} ms/epoch   ratio needle/pytorch {needle_s / torch_s:5.2f}x")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with threadpool_limits(limits=args.threads, user_api="openmp"):
        run(args)


def run(args):
    np.random.seed(0)
    torch.manual_seed(0)
    device = ndl.cpu()
    X_train, y_train, _, _ = load_digits()
    print(f"digits: {len(X_train)} training images, batch {args.batch_size}, "
          f"torch threads {torch.get_num_threads()}")
    flat = batches(X_train.reshape(len(X_train), -1), y_train, args.batch_size, seed=0)
    compare("MLP 64-128-10", models.MLP(64, (128,), 10, device=device), torch_mlp(), flat,
            args.repeats, device, lr=0.1)
    images = batches(X_train, y_train, args.batch_size, seed=0)
    compare("SmallResNet", models.SmallResNet(1, 10, width=16, device=device),
            torch_small_resnet(16), images, args.repeats, device, lr=0.1)


if __name__ == "__main__":
    main()
