"""Tensor and reverse-mode automatic differentiation.

A Tensor is a node of the computation graph: the Op that produced it, its
input Tensors and its value (an NDArray). backward() walks the graph in
reverse topological order, iteratively, so deep graphs need no recursion.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from .backend_ndarray import NDArray
from .backend_ndarray.ndarray import BackendDevice, _check_dtype

LAZY_MODE = False
"""When True, values are computed only when asked for (realize_cached_data)."""



class _GradMode(threading.local):
    """Per thread, as in PyTorch: an evaluation thread's no_grad must not strip the graph
    from the ops a training thread records at the same time."""

    enabled = True


_grad_mode = _GradMode()


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Inside this block ops record no graph (inference, optimiser updates) on this thread."""
    previous, _grad_mode.enabled = _grad_mode.enabled, False
    try:
        yield
    finally:
        _grad_mode.enabled = previous


def is_grad_enabled() -> bool:
    """False inside no_grad() on this thread: ops then record no graph."""
    return _grad_mode.enabled


class Op:
    """An operator: compute() on NDArrays, gradient() on Tensors."""

    def __call__(self, *args):
        raise NotImplementedError

    def compute(self, *args: NDArray):
        raise NotImplementedError

    def gradient(self, out_grad: Value, node: Value) -> Value | tuple[Value, ...]:
        """The adjoints of the inputs given the adjoint of the output."""
        raise NotImplementedError

    def gradient_as_tuple(self, out_grad: Value, node: Value) -> tuple[Value, ...]:
        grads = self.gradient(out_grad, node)
        if isinstance(grads, tuple):
            return grads
        if isinstance(grads, list):
            return tuple(grads)
        return (grads,)


class TensorOp(Op):
    def __call__(self, *args) -> Tensor:
        return Tensor.make_from_op(self, args)


class TensorTupleOp(Op):
    def __call__(self, *args) -> TensorTuple:
        return TensorTuple.make_from_op(self, args)


class Value:
    """A graph node: op + inputs, and the cached value."""

    op: Op | None
    inputs: tuple[Value, ...]
    cached_data: object
    requires_grad: bool
    _grad_ready_hooks: tuple[Callable[[Value], None], ...] = ()  # per leaf; see Tensor

    def _init(self, op, inputs, *, cached_data, requires_grad: bool) -> None:
        self.op = op
        self.inputs = tuple(inputs)
        self.cached_data = cached_data
        self.requires_grad = requires_grad

    def realize_cached_data(self):
        """The value, computing any unevaluated ancestors first (only in LAZY_MODE)."""
        if self.cached_data is None:
            for node in find_topo_sort([self], unrealized_only=True):
                node.cached_data = node.op.compute(*[x.cached_data for x in node.inputs])
        return self.cached_data

    def is_leaf(self) -> bool:
        return self.op is None

    @classmethod
    def make_const(cls, data, *, requires_grad: bool = False):
        value = cls.__new__(cls)
        value._init(None, (), cached_data=data, requires_grad=requires_grad)
        return value

    @classmethod
    def make_from_op(cls, op: Op, inputs):
        """The node op(*inputs); its graph edges are kept only if a gradient can flow."""
        value = cls.__new__(cls)
        value.grad = None
        requires_grad = False
        for x in inputs:
            if not isinstance(x, Value):
                raise TypeError(f"{type(op).__name__} takes tensors, got {type(x).__name__} {x!r}")
            requires_grad = requires_grad or x.requires_grad
        grad_enabled = _grad_mode.enabled
        requires_grad = requires_grad and grad_enabled
        value.requires_grad = requires_grad
        if LAZY_MODE and grad_enabled:
            value.op, value.inputs, value.cached_data = op, tuple(inputs), None
            return value
        value.cached_data = op.compute(*[x.realize_cached_data() for x in inputs])
        value.op, value.inputs = (op, tuple(inputs)) if requires_grad else (None, ())
        return value


