"""Fused ops for nn layers: fewer graph nodes and backend calls per training step.

Their products go through MatMul.compute, so remote offload still sees every forward and
backward matmul. Gradients are constants (first-order autodiff, as training needs).
"""

from __future__ import annotations

import numpy as np

from ..autograd import NDArray, Tensor, TensorOp
from .ops_mathematic import MatMul

_MATMUL = MatMul()


class Linear(TensorOp):
    """x (batch, in) @ w (in, out) [+ b (1, out)] as one graph node.

    Backward is dx = g w^T, dw = x^T g, db = sum_rows(g), with dx skipped when x needs none.
    """

    def compute(self, x: NDArray, w: NDArray, b: NDArray | None = None) -> NDArray:
        out = _MATMUL.compute(x, w)
        return out if b is None else out + b.broadcast_to(out.shape)

    def gradient(self, out_grad, node):
        x, w = node.inputs[0], node.inputs[1]
        g = out_grad.realize_cached_data()
        grads = [
            Tensor.make_const(_MATMUL.compute(g, w.realize_cached_data().permute((1, 0))))
            if x.requires_grad else None,
            Tensor.make_const(_MATMUL.compute(x.realize_cached_data().permute((1, 0)), g)),
        ]
        if len(node.inputs) == 3:
            grads.append(Tensor.make_const(g.sum(axis=0, keepdims=True)))
        return tuple(grads)


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    return Linear()(x, w) if b is None else Linear()(x, w, b)


class SoftmaxCrossEntropy(TensorOp):
    """Mean over the batch of -log softmax(logits)[label]; labels are fixed, not inputs.

    The forward pass keeps softmax(logits), so the gradient (softmax - one_hot) / batch costs
    one subtraction and one scale.
    """

    def __init__(self, labels: np.ndarray):
        self.labels = labels

    def compute(self, logits: NDArray) -> NDArray:
        batch, classes = logits.shape
        self.one_hot = logits.device.one_hot(classes, self.labels)
        shifted = logits + (logits.max(axis=1, keepdims=True) * -1.0).broadcast_to(logits.shape)
        exp = shifted.exp()
        total = exp.sum(axis=1, keepdims=True)
        self.softmax = exp / total.broadcast_to(logits.shape)
        picked = (shifted * self.one_hot).sum()
        return (total.log().sum() + picked * -1.0) * (1.0 / batch)

    def gradient(self, out_grad, node):
        batch = self.softmax.shape[0]
        scale = out_grad.realize_cached_data().numpy().item() / batch
        return Tensor.make_const((self.softmax - self.one_hot) * scale)


def softmax_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of logits (batch, classes) against integer labels (batch,)."""
    return SoftmaxCrossEntropy(labels.numpy().astype(np.int64))(logits)
