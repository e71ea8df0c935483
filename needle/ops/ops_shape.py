"""Ops that move, view or reduce data: transpose, reshape, broadcast, sum, max, indexing."""

from __future__ import annotations

from ..autograd import NDArray, Tensor, TensorOp
from ..backend_ndarray.ndarray import _normalize_axes

__all__ = [
    "Transpose",
    "transpose",
    "Reshape",
    "reshape",
    "BroadcastTo",
    "broadcast_to",
    "Summation",
    "summation",
    "Max",
    "max",
    "GetItem",
    "getitem",
    "ScatterIntoZeros",
    "scatter_into_zeros",
]


def _reduced_axes(axes, ndim: int) -> tuple[int, ...]:
    return tuple(range(ndim)) if axes is None else _normalize_axes(axes, ndim, "reduce")


def _keepdims_shape(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if i in axes else d for i, d in enumerate(shape))


def _broadcast_grad(grad: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Sum a gradient over the axes along which an input of `shape` was broadcast."""
    if grad.shape == shape:
        return grad
    lead = len(grad.shape) - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(shape) if d == 1 and grad.shape[lead + i] != 1
    )
    return reshape(summation(grad, axes), shape) if axes else reshape(grad, shape)


class Transpose(TensorOp):
    """Swap two axes (default: the last two)."""

    def __init__(self, axes: tuple[int, int] | None = None):
        if axes is not None and len(tuple(axes)) != 2:
            raise ValueError(f"transpose swaps two axes, got axes={axes}; compose "
                             "transposes to reorder more")
        self.axes = axes

    def compute(self, a: NDArray) -> NDArray:
        if a.ndim < 2:
            raise ValueError(f"transpose needs >= 2 dimensions, got shape {a.shape}")
        i, j = (-2, -1) if self.axes is None else self.axes
        (i,), (j,) = (_normalize_axes(x, a.ndim, "transpose") for x in (i, j))
        order = list(range(a.ndim))
        order[i], order[j] = order[j], order[i]
        return a.permute(order)

    def gradient(self, out_grad, node):
        return transpose(out_grad, self.axes)


def transpose(a: Tensor, axes: tuple[int, int] | None = None) -> Tensor:
    return Transpose(axes)(a)


class Reshape(TensorOp):
    def __init__(self, shape):
        self.shape = tuple(shape)

    def compute(self, a: NDArray) -> NDArray:
        return a.reshape(self.shape)

    def gradient(self, out_grad, node):
        return reshape(out_grad, node.inputs[0].shape)


def reshape(a: Tensor, shape) -> Tensor:
    return Reshape(shape)(a)


class BroadcastTo(TensorOp):
    def __init__(self, shape):
        self.shape = tuple(shape)

    def compute(self, a: NDArray) -> NDArray:
        return a.broadcast_to(self.shape)

    def gradient(self, out_grad, node):
        return _broadcast_grad(out_grad, node.inputs[0].shape)


def broadcast_to(a: Tensor, shape) -> Tensor:
    return BroadcastTo(shape)(a)


class Summation(TensorOp):
    def __init__(self, axes=None, keepdims: bool = False):
        self.axes = axes
        self.keepdims = keepdims

    def compute(self, a: NDArray) -> NDArray:
        return a.sum(self.axes, keepdims=self.keepdims)

    def gradient(self, out_grad, node):
        shape = node.inputs[0].shape
        kept = _keepdims_shape(shape, _reduced_axes(self.axes, len(shape)))
        return broadcast_to(reshape(out_grad, kept), shape)


def summation(a: Tensor, axes=None, keepdims: bool = False) -> Tensor:
    return Summation(axes, keepdims)(a)


class Max(TensorOp):
    """Maximum over axes; the gradient is shared equally between tied maxima."""

    def __init__(self, axes=None, keepdims: bool = False):
        self.axes = axes
        self.keepdims = keepdims

    def compute(self, a: NDArray) -> NDArray:
        return a.max(self.axes, keepdims=self.keepdims)

    def gradient(self, out_grad, node):
        a = node.inputs[0].realize_cached_data()
        kept = _keepdims_shape(a.shape, _reduced_axes(self.axes, a.ndim))
        is_max = a == node.realize_cached_data().reshape(kept).broadcast_to(a.shape)
        ties = is_max.sum(self.axes, keepdims=True).broadcast_to(a.shape)
        share = Tensor.make_const(is_max / ties)
        return broadcast_to(reshape(out_grad, kept), a.shape) * share


def max(a: Tensor, axes=None, keepdims: bool = False) -> Tensor:  # noqa: A001 (CMU name)
    return Max(axes, keepdims)(a)


class GetItem(TensorOp):
    """a[idxs] with ints and slices (a view: no copy)."""

    def __init__(self, idxs):
        self.idxs = idxs

    def compute(self, a: NDArray) -> NDArray:
        return a[self.idxs]

    def gradient(self, out_grad, node):
        return scatter_into_zeros(out_grad, node.inputs[0].shape, self.idxs)


def getitem(a: Tensor, idxs) -> Tensor:
    return GetItem(idxs)(a)


class ScatterIntoZeros(TensorOp):
    """zeros(shape) with a written at idxs: the adjoint of getitem (and a general pad)."""

    def __init__(self, shape, idxs):
        self.shape = tuple(shape)
        self.idxs = idxs

    def compute(self, a: NDArray) -> NDArray:
        out = a.device.zeros(self.shape)
        # setitem broadcasts: a smaller value would be silently repeated over the slice
        target = out[self.idxs].shape
        if a.shape != target:
            raise ValueError(f"scatter_into_zeros: value of shape {a.shape} does not match "
                             f"the slice's shape {target} (of {self.shape} at {self.idxs})")
        out[self.idxs] = a
        return out

    def gradient(self, out_grad, node):
        return getitem(out_grad, self.idxs)


def scatter_into_zeros(a: Tensor, shape, idxs) -> Tensor:
    return ScatterIntoZeros(shape, idxs)(a)