class TensorTuple(Value):
    """A tuple of Tensors produced by one op (e.g. split)."""

    def __len__(self) -> int:
        return len(self.realize_cached_data())

    def __getitem__(self, index: int) -> Tensor:
        return ops.tuple_get_item(self, index)

    def tuple(self) -> tuple[Tensor, ...]:
        return tuple(self[i] for i in range(len(self)))

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self.tuple())

    def __repr__(self) -> str:
        return f"needle.TensorTuple{self.tuple()!r}"

    def __add__(self, other: TensorTuple) -> TensorTuple:
        if len(self) != len(other):
            raise ValueError(f"cannot add tuples of {len(self)} and {len(other)} tensors")
        return ops.make_tuple(*[a + b for a, b in zip(self, other, strict=True)])

    def detach(self) -> TensorTuple:
        return TensorTuple.make_const(self.realize_cached_data())


class Tensor(Value):
    """A float32 tensor on a device, recording the ops applied to it."""

    grad: Tensor | None

    def __init__(
        self,
        array,
        *,
        device: BackendDevice | None = None,
        dtype: str | None = "float32",
        requires_grad: bool = True,
    ):
        if isinstance(array, Value):
            array = array.realize_cached_data()
        if isinstance(array, NDArray):
            _check_dtype(dtype)  # np.float32 too, as for a numpy array
            data = array if device is None else array.to(device)
        else:
            data = NDArray(np.asarray(array), device=device, dtype=dtype or "float32")
        self._init(None, (), cached_data=data, requires_grad=requires_grad)

    def _init(self, op, inputs, *, cached_data, requires_grad: bool) -> None:
        super()._init(op, inputs, cached_data=cached_data, requires_grad=requires_grad)
        self.grad = None

    # ------------------------------------------------------------------ data
    @property
    def data(self) -> Tensor:
        """The value as a new Tensor outside the graph."""
        return self.detach()

    @data.setter
    def data(self, value: Tensor) -> None:
        if not isinstance(value, Tensor):
            raise TypeError(f"Tensor.data must be set to a Tensor, got {type(value).__name__}")
        new = value.realize_cached_data()
        if new.shape != self.shape:
            raise ValueError(f"Tensor.data: new shape {new.shape} differs from {self.shape}")
        self.cached_data = new

    def detach(self) -> Tensor:
        return Tensor.make_const(self.realize_cached_data())

    def numpy(self) -> np.ndarray:
        return self.realize_cached_data().numpy()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """np.asarray(t): a copy of the values (without this numpy read t as a sequence and
        made an object array of 0-d Tensors; a lazy tensor's sequence never ended)."""
        return self.realize_cached_data().__array__(dtype, copy)

    def __float__(self) -> float:
        """float(loss) of a one-element tensor (numpy also takes 0-d tensors in a list so)."""
        return float(self.numpy().item())

    @property
    def shape(self) -> tuple[int, ...]:
        return self.realize_cached_data().shape

    @property
    def dtype(self) -> str:
        return "float32"

    @property
    def device(self) -> BackendDevice:
        return self.realize_cached_data().device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return len(self.realize_cached_data())

    def __bool__(self) -> bool:
        return bool(self.realize_cached_data())

    def __repr__(self) -> str:
        return f"needle.Tensor({self.realize_cached_data()})"

    def __str__(self) -> str:
        return str(self.realize_cached_data())

    __hash__ = object.__hash__
    __array_ufunc__ = None  # numpy scalars on the left defer to Tensor's reflected operators

    # ------------------------------------------------------------------ autodiff
    def backward(self, out_grad: Tensor | float | np.ndarray | None = None) -> None:
        """Fill .grad of every Tensor this one depends on (the adjoint of self, default ones;
        a number or array, of self's shape, is taken as a constant Tensor on self's device)."""
        if out_grad is None:
            out_grad = Tensor(
                self.device.ones(*self.shape), device=self.device, requires_grad=False
            )
        elif not isinstance(out_grad, Tensor):
            out_grad = Tensor(out_grad, device=self.device, requires_grad=False)
        if out_grad.shape != self.shape:
            raise ValueError(f"backward: out_grad shape {out_grad.shape} != {self.shape}")
        if out_grad.device != self.device:
            raise ValueError(f"backward: out_grad on {out_grad.device}, tensor on {self.device}")
        compute_gradient_of_variables(self, out_grad)

    def register_grad_ready_hook(self, fn: Callable[[Tensor], None]) -> None:
        """Call `fn(self)` during each backward() as soon as this leaf's .grad is final.

        Lets a caller act on a gradient while backward is still running on the rest of
        the graph (data parallelism starts an allreduce this way). Not called for a leaf
        that receives no gradient in that backward.
        """
        if not self.is_leaf():
            raise ValueError("grad-ready hooks can be registered on leaf tensors only")
        self._grad_ready_hooks = (*self._grad_ready_hooks, fn)

    # ------------------------------------------------------------------ operators
    def __add__(self, other) -> Tensor:
        return ops.add(self, other) if isinstance(other, Tensor) else ops.add_scalar(self, other)

    __radd__ = __add__

    def __sub__(self, other) -> Tensor:
        if isinstance(other, Tensor):
            return ops.add(self, ops.negate(other))
        return ops.add_scalar(self, -other)

    def __rsub__(self, other) -> Tensor:
        return ops.add_scalar(ops.negate(self), other)

    def __mul__(self, other) -> Tensor:
        if isinstance(other, Tensor):
            return ops.multiply(self, other)
        return ops.mul_scalar(self, other)

    __rmul__ = __mul__

    def __truediv__(self, other) -> Tensor:
        if isinstance(other, Tensor):
            return ops.divide(self, other)
        return ops.divide_scalar(self, other)

    def __rtruediv__(self, other) -> Tensor:
        """number / t, or an array of t's shape / t, as one division (as t ** -1 * number it
        rounded twice, unlike numpy)."""
        return ops.divide(self._constant_like(other, "divide"), self)

    def __pow__(self, other) -> Tensor:
        if isinstance(other, Tensor):
            return ops.power(self, other)
        if isinstance(other, NDArray | list) or (isinstance(other, np.ndarray) and other.ndim):
            # a constant exponent array of self's shape, as numpy arrays are for + and *;
            # PowerScalar's gradient takes a number (its `scalar == 0` test)
            return ops.power(self, self._constant_like(other, "power"))
        return ops.power_scalar(self, other)

    def __rpow__(self, other) -> Tensor:
        """number ** t, or an array of t's shape ** t: the base is a constant, as other
        operands are for - and /."""
        return ops.power(self._constant_like(other, "power"), self)

    def _constant_like(self, value, what: str) -> Tensor:
        """A number, or an array of this tensor's shape, as a constant Tensor of its shape."""
        array = np.asarray(value, dtype=np.float32)
        if array.ndim and array.shape != tuple(self.shape):
            raise ValueError(f"{what}: shapes {array.shape} and {tuple(self.shape)} differ")
        array = np.ascontiguousarray(np.broadcast_to(array, self.shape))
        return Tensor.make_const(NDArray(array, device=self.device))

    def __neg__(self) -> Tensor:
        return ops.negate(self)

    def __matmul__(self, other: Tensor) -> Tensor:
        return ops.matmul(self, other)

    def __getitem__(self, idxs) -> Tensor:
        return ops.getitem(self, idxs)

    def _compare(self, other, fn) -> Tensor:
        """Comparisons give 1.0/0.0 constants: they have no gradient."""
        rhs = other.realize_cached_data() if isinstance(other, Tensor) else other
        return Tensor.make_const(fn(self.realize_cached_data(), rhs))

    def __eq__(self, other) -> Tensor:  # type: ignore[override]
        return self._compare(other, NDArray.__eq__)

    def __ne__(self, other) -> Tensor:  # type: ignore[override]
        return self._compare(other, NDArray.__ne__)

    def __ge__(self, other) -> Tensor:
        return self._compare(other, NDArray.__ge__)

    def __gt__(self, other) -> Tensor:
        return self._compare(other, NDArray.__gt__)

    def __le__(self, other) -> Tensor:
        return self._compare(other, NDArray.__le__)

    def __lt__(self, other) -> Tensor:
        return self._compare(other, NDArray.__lt__)

    # ------------------------------------------------------------------ shape methods
    def sum(self, axes=None, keepdims: bool = False) -> Tensor:
        return ops.summation(self, axes, keepdims)

    def max(self, axes=None, keepdims: bool = False) -> Tensor:
        return ops.max(self, axes, keepdims)

    def reshape(self, *shape) -> Tensor:
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):  # numpy's size
            shape = shape[0]
        return ops.reshape(self, tuple(shape))

    def transpose(self, axes=None) -> Tensor:
        return ops.transpose(self, axes)

    def broadcast_to(self, shape) -> Tensor:
        return ops.broadcast_to(self, shape)


