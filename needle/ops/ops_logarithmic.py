"""Numerically stable log-sum-exp."""

from __future__ import annotations

from ..autograd import NDArray, Tensor, TensorOp
from .ops_mathematic import exp
from .ops_shape import _keepdims_shape, _reduced_axes, broadcast_to, reshape, summation

FLOAT32_MAX = 3.4028234663852886e38

__all__ = [
    "LogSumExp",
    "logsumexp",
]


class LogSumExp(TensorOp):
    """log(sum(exp(z), axes)), computed as max + log(sum(exp(z - max)))."""

    def __init__(self, axes=None):
        self.axes = axes

    def compute(self, z: NDArray) -> NDArray:
        if z.size == 0 and any(z.shape[i] == 0 for i in _reduced_axes(self.axes, z.ndim)):
            # a sum of no exps is 0, whose log is -inf (as numpy, scipy and PyTorch give);
            # z.max below would refuse the empty axis
            return z.device.full(self._out_shape(z), float("-inf"))
        # the shift is kept finite: a slice of all -inf then gives -inf and one holding +inf
        # gives +inf (as scipy and PyTorch), where inf - inf would make NaN
        top = z.max(self.axes, keepdims=True).maximum(-FLOAT32_MAX)
        top = -(-top).maximum(-FLOAT32_MAX)  # min(top, FLOAT32_MAX): NDArray has no minimum
        shifted = (z - top.broadcast_to(z.shape)).exp().sum(self.axes, keepdims=True)
        return (shifted.log() + top).reshape(self._out_shape(z))

    def _out_shape(self, z: NDArray) -> tuple[int, ...]:
        axes = _reduced_axes(self.axes, z.ndim)
        return tuple(d for i, d in enumerate(z.shape) if i not in axes)

    def gradient(self, out_grad, node):
        z = node.inputs[0]
        kept = _keepdims_shape(z.shape, _reduced_axes(self.axes, len(z.shape)))
        # exp(z - lse) is softmax(z) times exp(exact lse - float32 lse); once |lse| is large
        # (a row of -1e9 masks: lse = -1e9 + log(n) rounds to -1e9) that factor is far from 1,
        # so normalise: the gradient of logsumexp sums to 1 over the reduced axes.
        # A slice of all -inf (lse = -inf) gets a zero gradient, not NaN from -inf - -inf and
        # 0 / 0: the shift is lse kept >= -FLOAT32_MAX (a constant: softmax does not depend
        # on it).
        # A slice holding +inf (lse = +inf) gets the limit of softmax: 1/count at its +inf
        # entries. Capped at FLOAT32_MAX, those entries give exp(z - inf) = 0, not NaN from
        # inf - inf, so softmax is 0 there and the limit is added; elsewhere the cap changes
        # nothing and the limit is +0, so those slices keep their gradient bit for bit.
        # (Gradients are taken under no_grad: z's values are used as constants.)
        shift = node.realize_cached_data().maximum(-FLOAT32_MAX).reshape(kept)
        capped = -(-z.realize_cached_data()).maximum(-FLOAT32_MAX)  # min(z, FLOAT32_MAX)
        e = exp(Tensor.make_const(capped) - Tensor.make_const(shift.broadcast_to(z.shape)))
        total = summation(e, self.axes)
        total = total + (total == 0.0)  # 0 / 1 where every exp underflowed to 0
        softmax = e / broadcast_to(reshape(total, kept), z.shape)
        hits = z.realize_cached_data() == float("inf")
        count = hits.sum(self.axes, keepdims=True).maximum(1.0).broadcast_to(z.shape)
        softmax = softmax + Tensor.make_const(hits / count)
        return broadcast_to(reshape(out_grad, kept), z.shape) * softmax


def logsumexp(a: Tensor, axes=None) -> Tensor:
    return LogSumExp(axes)(a)
