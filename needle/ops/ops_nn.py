"""Fused ops for nn layers: fewer graph nodes and backend calls per training step.

The matrix product itself stays the MatMul op so remote offload still sees it.
"""

from __future__ import annotations

import numpy as np

from ..autograd import NDArray, Tensor, TensorOp
from .ops_shape import reshape, summation


class AddBias(TensorOp):
    """x (batch, features) + b (1, features), the broadcast folded into the op."""

    def compute(self, x: NDArray, b: NDArray) -> NDArray:
        return x + b.broadcast_to(x.shape)

    def gradient(self, out_grad, node):
        return out_grad, reshape(summation(out_grad, (0,)), node.inputs[1].shape)


def add_bias(x: Tensor, b: Tensor) -> Tensor:
    return AddBias()(x, b)


class SoftmaxCrossEntropy(TensorOp):
    """Mean over the batch of -log softmax(logits)[label]; labels are fixed, not inputs.

    The forward pass keeps softmax(logits), so the gradient (softmax - one_hot) / batch costs
    one subtraction and one scale.
    """

    def __init__(self, labels: np.ndarray):
        self.labels = labels

    def compute(self, logits: NDArray) -> NDArray:
        batch, classes = logits.shape
        if self.labels.size and (self.labels.min() < 0 or self.labels.max() >= classes):
            raise ValueError(
                f"labels must lie in [0, {classes}), got {self.labels.min()}..{self.labels.max()}"
            )
        self.one_hot = logits.device.one_hot(classes, self.labels)
        shifted = logits - logits.max(axis=1, keepdims=True).broadcast_to(logits.shape)
        exp = shifted.exp()
        total = exp.sum(axis=1, keepdims=True)
        self.softmax = exp / total.broadcast_to(logits.shape)
        log_likelihood = (shifted * self.one_hot).sum(axis=1, keepdims=True) - total.log()
        return log_likelihood.sum() * (-1.0 / batch)

    def gradient(self, out_grad, node):
        batch = self.softmax.shape[0]
        scale = out_grad.realize_cached_data().numpy().item() / batch
        return Tensor.make_const((self.softmax - self.one_hot) * scale)


def softmax_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of logits (batch, classes) against integer labels (batch,)."""
    return SoftmaxCrossEntropy(labels.numpy().astype(np.int64))(logits)
