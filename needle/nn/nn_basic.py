"""Module, Parameter and the basic layers (CMU needle's `needle.nn`)."""
import math
from collections.abc import Iterator
from numbers import Integral
from typing import Any

import numpy as np

from needle import init, ops
from needle.autograd import Tensor
from needle.ops.ops_nn import BatchNorm, LayerNorm, linear, softmax_cross_entropy

__all__ = [
    "Parameter",
    "Module",
    "Identity",
    "Linear",
    "Flatten",
    "ReLU",
    "Tanh",
    "Sigmoid",
    "GELU",
    "Sequential",
    "SoftmaxLoss",
    "MSELoss",
    "BatchNorm1d",
    "BatchNorm2d",
    "LayerNorm1d",
    "Dropout",
    "Residual",
]


class Parameter(Tensor):
    """A tensor that a Module trains: `Module.parameters()` collects exactly these."""


def _named_tensors(value: Any, prefix: str) -> Iterator[tuple[str, Tensor]]:
    if isinstance(value, Tensor):
        yield prefix, value
        return
    if isinstance(value, Module):
        value = vars(value)
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return
    for key, child in items:
        yield from _named_tensors(child, f"{prefix}.{key}" if prefix else str(key))


def _child_modules(value: Any) -> Iterator["Module"]:
    if isinstance(value, Module):
        yield value
        value = vars(value)
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for child in value:
            yield from _child_modules(child)


def check_shape(module: "Module", x: Tensor, ndim: int, dims: dict[int, int],
                what: str = "input") -> None:
    """Raise a ValueError naming the layer (and `what`, e.g. "h0") when x is not the shape
    it expects."""
    bad = len(x.shape) != ndim or any(x.shape[axis] != size for axis, size in dims.items())
    if bad:
        expected = ["*"] * ndim
        for axis, size in dims.items():
            expected[axis] = str(size)
        raise ValueError(
            f"{type(module).__name__} expects {what} of shape ({', '.join(expected)}), "
            f"got {tuple(x.shape)}"
        )


def check_positive_ints(module: "Module", **sizes) -> None:
    """A ValueError naming the layer or model for a size that is not a positive int: 0, a
    negative, a float or a bool would otherwise fail later with ZeroDivisionError, a numpy
    shape error or garbage, or build a model that fails only at its first batch."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
            raise ValueError(f"{type(module).__name__}: {name} must be a positive int, "
                             f"got {value!r}")


class Module:
    """A layer: trainable Parameters and sub-modules found through its attributes."""

    def __init__(self):
        self.training = True

    def named_tensors(self) -> list[tuple[str, Tensor]]:
        """Every tensor held by this module tree (parameters and buffers), by dotted name."""
        return list(_named_tensors(self, ""))

    def parameters(self) -> list[Parameter]:
        """Each Parameter once, in attribute order (a shared one at its first place)."""
        seen: dict[int, Parameter] = {}
        for _, tensor in self.named_tensors():
            if isinstance(tensor, Parameter):
                seen.setdefault(id(tensor), tensor)
        return list(seen.values())

    def children(self) -> list["Module"]:
        """Every sub-module, nested ones included (not self)."""
        return list(_child_modules(vars(self)))

    _children = children  # CMU needle's name

    def eval(self) -> "Module":
        self.training = False
        for m in self.children():
            m.training = False
        return self

    def train(self) -> "Module":
        self.training = True
        for m in self.children():
            m.training = True
        return self

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters and buffers (e.g. BatchNorm running statistics) as numpy arrays."""
        return {name: tensor.numpy() for name, tensor in self.named_tensors()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Copy arrays into this module's tensors; names and shapes must match exactly.
        Everything is checked before anything is written, so a bad state changes nothing."""
        own = dict(self.named_tensors())
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise KeyError(
                f"state_dict does not match {type(self).__name__}: "
                f"missing {missing}, unexpected {unexpected}"
            )
        for name, tensor in own.items():
            value = np.asarray(state[name])
            if value.dtype.kind not in "biuf":
                raise TypeError(f"state_dict entry {name!r} has non-numeric dtype {value.dtype}")
            if value.shape != tuple(tensor.shape):
                raise ValueError(
                    f"state_dict entry {name!r} has shape {value.shape}, "
                    f"the module expects {tuple(tensor.shape)}"
                )
        for name, tensor in own.items():
            tensor.data = Tensor(state[name], device=tensor.device, dtype=tensor.dtype)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class Identity(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


class Linear(Module):
    """y = x W + b over the last axis of x."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype="float32"):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = Parameter(
            init.kaiming_uniform(in_features, out_features, device=device, dtype=dtype)
        )
        self.bias = None
        if bias:
            self.bias = Parameter(
                init.kaiming_uniform(out_features, 1, device=device, dtype=dtype).reshape(
                    (1, out_features)
                )
            )

    def forward(self, X: Tensor) -> Tensor:
        if len(X.shape) < 2 or X.shape[-1] != self.in_features:
            raise ValueError(
                f"Linear expects input of shape (..., {self.in_features}), got {tuple(X.shape)}"
            )
        leading = X.shape[:-1]
        if len(X.shape) > 2:
            X = X.reshape((int(np.prod(leading)), self.in_features))
        out = linear(X, self.weight, self.bias)
        if len(leading) > 1:
            out = out.reshape((*leading, self.out_features))
        return out


