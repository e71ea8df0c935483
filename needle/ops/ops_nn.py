"""Fused ops for nn layers: fewer graph nodes and backend calls per training step.

Their products go through MatMul.compute, so remote offload still sees every forward and
backward matmul. Gradients are constants (first-order autodiff, as training needs).
"""

from __future__ import annotations

from math import prod

import numpy as np

from ..autograd import NDArray, Tensor, TensorOp
from .ops_logarithmic import FLOAT32_MAX
from .ops_mathematic import MatMul
from .ops_shape import _broadcast_grad

_MATMUL = MatMul()


class Linear(TensorOp):
    """x (batch, in) @ w (in, out) [+ b (out,) or (1, out)] as one graph node.

    Backward is dx = g w^T, dw = x^T g, db = sum_rows(g), with dx skipped when x needs none.
    """

    def compute(self, x: NDArray, w: NDArray, b: NDArray | None = None) -> NDArray:
        if x.ndim != 2 or w.ndim != 2:  # a batched matmul runs, but backward assumes matrices
            raise ValueError(f"linear needs x (batch, in) and w (in, out), got {x.shape} "
                             f"and {w.shape}; flatten the leading axes of x first")
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
        if len(node.inputs) == 3:  # summed over the axes b was broadcast along: b's own shape
            grads.append(_broadcast_grad(Tensor.make_const(g), node.inputs[2].shape))
        return tuple(grads)


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    return Linear()(x, w) if b is None else Linear()(x, w, b)


class SoftmaxCrossEntropy(TensorOp):
    """Mean over the batch of -log softmax(logits)[label]; labels are fixed, not inputs.

    The forward pass keeps softmax(logits), so the gradient (softmax - one_hot) / batch costs
    one subtraction and one scale. Logits of -inf (masked classes) are allowed; one at a label
    counts as -FLOAT32_MAX, a huge but finite loss.
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
        # a -inf logit (a masked class) times its 0 in one_hot would be NaN: clamp it first
        picked = (shifted.maximum(-FLOAT32_MAX) * self.one_hot).sum(axis=1, keepdims=True)
        # each row's loss is at most ~FLOAT32_MAX; summing them before dividing by the batch
        # made two masked labels inf, so scale first and keep the mean's rounding finite too
        mean = ((total.log() + picked * -1.0) * (1.0 / batch)).sum()
        return (mean * -1.0).maximum(-FLOAT32_MAX) * -1.0

    def gradient(self, out_grad, node):
        batch = self.softmax.shape[0]
        scale = out_grad.realize_cached_data().numpy().item() / batch
        return Tensor.make_const((self.softmax - self.one_hot) * scale)


def integer_ids(ids: Tensor, what: str) -> np.ndarray:
    """The values of `ids` (class labels, embedding rows) as int64, or a ValueError naming
    `what`: a float such as 1.7 would silently count as 1 (NaN is refused too)."""
    values = ids.numpy()
    if not np.array_equal(values, np.round(values)):
        raise ValueError(f"{what} must be integers, got {values.ravel()[:8]}")
    if values.size and not np.abs(values).max() < 2.0**63:  # inf: a cast would give -2^63
        raise ValueError(f"{what} must be integers within int64's range, got "
                         f"{values.ravel()[np.abs(values.ravel()).argmax()]}")
    return values.astype(np.int64)


def softmax_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of logits (batch, classes) against integer labels (batch,)."""
    if logits.shape[0] == 0:  # the mean of no loss: 0 / 0 (ZeroDivisionError before)
        raise ValueError(f"softmax_cross_entropy needs at least one example, got logits of "
                         f"shape {tuple(logits.shape)}")
    return SoftmaxCrossEntropy(integer_ids(labels, "softmax_cross_entropy: labels"))(logits)


