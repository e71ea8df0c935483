"""Ops on several tensors at once: tuples, stack/split and concatenate."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..autograd import NDArray, Tensor, TensorOp, TensorTuple, TensorTupleOp, Value
from ..backend_ndarray.ndarray import _normalize_axes
from .ops_shape import getitem

__all__ = [
    "MakeTensorTuple",
    "make_tuple",
    "TupleGetItem",
    "tuple_get_item",
    "Stack",
    "stack",
    "Split",
    "split",
    "Concatenate",
    "concatenate",
]


class MakeTensorTuple(TensorTupleOp):
    def compute(self, *args: NDArray) -> tuple[NDArray, ...]:
        return tuple(args)

    def gradient(self, out_grad, node):
        return tuple(out_grad[i] for i in range(len(node.inputs)))


def make_tuple(*args: Tensor) -> TensorTuple:
    return MakeTensorTuple()(*args)


class TupleGetItem(TensorOp):
    def __init__(self, index: int):
        if not isinstance(index, int | np.integer):
            raise TypeError(f"a TensorTuple index must be an int, got {index!r}")
        self.index = int(index)

    def __call__(self, a: TensorTuple) -> Tensor:
        if self.index < 0:  # as a position: backward matches entries to parts by position
            if self.index < -len(a):
                raise IndexError(f"tuple index {self.index} is out of range for {len(a)} parts")
            self.index += len(a)
        if isinstance(a.op, MakeTensorTuple):  # no node needed to unpack a tuple just built
            return a.inputs[self.index]
        return Tensor.make_from_op(self, (a,))

    def compute(self, a: tuple[NDArray, ...]) -> NDArray:
        return a[self.index]

    def gradient(self, out_grad, node):
        parts = node.inputs[0].realize_cached_data()
        return make_tuple(
            *[
                out_grad if i == self.index else Tensor.make_const(p.device.zeros(p.shape))
                for i, p in enumerate(parts)
            ]
        )


def tuple_get_item(value: TensorTuple, index: int) -> Tensor:
    return TupleGetItem(index)(value)


def _as_tuple(args: Sequence[Tensor] | TensorTuple) -> TensorTuple:
    return args if isinstance(args, TensorTuple) else make_tuple(*args)


def _check_parts(parts: Sequence[NDArray], what: str, skip_axis: int | None = None) -> None:
    if not parts:
        raise ValueError(f"{what} needs at least one tensor")
    first = parts[0].shape
    for p in parts[1:]:
        same = len(p.shape) == len(first) and all(
            x == y for i, (x, y) in enumerate(zip(p.shape, first, strict=True)) if i != skip_axis
        )
        if not same:
            raise ValueError(f"{what}: shapes {[q.shape for q in parts]} do not match")


class Stack(TensorOp):
    """Join equal-shaped tensors along a new axis."""

    def __init__(self, axis: int):
        self.axis = axis

    def compute(self, parts: tuple[NDArray, ...]) -> NDArray:
        _check_parts(parts, "stack")
        shape = parts[0].shape
        (axis,) = _normalize_axes(self.axis, len(shape) + 1, "stack")
        out = parts[0].device.empty(shape[:axis] + (len(parts),) + shape[axis:])
        index = [slice(None)] * len(out.shape)
        for i, p in enumerate(parts):
            index[axis] = i
            out[tuple(index)] = p
        return out

    def gradient(self, out_grad, node):
        return split(out_grad, self.axis)


def stack(args: Sequence[Tensor] | TensorTuple, axis: int) -> Tensor:
    return Stack(axis)(_as_tuple(args))


class Split(TensorTupleOp):
    """The inverse of stack: views a[..., i, ...] along axis."""

    def __init__(self, axis: int):
        self.axis = axis

    def compute(self, a: NDArray) -> tuple[NDArray, ...]:
        (axis,) = _normalize_axes(self.axis, a.ndim, "split")
        index = [slice(None)] * a.ndim
        parts = []
        for i in range(a.shape[axis]):
            index[axis] = i
            parts.append(a[tuple(index)])
        return tuple(parts)

    def gradient(self, out_grad, node):
        return stack(out_grad, self.axis)


def split(a: Tensor, axis: int) -> TensorTuple:
    return Split(axis)(a)


class Concatenate(TensorOp):
    """Join tensors along an existing axis."""

    def __init__(self, axis: int):
        self.axis = axis

    def _slices(self, sizes: Sequence[int], ndim: int) -> list[tuple[slice, ...]]:
        (axis,) = _normalize_axes(self.axis, ndim, "concatenate")
        out, start = [], 0
        for size in sizes:
            out.append((slice(None),) * axis + (slice(start, start + size),))
            start += size
        return out

    def compute(self, parts: tuple[NDArray, ...]) -> NDArray:
        ndim = parts[0].ndim if parts else 0
        (axis,) = _normalize_axes(self.axis, ndim, "concatenate")
        _check_parts(parts, "concatenate", skip_axis=axis)
        sizes = [p.shape[axis] for p in parts]
        shape = parts[0].shape[:axis] + (sum(sizes),) + parts[0].shape[axis + 1 :]
        out = parts[0].device.empty(shape)
        for p, where in zip(parts, self._slices(sizes, ndim), strict=True):
            out[where] = p
        return out

    def gradient(self, out_grad, node: Value):
        parts = node.inputs[0].realize_cached_data()
        ndim = parts[0].ndim
        (axis,) = _normalize_axes(self.axis, ndim, "concatenate")
        wheres = self._slices([p.shape[axis] for p in parts], ndim)
        return make_tuple(*[getitem(out_grad, where) for where in wheres])


def concatenate(args: Sequence[Tensor] | TensorTuple, axis: int) -> Tensor:
    return Concatenate(axis)(_as_tuple(args))