class Flatten(Module):
    def forward(self, X: Tensor) -> Tensor:
        return X.reshape((X.shape[0], int(np.prod(X.shape[1:]))))


class ReLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return ops.relu(x)


class Tanh(Module):
    def forward(self, x: Tensor) -> Tensor:
        return ops.tanh(x)


class Sigmoid(Module):
    def forward(self, x: Tensor) -> Tensor:
        return ops.sigmoid(x)


class GELU(Module):
    """The tanh approximation of GELU (as GPT-2 and BERT use it)."""

    def forward(self, x: Tensor) -> Tensor:
        inner = (x + x * x * x * 0.044715) * float(np.sqrt(2.0 / np.pi))
        return x * (ops.tanh(inner) + 1.0) * 0.5


class Sequential(Module):
    def __init__(self, *modules):
        super().__init__()
        self.modules = modules

    def forward(self, x: Tensor) -> Tensor:
        for module in self.modules:
            x = module(x)
        return x


class SoftmaxLoss(Module):
    """Mean cross-entropy of logits (batch, classes) against integer labels (batch,)."""

    def forward(self, logits: Tensor, y: Tensor) -> Tensor:
        if len(logits.shape) != 2 or tuple(y.shape) != (logits.shape[0],):
            raise ValueError(
                f"SoftmaxLoss expects logits (batch, classes) and labels (batch,), "
                f"got {tuple(logits.shape)} and {tuple(y.shape)}"
            )
        return softmax_cross_entropy(logits, y)


class MSELoss(Module):
    """Mean squared error over all elements."""

    def forward(self, pred: Tensor, target: Tensor) -> Tensor:
        if tuple(pred.shape) != tuple(target.shape):
            raise ValueError(
                f"MSELoss expects equal shapes, got {tuple(pred.shape)} and {tuple(target.shape)}"
            )
        diff = pred - target
        return ops.summation(diff * diff) / float(np.prod(pred.shape))


class BatchNorm1d(Module):
    """Normalise each feature over the batch; running statistics are used in eval mode.

    As in CMU needle, the running variance tracks the biased batch variance.
    """

    def __init__(self, dim, eps=1e-5, momentum=0.1, device=None, dtype="float32"):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.momentum = momentum
        self.weight = Parameter(init.ones(dim, device=device, dtype=dtype))
        self.bias = Parameter(init.zeros(dim, device=device, dtype=dtype))
        self.running_mean = init.zeros(dim, device=device, dtype=dtype)
        self.running_var = init.ones(dim, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        check_shape(self, x, 2, {1: self.dim})
        return self.normalize(x)

    def normalize(self, x: Tensor) -> Tensor:
        """x (N, dim, ...) normalised per channel over everything but the channel axis."""
        if not self.training:
            running = (self.running_mean.realize_cached_data(),
                       self.running_var.realize_cached_data())
            return BatchNorm(self.eps, running)(x, self.weight, self.bias)
        if math.prod(x.shape) <= self.dim:  # one value per channel: its variance is 0, and
            # the running variance would decay towards 0, blowing up eval mode
            raise ValueError(f"{type(self).__name__} needs more than 1 value per channel when "
                             f"training, got input of shape {tuple(x.shape)}")
        op = BatchNorm(self.eps)
        out = op(x, self.weight, self.bias)
        out.realize_cached_data()  # in LAZY_MODE the batch statistics exist once computed
        m = self.momentum
        self.running_mean = Tensor.make_const(self.running_mean.realize_cached_data() * (1 - m)
                                              + op.mean * m)
        self.running_var = Tensor.make_const(self.running_var.realize_cached_data() * (1 - m)
                                             + op.var * m)
        return out


class BatchNorm2d(BatchNorm1d):
    """BatchNorm over the channels of NCHW images (statistics over batch and pixels)."""

    def forward(self, x: Tensor) -> Tensor:
        check_shape(self, x, 4, {1: self.dim})
        return self.normalize(x)


class LayerNorm1d(Module):
    """Normalise over the last axis of x."""

    def __init__(self, dim, eps=1e-5, device=None, dtype="float32"):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = Parameter(init.ones(dim, device=device, dtype=dtype))
        self.bias = Parameter(init.zeros(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        if len(x.shape) < 1 or x.shape[-1] != self.dim:
            raise ValueError(
                f"LayerNorm1d expects input of shape (..., {self.dim}), got {tuple(x.shape)}"
            )
        return LayerNorm(self.eps)(x, self.weight, self.bias)


class Dropout(Module):
    """Zero each element with probability p while training, scaling the rest by 1/(1-p)."""

    def __init__(self, p=0.5):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        mask = init.randb(*x.shape, p=1 - self.p, device=x.device, dtype=x.dtype)
        return x * mask / (1 - self.p)


class Residual(Module):
    def __init__(self, fn: Module):
        super().__init__()
        self.fn = fn

    def forward(self, x: Tensor) -> Tensor:
        y = self.fn(x)
        if tuple(y.shape) != tuple(x.shape):
            raise ValueError(
                f"Residual: its function maps {tuple(x.shape)} to {tuple(y.shape)}; "
                "the shapes must be equal"
            )
        return y + x