class BatchNorm(TensorOp):
    """Per-channel normalisation of x (N, C, ...) by its batch statistics (training) or by
    given running ones (eval), then scale w (C,) and shift b (C,).

    After compute, `mean` and `var` hold the batch statistics (biased variance) for the
    layer's running averages. Backward is the closed form, dx = w / std / M
    (M g - sum g - x_hat sum(g x_hat)) with sums over the M = N * pixels of each channel.
    """

    def __init__(self, eps: float, running: tuple[NDArray, NDArray] | None = None):
        self.eps = eps
        self.running = running

    def _channels(self, a: NDArray) -> NDArray:
        """(N, C, ...) as (N, C, S), S the pixels per channel (1 for BatchNorm1d)."""
        n, c = a.shape[:2]
        return a.reshape((n, c, prod(a.shape[2:])))

    @staticmethod
    def _per_channel_sum(a: NDArray) -> NDArray:
        """(N, C, S) -> (C,): the trailing reduction first, it needs no permuted copy."""
        return a.sum(axis=2).sum(axis=0)

    def compute(self, x: NDArray, w: NDArray, b: NDArray) -> NDArray:
        x3 = self._channels(x)
        n, c, s = x3.shape
        if self.running is None:
            self.mean = self._per_channel_sum(x3) * (1.0 / (n * s))
            centered = x3 + (self.mean * -1.0).reshape((1, c, 1)).broadcast_to(x3.shape)
            self.var = self._per_channel_sum(centered * centered) * (1.0 / (n * s))
        else:
            mean, self.var = self.running
            centered = x3 + (mean * -1.0).reshape((1, c, 1)).broadcast_to(x3.shape)
        self.inv_std = (self.var + self.eps) ** -0.5
        self.x_hat = centered * self.inv_std.reshape((1, c, 1)).broadcast_to(x3.shape)
        out = self.x_hat * w.reshape((1, c, 1)).broadcast_to(x3.shape)
        return (out + b.reshape((1, c, 1)).broadcast_to(x3.shape)).reshape(x.shape)

    def gradient(self, out_grad, node):
        x, w = node.inputs[0], node.inputs[1]
        g = self._channels(out_grad.realize_cached_data())
        n, c, s = g.shape
        grad_b = self._per_channel_sum(g)
        grad_w = self._per_channel_sum(g * self.x_hat)
        scale = (w.realize_cached_data() * self.inv_std).reshape((1, c, 1))
        if self.running is None:
            m = n * s
            inner = g * float(m) + (grad_b * -1.0).reshape((1, c, 1)).broadcast_to(g.shape)
            inner = inner + self.x_hat * (grad_w * -1.0).reshape((1, c, 1)).broadcast_to(g.shape)
            grad_x = inner * (scale * (1.0 / m)).broadcast_to(g.shape)
        else:
            grad_x = g * scale.broadcast_to(g.shape)
        return (Tensor.make_const(grad_x.reshape(x.shape)), Tensor.make_const(grad_w),
                Tensor.make_const(grad_b))


class LayerNorm(TensorOp):
    """Normalise x (..., D) over its last axis, then scale w (D,) and shift b (D,).

    Backward: with gw = g w, dx = (D gw - sum gw - x_hat sum(gw x_hat)) / (D std), sums over D.
    """

    def __init__(self, eps: float):
        self.eps = eps

    def compute(self, x: NDArray, w: NDArray, b: NDArray) -> NDArray:
        d = x.shape[-1]
        rows = x.reshape((x.size // d, d))
        mean = rows.sum(axis=1, keepdims=True) * (1.0 / d)
        centered = rows + (mean * -1.0).broadcast_to(rows.shape)
        var = (centered * centered).sum(axis=1, keepdims=True) * (1.0 / d)
        self.inv_std = (var + self.eps) ** -0.5
        self.x_hat = centered * self.inv_std.broadcast_to(rows.shape)
        out = self.x_hat * w.reshape((1, d)).broadcast_to(rows.shape)
        return (out + b.reshape((1, d)).broadcast_to(rows.shape)).reshape(x.shape)

    def gradient(self, out_grad, node):
        x, w = node.inputs[0], node.inputs[1]
        rows, d = self.x_hat.shape
        g = out_grad.realize_cached_data().reshape((rows, d))
        gw = g * w.realize_cached_data().reshape((1, d)).broadcast_to(g.shape)
        sum_gw = gw.sum(axis=1, keepdims=True) * -1.0
        sum_gw_xhat = (gw * self.x_hat).sum(axis=1, keepdims=True) * -1.0
        inner = gw * float(d) + sum_gw.broadcast_to(g.shape)
        inner = inner + self.x_hat * sum_gw_xhat.broadcast_to(g.shape)
        grad_x = inner * (self.inv_std * (1.0 / d)).broadcast_to(g.shape)
        return (Tensor.make_const(grad_x.reshape(x.shape)),
                Tensor.make_const((g * self.x_hat).sum(axis=0)),
                Tensor.make_const(g.sum(axis=0)))
