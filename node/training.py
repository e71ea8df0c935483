"""A small, reproducible training run on the digits bundled with scikit-learn: an MLP
trained full-batch with Adam, optionally with its big matmuls offloaded. Shared by the
demo and the offload training test so both train exactly the same way."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import needle as ndl
from needle import remote
from needle.models import MLP


@dataclass
class TrainResult:
    test_accuracy: float
    final_loss: float
    offloaded_matmuls: int
    local_matmuls: int


def digits_split(seed: int = 0) -> tuple[np.ndarray, ...]:
    """(x_train, y_train, x_test, y_test): sklearn's 8x8 digits scaled to [0, 1], 80/20 split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def train_digits(executor=None, *, steps: int = 30, hidden: int = 32, lr: float = 0.02,
                 min_flops: float = 4e6, seed: int = 0, device=None) -> TrainResult:
    """Train from a seeded initialisation; with `executor`, matmuls of at least `min_flops`
    (forward and backward) run on it."""
    device = device or ndl.cpu()
    x_train, y_train, x_test, y_test = digits_split(seed)
    np.random.seed(seed)
    model = MLP(64, (hidden,), 10, device=device)
    optimizer = ndl.optim.Adam(model.parameters(), lr=lr)
    loss_fn = ndl.nn.SoftmaxLoss()
    x = ndl.Tensor(x_train, device=device, requires_grad=False)
    y = ndl.Tensor(y_train, device=device, requires_grad=False)
    offloaded = local = 0
    loss_value = float("nan")
    for _ in range(steps):
        optimizer.reset_grad()
        if executor is None:
            loss = loss_fn(model(x), y)
            loss.backward()
        else:
            with remote.offload(executor, min_flops=min_flops) as policy:
                loss = loss_fn(model(x), y)
                loss.backward()
            offloaded += policy.offloaded
            local += policy.local
        optimizer.step()
        loss_value = float(loss.numpy())
    model.eval()
    logits = model(ndl.Tensor(x_test, device=device, requires_grad=False)).numpy()
    accuracy = float((logits.argmax(axis=1) == y_test).mean())
    return TrainResult(accuracy, loss_value, offloaded, local)