def compute_gradient_of_variables(output: Tensor, out_grad: Tensor) -> None:
    """Reverse-mode AD: sum each node's adjoint contributions, then push them to its inputs.

    Like PyTorch, only leaves (tensors not produced by an op) keep .grad.

    Adjoints of single tuple entries (tuple_get_item) are collected per entry and
    turned into one tuple adjoint, so using all n parts of a split costs O(n), not O(n^2).
    """
    grads: dict[Value, list[Value]] = {output: [out_grad]}
    entries: dict[Value, dict[int, Value]] = {}
    with no_grad():
        for node in reversed(find_topo_sort([output])):
            contributions = grads.pop(node, [])
            if node in entries:
                contributions.append(_tuple_adjoint(node, entries.pop(node)))
            if not contributions:
                continue
            adjoint = contributions[0]
            for grad in contributions[1:]:
                adjoint = adjoint + grad
            if node.op is None:  # a leaf: keep its gradient (inner adjoints are freed as we go)
                # final: every user of the leaf came earlier in the walk. Detached, as the adjoint
                # may be the caller's out_grad (even one with a graph) or another leaf's (a + b)
                node.grad = adjoint.detach()
                for hook in node._grad_ready_hooks:
                    hook(node)
                continue
            if isinstance(node.op, ops.ops_tuple.TupleGetItem):
                parts = entries.setdefault(node.inputs[0], {})
                index = node.op.index
                parts[index] = adjoint + parts[index] if index in parts else adjoint
                continue
            for inp, grad in zip(
                node.inputs, node.op.gradient_as_tuple(adjoint, node), strict=True
            ):
                if inp.requires_grad:
                    grads.setdefault(inp, []).append(grad)


def _tuple_adjoint(node: Value, parts: dict[int, Value]) -> TensorTuple:
    """The adjoint of a tuple from the adjoints of some of its entries (zeros elsewhere)."""
    values = node.realize_cached_data()
    return ops.make_tuple(
        *[
            parts[i] if i in parts else Tensor.make_const(v.device.zeros(v.shape))
            for i, v in enumerate(values)
        ]
    )


def find_topo_sort(nodes: Iterable[Value], *, unrealized_only: bool = False) -> list[Value]:
    """Post-order DFS (inputs before users), with an explicit stack.

    unrealized_only leaves out the nodes that hold a value, and the ancestors reached only
    through them: realizing a lazy node then costs its new part of the graph, not all of it.
    """
    order: list[Value] = []
    visited: set[int] = set()
    for root in nodes:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in visited or (unrealized_only and node.cached_data is not None):
                continue
            visited.add(id(node))
            stack.append((node, True))
            stack.extend((x, False) for x in reversed(node.inputs) if id(x) not in visited)
    return order


# ops build on the classes above, and the Tensor operators call ops: import it last.
from . import ops  # noqa: E402
