"""Elementwise, scalar and matrix-product ops."""

from __future__ import annotations

import numpy as np

from ..autograd import NDArray, Tensor, TensorOp
from ..remote import active_offload
from .ops_shape import _broadcast_grad, transpose

__all__ = [
    "EWiseAdd",
    "add",
    "AddScalar",
    "add_scalar",
    "EWiseMul",
    "multiply",
    "MulScalar",
    "mul_scalar",
    "EWiseDiv",
    "divide",
    "DivScalar",
    "divide_scalar",
    "PowerScalar",
    "power_scalar",
    "EWisePow",
    "power",
    "Negate",
    "negate",
    "Log",
    "log",
    "Exp",
    "exp",
    "ReLU",
    "relu",
    "Tanh",
    "tanh",
    "Sigmoid",
    "sigmoid",
    "Sqrt",
    "sqrt",
    "MatMul",
    "matmul",
]


class EWiseAdd(TensorOp):
    def compute(self, a: NDArray, b: NDArray) -> NDArray:
        return a + b

    def gradient(self, out_grad, node):
        return out_grad, out_grad


def add(a: Tensor, b: Tensor) -> Tensor:
    return EWiseAdd()(a, b)


class AddScalar(TensorOp):
    def __init__(self, scalar: float):
        self.scalar = scalar

    def compute(self, a: NDArray) -> NDArray:
        return a + self.scalar

    def gradient(self, out_grad, node):
        return out_grad


def add_scalar(a: Tensor, scalar: float) -> Tensor:
    return AddScalar(scalar)(a)


class EWiseMul(TensorOp):
    def compute(self, a: NDArray, b: NDArray) -> NDArray:
        return a * b

    def gradient(self, out_grad, node):
        a, b = node.inputs
        return out_grad * b, out_grad * a


def multiply(a: Tensor, b: Tensor) -> Tensor:
    return EWiseMul()(a, b)


class MulScalar(TensorOp):
    def __init__(self, scalar: float):
        self.scalar = scalar

    def compute(self, a: NDArray) -> NDArray:
        return a * self.scalar

    def gradient(self, out_grad, node):
        return out_grad * self.scalar


def mul_scalar(a: Tensor, scalar: float) -> Tensor:
    return MulScalar(scalar)(a)


class EWiseDiv(TensorOp):
    def compute(self, a: NDArray, b: NDArray) -> NDArray:
        return a / b

    def gradient(self, out_grad, node):
        # -a / b**2 as (a / b) / b (as PyTorch): b * b overflows for |b| > 1.8e19 and
        # underflows to 0 for |b| < 1e-19 in float32, where (a / b) / b may be finite
        b = node.inputs[1]
        return out_grad / b, -out_grad * (node / b)


def divide(a: Tensor, b: Tensor) -> Tensor:
    return EWiseDiv()(a, b)


class DivScalar(TensorOp):
    def __init__(self, scalar: float):
        self.scalar = scalar

    def compute(self, a: NDArray) -> NDArray:
        return a / self.scalar

    def gradient(self, out_grad, node):
        return out_grad / self.scalar


def divide_scalar(a: Tensor, scalar: float) -> Tensor:
    return DivScalar(scalar)(a)


class PowerScalar(TensorOp):
    def __init__(self, scalar: float):
        self.scalar = scalar

    def compute(self, a: NDArray) -> NDArray:
        return a**self.scalar

    def gradient(self, out_grad, node):
        if self.scalar == 0:  # a ** 0 is constant; 0 * a ** -1 would be NaN at a = 0
            return out_grad * 0.0
        a = node.inputs[0]
        return out_grad * self.scalar * a ** (self.scalar - 1)


def power_scalar(a: Tensor, scalar: float) -> Tensor:
    return PowerScalar(scalar)(a)


class EWisePow(TensorOp):
    """a ** b elementwise (a > 0 where b is not an integer)."""

    def compute(self, a: NDArray, b: NDArray) -> NDArray:
        return a**b

    def gradient(self, out_grad, node):
        # 0 * inf = NaN is avoided where the derivative is 0 (as PyTorch): a ** 0 is constant
        # in a (exponent b - 1 becomes 0 there), and 0 ** b in b (log(a) becomes log(1))
        a, b = node.inputs
        grad_a = out_grad * b * a ** (b - 1.0 + (b == 0.0))
        return grad_a, out_grad * node * log(a + (a == 0.0))


def power(a: Tensor, b: Tensor) -> Tensor:
    return EWisePow()(a, b)


class Negate(TensorOp):
    def compute(self, a: NDArray) -> NDArray:
        return a * -1.0

    def gradient(self, out_grad, node):
        return negate(out_grad)


def negate(a: Tensor) -> Tensor:
    return Negate()(a)


class Log(TensorOp):
    def compute(self, a: NDArray) -> NDArray:
        return a.log()

    def gradient(self, out_grad, node):
        return out_grad / node.inputs[0]


def log(a: Tensor) -> Tensor:
    return Log()(a)


class Exp(TensorOp):
    def compute(self, a: NDArray) -> NDArray:
        return a.exp()

    def gradient(self, out_grad, node):
        return out_grad * node


def exp(a: Tensor) -> Tensor:
    return Exp()(a)


_SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)


class ReLU(TensorOp):
    def compute(self, a: NDArray) -> NDArray:
        return a.maximum(0.0)

    def gradient(self, out_grad, node):
        # relu(a) > 0 as one comparison (subnormal outputs count as 0, as under flush-to-zero)
        alive = node.realize_cached_data() >= _SMALLEST_NORMAL
        return out_grad * Tensor.make_const(alive)


def relu(a: Tensor) -> Tensor:
    return ReLU()(a)


class Tanh(TensorOp):
    def compute(self, a: NDArray) -> NDArray:
        return a.tanh()

    def gradient(self, out_grad, node):
        return out_grad * (1.0 - node * node)


def tanh(a: Tensor) -> Tensor:
    return Tanh()(a)


class Sigmoid(TensorOp):
    """1 / (1 + exp(-a)) from e = exp(-|a|) <= 1: 1 / (1 + e) for a >= 0, e / (1 + e) below,
    so nothing overflows and tiny values for very negative a keep their precision."""

    def compute(self, a: NDArray) -> NDArray:
        e = (-a.maximum(-a)).exp()
        positive = a >= 0.0
        return (positive + (1.0 - positive) * e) / (e + 1.0)

    def gradient(self, out_grad, node):
        return out_grad * node * (1.0 - node)


def sigmoid(a: Tensor) -> Tensor:
    return Sigmoid()(a)


class Sqrt(TensorOp):
    def compute(self, a: NDArray) -> NDArray:
        return a.sqrt()

    def gradient(self, out_grad, node):
        return out_grad / (node * 2.0)


def sqrt(a: Tensor) -> Tensor:
    return Sqrt()(a)


class MatMul(TensorOp):
    """a @ b with numpy.matmul broadcasting of the leading (batch) axes.

    Inside `needle.remote.offload(...)`, the active policy's matmul(a, b) may
    return the product computed remotely (it returns None to decline).
    """

    def compute(self, a: NDArray, b: NDArray) -> NDArray:
        policy = active_offload()
        if policy is not None:
            out = policy.matmul(a, b)
            if out is not None:
                return out
        return a @ b

    def gradient(self, out_grad, node):
        a, b = node.inputs
        grad_a = matmul(out_grad, transpose(b))
        grad_b = matmul(transpose(a), out_grad)
        return _broadcast_grad(grad_a, a.shape), _broadcast_grad(grad_b, b.shape)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    return MatMul()(a, b)
