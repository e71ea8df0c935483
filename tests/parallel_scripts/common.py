"""Models and data shared by the parallel tests and the scripts they launch under MPI."""
import numpy as np

import needle as ndl
from needle import nn

IN, HIDDEN, CLASSES = 12, 16, 5
CPU = ndl.cpu()  # needle tensors default to cpu_numpy but initialisers to cpu: be explicit


def make_stages(seed: int, device=CPU) -> list[nn.Module]:
    """A 3-layer MLP cut into two stages; `seed` fixes the initial weights."""
    np.random.seed(seed)
    first = nn.Sequential(nn.Linear(IN, HIDDEN, device=device), nn.ReLU())
    second = nn.Sequential(
        nn.Linear(HIDDEN, HIDDEN, device=device),
        nn.Tanh(),
        nn.Linear(HIDDEN, CLASSES, device=device),
    )
    return [first, second]


def make_model(seed: int, device=CPU) -> nn.Module:
    return nn.Sequential(*make_stages(seed, device))


def make_batches(steps: int, batch: int, seed: int = 7) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (
            rng.standard_normal((batch, IN)).astype(np.float32),
            rng.integers(0, CLASSES, size=batch).astype(np.float32),
        )
        for _ in range(steps)
    ]


def train_reference(seed: int, steps: int, batch: int, device=CPU) -> list[np.ndarray]:
    """Single-process full-batch training: what data parallelism must reproduce."""
    model = make_model(seed, device)
    opt = ndl.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.SoftmaxLoss()
    for x, y in make_batches(steps, batch):
        opt.reset_grad()
        loss_fn(model(ndl.Tensor(x, device=device)), ndl.Tensor(y, device=device)).backward()
        opt.step()
    return [p.numpy() for p in model.parameters()]


def reference_gradients(seed: int, x: np.ndarray, y: np.ndarray, device=CPU) -> list[np.ndarray]:
    """Gradients of the unsplit model's batch-mean loss."""
    model = make_model(seed, device)
    loss = nn.SoftmaxLoss()(model(ndl.Tensor(x, device=device)), ndl.Tensor(y, device=device))
    loss.backward()
    return [p.grad.numpy() for p in model.parameters()]
