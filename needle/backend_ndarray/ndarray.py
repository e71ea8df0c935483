"""NDArray: a strided view over a flat float32 buffer owned by a backend module.

Views (reshape, permute, broadcast_to, slicing, as_strided) only change
(shape, strides, offset); the backend's small set of primitives does the work
on compact buffers. Inputs are validated here so a backend never sees a bad size.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import operator
import os
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from . import ndarray_backend_numpy

Shape = tuple[int, ...]


class MissingPrimitive(AttributeError):
    """A backend module lacks a primitive of the interface (e.g. while it is being written)."""


class BackendDevice:
    """A device: a name plus the backend module that implements the primitives."""

    def __init__(self, name: str, mod=None):
        self.name = name
        self.mod = mod
        if mod is not None:  # primitives as instance attributes: no __getattr__ on hot paths
            self.__dict__.update(
                (k, v) for k, v in vars(mod).items() if not k.startswith("_") and callable(v)
            )

    def __eq__(self, other) -> bool:
        return isinstance(other, BackendDevice) and self.name == other.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return self.name + "()"

    def __getattr__(self, name: str):
        mod = self.__dict__.get("mod")
        if mod is None:
            raise MissingPrimitive(
                f"device {self.__dict__.get('name')} is not available here "
                "(backend module not built, or no GPU)"
            )
        try:
            return getattr(mod, name)
        except AttributeError:
            raise MissingPrimitive(
                f"the {self.__dict__['name']} backend has no primitive '{name}'"
            ) from None

    def enabled(self) -> bool:
        return self.mod is not None

    def empty(self, shape, dtype: str = "float32") -> NDArray:
        return NDArray.make(_as_shape(shape), device=self, dtype=dtype)

    def full(self, shape, fill_value: float, dtype: str = "float32") -> NDArray:
        arr = self.empty(shape, dtype)
        arr.fill(fill_value)
        return arr

    def zeros(self, *shape, dtype: str = "float32") -> NDArray:
        return self.full(_star_shape(shape), 0.0, dtype)

    def ones(self, *shape, dtype: str = "float32") -> NDArray:
        return self.full(_star_shape(shape), 1.0, dtype)

    def randn(self, *shape, dtype: str = "float32") -> NDArray:
        return NDArray(np.random.randn(*_star_shape(shape)), device=self, dtype=dtype)

    def rand(self, *shape, dtype: str = "float32") -> NDArray:
        return NDArray(np.random.rand(*_star_shape(shape)), device=self, dtype=dtype)

    def one_hot(self, n: int, i, dtype: str = "float32") -> NDArray:
        """Rows of the n x n identity picked by the integer labels i."""
        labels = np.asarray(i.numpy() if hasattr(i, "numpy") else i)
        if labels.dtype.kind == "f" and not np.all(labels == np.round(labels)):
            bad = labels[labels != np.round(labels)].flat[0]  # NaN too: it is no class
            raise ValueError(f"one_hot: labels must be integers (whole numbers), got {bad}")
        if labels.size and (labels.min() < 0 or labels.max() >= n):
            raise IndexError(
                f"one_hot: labels must lie in [0, {n}), got {labels.min()}..{labels.max()}"
            )
        rows = np.eye(n, dtype=np.float32)[labels.astype(np.int64)]
        return NDArray(rows, device=self, dtype=dtype)


def _star_shape(shape) -> Shape:
    """Accept both zeros(2, 3) and zeros((2, 3))."""
    if len(shape) == 1 and isinstance(shape[0], Sequence):
        shape = shape[0]
    return _as_shape(shape)


def _as_shape(shape) -> Shape:
    shape = _int_tuple(shape)
    if min(shape, default=0) < 0:
        raise ValueError(f"negative dimension in shape {shape}")
    return shape


def _int_tuple(shape) -> Shape:
    """An int or a sequence of ints as a tuple; a float (2.5, or 2.0) is refused, not truncated."""
    if isinstance(shape, int | np.integer):
        shape = (shape,)
    try:
        return tuple(operator.index(s) for s in shape)
    except TypeError:
        raise TypeError(f"shape entries must be integers, got {shape!r}") from None


def cpu_numpy() -> BackendDevice:
    """The pure numpy reference backend."""
    return _NUMPY


def cpu() -> BackendDevice:
    """The C++ backend (csrc/ndarray_backend_cpu.cc)."""
    return _load("cpu")


def cuda() -> BackendDevice:
    """The CUDA backend; enabled() only when the module imports and sees a GPU."""
    return _load("cuda")


def default_device() -> BackendDevice:
    return _NUMPY


def all_devices() -> list[BackendDevice]:
    return [cpu_numpy(), cpu(), cuda()]


_NUMPY = BackendDevice("cpu_numpy", ndarray_backend_numpy)
_LOADED: dict[str, BackendDevice] = {}


def _load(name: str) -> BackendDevice:
    device = _LOADED.get(name)
    if device is None:
        # OpenMP threads that spin while idle steal the core from whoever else runs there
        # (measured: a conv-net step 2-4x slower on a shared 2-core machine); sleep instead.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        try:
            mod = importlib.import_module(f"{__package__}.ndarray_backend_{name}")
        except ImportError:
            mod = None
        if mod is not None and name == "cuda":
            count = getattr(mod, "device_count", None)
            if count is None or count() <= 0:
                mod = None
        device = _LOADED[name] = BackendDevice(name, mod)
    return device


class _MatmulMode(threading.local):
    """Per thread: a worker computing fp32 jobs in one thread of a process must not pick up
    TF32 from a training loop's allow_tf32() in another (its results would fail the fp32
    bound, and its stake would pay for it)."""

    tf32 = False


_matmul_mode = _MatmulMode()


@contextlib.contextmanager
def allow_tf32(enabled: bool = True) -> Iterator[None]:
    """Inside this block, matmuls this thread runs on devices with a TF32 tensor-core path
    (cuda) use it.

    TF32 rounds the inputs to a 10-bit mantissa (float32 accumulation): faster, less exact.
    """
    previous, _matmul_mode.tf32 = _matmul_mode.tf32, enabled
    try:
        yield
    finally:
        _matmul_mode.tf32 = previous


def _check_dtype(dtype) -> None:
    if dtype not in (None, "float32", np.float32) and np.dtype(dtype) != np.float32:
        raise TypeError(f"needle NDArrays hold float32 only, got dtype {dtype!r}")


def _number(value, what: str) -> float:
    """A scalar operand as a float; a string or an array is refused (float() took "3", where
    numpy's arithmetic refuses strings)."""
    if isinstance(value, str | bytes) or not np.isscalar(value) and np.ndim(value) != 0:
        raise TypeError(f"{what}: expected a number, an array or a list, got "
                        f"{type(value).__name__}")
    return float(value)


def _numeric(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind not in "biuf":
        raise TypeError(f"cannot make a float32 NDArray from numpy dtype {a.dtype}")
    return np.asarray(a, dtype=np.float32, order="C")


@functools.lru_cache(maxsize=4096)
def _compact_strides(shape: Shape) -> Shape:
    stride = 1
    strides = []
    for dim in reversed(shape):
        strides.append(stride)
        stride *= dim
    return tuple(reversed(strides))


def _normalize_axes(axes, ndim: int, what: str) -> tuple[int, ...]:
    if isinstance(axes, int | np.integer):
        axes = (axes,)
    out = []
    for ax in axes:
        ax = int(ax)
        if not -ndim <= ax < ndim:
            raise IndexError(f"{what}: axis {ax} is out of range for {ndim} dimensions")
        out.append(ax % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: repeated axis in {tuple(axes)}")
    return tuple(out)


def _fresh(shape: Shape, device: BackendDevice) -> NDArray:
    """A new compact array with its own (uninitialised) buffer: the hot path of every op."""
    array = object.__new__(NDArray)
    array._shape = shape
    array._strides = _compact_strides(shape)
    array._offset = 0
    array._device = device
    array._handle = device.Array(math.prod(shape))
    array._writes = [0]
    array._compacted = None
    array._is_compact = True
    return array


class NDArray:
    """A float32 strided array on a device."""

    __slots__ = (
        "_shape",
        "_strides",
        "_offset",
        "_device",
        "_handle",
        "_writes",
        "_compacted",
        "_is_compact",
    )

    def __init__(self, other, device: BackendDevice | None = None, dtype: str = "float32"):
        _check_dtype(dtype)
        if isinstance(other, NDArray):
            self._init(other.to(device or other.device) * 1.0)  # a copy; + 0.0 made -0.0 +0.0
            return
        array = _numeric(np.asarray(other))
        device = device or default_device()
        out = NDArray.make(array.shape, device=device)
        device.from_numpy(array, out._handle)
        self._init(out)

    def _init(self, other: NDArray) -> None:
        self._shape = other._shape
        self._strides = other._strides
        self._offset = other._offset
        self._device = other._device
        self._handle = other._handle
        self._writes = other._writes
        self._compacted = None
        self._is_compact = other._is_compact

    @staticmethod
    def make(
        shape: Shape,
        strides: Shape | None = None,
        device: BackendDevice | None = None,
        handle=None,
        offset: int = 0,
        dtype: str = "float32",
    ) -> NDArray:
        """A new array over `handle` (or a fresh buffer) without copying."""
        device = default_device() if device is None else device
        if handle is None:
            if dtype != "float32":
                _check_dtype(dtype)
            array = _fresh(shape, device)
            if strides is not None:
                array._strides, array._is_compact = strides, None
            return array
        array = object.__new__(NDArray)
        array._shape = shape
        array._strides = _compact_strides(shape) if strides is None else strides
        array._offset = offset
        array._device = device
        array._handle = handle
        array._writes = None  # an alias made outside NDArray's views: its writes are not tracked
        array._compacted = None
        array._is_compact = None
        return array

    def _view(self, shape: Shape, strides: Shape | None, offset: int) -> NDArray:
        """Another view of this buffer, sharing its write counter."""
        view = object.__new__(NDArray)
        view._shape = shape
        view._strides = _compact_strides(shape) if strides is None else strides
        view._offset = offset
        view._device = self._device
        view._handle = self._handle
        view._writes = self._writes
        view._compacted = None
        view._is_compact = None
        return view

    def _written(self) -> None:
        if self._writes is not None:
            self._writes[0] += 1

    # ------------------------------------------------------------------ properties
    @property
    def shape(self) -> Shape:
        return self._shape

    @property
    def strides(self) -> Shape:
        return self._strides

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def device(self) -> BackendDevice:
        return self._device

    @property
    def handle(self):
        """The backend buffer this array views (shared by all its views)."""
        return self._handle

    @property
    def dtype(self) -> str:
        return "float32"

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return math.prod(self._shape)

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d array")
        return self._shape[0]

    def __bool__(self) -> bool:
        """numpy's rule: only a one-element array has a truth value."""
        if self.size != 1:
            raise ValueError(f"the truth value of an array of {self.size} elements is "
                             "ambiguous; use .numpy().any() or .numpy().all()")
        return bool(self.numpy().item())

    def __repr__(self) -> str:
        return f"NDArray({self.numpy()!r}, device={self._device})"

    def __str__(self) -> str:
        return str(self.numpy())

    # ------------------------------------------------------------------ data movement
    def numpy(self) -> np.ndarray:
        return self._device.to_numpy(self._handle, self._shape, self._strides, self._offset)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """np.asarray(a): a copy of the data (without this numpy made an object array of
        0-d NDArrays, reading a as a sequence)."""
        if copy is False:
            raise ValueError("an NDArray cannot be viewed by numpy without a copy")
        out = self.numpy()
        return out if dtype is None else out.astype(dtype, copy=False)

    def to(self, device: BackendDevice) -> NDArray:
        if device == self._device:
            return self
        return NDArray(self.numpy(), device=device)

    def fill(self, value: float) -> None:
        """Set every element of this view to value, in place."""
        if self.is_compact():
            self._written()
            self._device.fill(self._handle, float(value))
        else:
            self[...] = value

    def is_compact(self) -> bool:
        """Whether this array is its whole buffer in row-major order (cached: views are fixed)."""
        if self._is_compact is None:
            self._is_compact = (
                self._offset == 0
                and self._strides == _compact_strides(self._shape)
                and math.prod(self._shape) == self._handle.size
            )
        return self._is_compact

    def compact(self) -> NDArray:
        """This array if it already fills its buffer row-major, else a compact copy that no
        other array shares (a copy cached by an earlier read is handed over, not shared)."""
        if self.is_compact():
            return self
        out = self._cached_copy()
        if out is None:
            return self._copy()
        self._compacted = None
        return out

    def _compact_read(self) -> NDArray:
        """compact() for a kernel's input, read once and dropped. The copy is cached on this
        view (views are often read twice: forward and backward) until the buffer or the copy
        is written; callers must never write it or hand it out."""
        if self.is_compact():
            return self
        out = self._cached_copy()
        if out is None:
            out = self._copy()
            if self._writes is not None:
                self._compacted = (self._writes[0], out, 0)
        return out

    def _cached_copy(self) -> NDArray | None:
        cached = self._compacted
        if cached is not None:
            writes, out, out_writes = cached
            if writes == self._writes[0] and out_writes == out._writes[0]:
                return out
        return None

    def _copy(self) -> NDArray:
        out = _fresh(self._shape, self._device)
        if out.size:
            self._device.compact(
                self._handle, out._handle, self._shape, self._strides, self._offset
            )
        return out

    # ------------------------------------------------------------------ views
    def as_strided(self, shape: Shape, strides: Shape) -> NDArray:
        """A view with explicit shape and strides (elements) over the same buffer."""
        shape, strides = _as_shape(shape), tuple(int(s) for s in strides)
        if len(shape) != len(strides):
            raise ValueError(f"as_strided: shape {shape} and strides {strides} differ in length")
        self._check_in_buffer(shape, strides, self._offset)
        return self._view(shape, strides, self._offset)

    def _check_in_buffer(self, shape: Shape, strides: Shape, offset: int) -> None:
        if 0 in shape:
            return
        low = offset + sum((d - 1) * s for d, s in zip(shape, strides, strict=True) if s < 0)
        high = offset + sum((d - 1) * s for d, s in zip(shape, strides, strict=True) if s > 0)
        if low < 0 or high >= self._handle.size:
            raise IndexError(
                f"view shape {shape} strides {strides} offset {offset} reaches outside "
                f"a buffer of {self._handle.size} elements"
            )

    def reshape(self, new_shape) -> NDArray:
        """A view when the data is contiguous, otherwise a reshaped compact copy."""
        new_shape = _int_tuple(new_shape)
        size = self.size
        if -1 in new_shape:
            known = -math.prod(new_shape)
            if new_shape.count(-1) > 1 or known <= 0 or size % known:
                raise ValueError(f"cannot reshape array of shape {self._shape} into {new_shape}")
            new_shape = tuple(size // known if s == -1 else s for s in new_shape)
        if math.prod(new_shape) != size or min(new_shape, default=0) < 0:
            raise ValueError(f"cannot reshape array of shape {self._shape} into {new_shape}")
        source = self if self._strides == _compact_strides(self._shape) else self.compact()
        return source._view(new_shape, None, source._offset)

    def permute(self, new_axes) -> NDArray:
        """Reorder the axes (a view): new axis i is old axis new_axes[i]."""
        axes = tuple(new_axes)
        if sorted(axes) != list(range(self.ndim)):
            axes = _normalize_axes(axes, self.ndim, "permute")
        if len(axes) != self.ndim:
            raise ValueError(f"permute: {tuple(new_axes)} is not a permutation of {self.ndim} axes")
        return self._view(
            tuple(self._shape[a] for a in axes), tuple(self._strides[a] for a in axes), self._offset
        )

    def broadcast_to(self, new_shape) -> NDArray:
        """A view with stride 0 along broadcast axes (numpy rules, leading axes may be added)."""
        new_shape = _as_shape(new_shape)
        if new_shape == self._shape:
            return self
        lead = len(new_shape) - self.ndim
        if lead < 0:
            raise ValueError(f"cannot broadcast shape {self._shape} to {new_shape}")
        strides = [0] * lead
        for old, new, stride in zip(self._shape, new_shape[lead:], self._strides, strict=True):
            if old == new:
                strides.append(stride)
            elif old == 1:
                strides.append(0)
            else:
                raise ValueError(f"cannot broadcast shape {self._shape} to {new_shape}")
        return self._view(new_shape, tuple(strides), self._offset)

    def _view_of(self, idxs) -> NDArray:
        if not isinstance(idxs, tuple):
            idxs = (idxs,)
        ellipses = sum(i is Ellipsis for i in idxs)
        if ellipses > 1:
            raise IndexError(f"an index can only have a single Ellipsis, got {idxs!r}")
        if ellipses:
            at = next(k for k, i in enumerate(idxs) if i is Ellipsis)
            fill = self.ndim - (len(idxs) - 1)
            idxs = idxs[:at] + (slice(None),) * fill + idxs[at + 1 :]
        if len(idxs) > self.ndim:
            raise IndexError(f"too many indices ({len(idxs)}) for an array of shape {self._shape}")
        idxs = idxs + (slice(None),) * (self.ndim - len(idxs))
        shape, strides, offset = [], [], self._offset
        for axis, (idx, dim, stride) in enumerate(
            zip(idxs, self._shape, self._strides, strict=True)
        ):
            if isinstance(idx, slice):
                start, stop, step = idx.indices(dim)
                length = len(range(start, stop, step))
                if length:
                    offset += start * stride
                shape.append(length)
                strides.append(stride * step)
            elif isinstance(idx, int | np.integer) and not isinstance(idx, bool):
                if not -dim <= idx < dim:
                    raise IndexError(
                        f"index {idx} is out of range for axis {axis} of shape {self._shape}"
                    )
                offset += (int(idx) % dim) * stride
            elif idx is None:
                raise TypeError("NDArray index None (a new axis) is not supported; use reshape")
            else:  # a bool too: numpy would add an axis, not pick row 0 or 1
                raise TypeError(
                    f"NDArray index must be int, slice or Ellipsis, got {type(idx).__name__} "
                    f"{idx!r}"
                )
        return self._view(tuple(shape), tuple(strides), offset)

    def __getitem__(self, idxs) -> NDArray:
        """A view: slices keep their axis, integer indices drop it (numpy semantics)."""
        return self._view_of(idxs)

    def __setitem__(self, idxs, other) -> None:
        """numpy's rules: the value broadcasts to the view (leading size-1 axes of it dropped),
        and is checked even when the view is empty."""
        view = self._view_of(idxs)
        other = self._operand(other)
        if isinstance(other, NDArray):
            if other._device is not self._device and other._device != self._device:
                raise ValueError(f"setitem: value on {other.device}, array on {self.device}")
            extra = other.ndim - view.ndim
            if extra > 0 and all(d == 1 for d in other._shape[:extra]):
                other = other._view(other._shape[extra:], other._strides[extra:], other._offset)
            source = other.broadcast_to(view.shape)
            if view.size == 0:
                return
            if any(st == 0 and d > 1 for d, st in zip(view._shape, view._strides, strict=True)):
                # positions of a broadcast view share memory: which value lands is the
                # backend's race (last write on cpu, any on cuda); numpy makes them read-only
                raise ValueError(f"setitem: the target is a broadcast view (shape "
                                 f"{view.shape}, strides {view._strides}): its elements share "
                                 "memory; write into the array it was broadcast from")
            source = source._compact_read()
            if source._handle is self._handle:  # e.g. a[::-1] = a: read everything first
                source = source * 1.0  # a copy that keeps -0.0
            write = functools.partial(self._device.ewise_setitem, source._handle)
        else:
            value = float(other)  # numpy's rule: a[...] = "3" is 3.0
            if view.size == 0:
                return
            write = functools.partial(self._device.scalar_setitem, view.size, value)
        try:
            write(self._handle, view._shape, view._strides, view._offset)
        finally:  # counted after the read: a copy cached while reading other is stale now
            self._written()

    # ------------------------------------------------------------------ elementwise
    def _operand(self, other):
        """A numpy array (other than 0-d) or a list as an NDArray on this device; anything else
        as is."""
        if isinstance(other, list):
            other = np.asarray(other)
        if isinstance(other, np.ndarray) and other.ndim:
            return NDArray(other, device=self._device)
        return other

    def _binary(self, other, ewise, scalar, name: str) -> NDArray:
        out = _fresh(self._shape, self._device)
        other = self._operand(other)
        if isinstance(other, NDArray):
            if other._shape != self._shape:
                raise ValueError(f"{name}: shapes {self._shape} and {other._shape} differ")
            if other._device is not self._device and other._device != self._device:
                raise ValueError(f"{name}: arrays on {self._device} and {other._device}")
            ewise(self._compact_read()._handle, other._compact_read()._handle, out._handle)
        else:
            scalar(self._compact_read()._handle, _number(other, name), out._handle)
        return out

    def _unary(self, fn) -> NDArray:
        out = _fresh(self._shape, self._device)
        fn(self._compact_read()._handle, out._handle)
        return out

    def __add__(self, other) -> NDArray:
        return self._binary(other, self._device.ewise_add, self._device.scalar_add, "add")

    __radd__ = __add__

    def __sub__(self, other) -> NDArray:
        return self + (-self._operand(other))

    def __rsub__(self, other) -> NDArray:
        return (-self) + other

    def __mul__(self, other) -> NDArray:
        return self._binary(other, self._device.ewise_mul, self._device.scalar_mul, "multiply")

    __rmul__ = __mul__

    def __truediv__(self, other) -> NDArray:
        return self._binary(other, self._device.ewise_div, self._device.scalar_div, "divide")

    def __rtruediv__(self, other) -> NDArray:
        """other / self as one division (as (1 / self) * other it rounded twice, unlike numpy)."""
        other = self._operand(other)
        if isinstance(other, NDArray):
            return other / self
        numerator = _fresh(self._shape, self._device)
        self._device.fill(numerator._handle, float(other))
        return numerator / self

    def __neg__(self) -> NDArray:
        return self * (-1.0)

    def __pow__(self, other) -> NDArray:
        return self._binary(other, self._device.ewise_pow, self._device.scalar_power, "power")

    def maximum(self, other) -> NDArray:
        return self._binary(
            other, self._device.ewise_maximum, self._device.scalar_maximum, "maximum"
        )

    def __eq__(self, other) -> NDArray:  # type: ignore[override]
        return self._binary(other, self._device.ewise_eq, self._device.scalar_eq, "eq")

    def __ge__(self, other) -> NDArray:
        return self._binary(other, self._device.ewise_ge, self._device.scalar_ge, "ge")

    def __ne__(self, other) -> NDArray:  # type: ignore[override]
        return 1 - (self == other)

    def __gt__(self, other) -> NDArray:
        return (self >= other) * (self != other)

    def __lt__(self, other) -> NDArray:  # as -a > -b: false where either is NaN, like >
        return (-self) > (-self._operand(other))

    def __le__(self, other) -> NDArray:
        return (-self) >= (-self._operand(other))

    __hash__ = None  # type: ignore[assignment]
    __array_ufunc__ = None  # numpy scalars on the left defer to NDArray's reflected operators

    def log(self) -> NDArray:
        return self._unary(self._device.ewise_log)

    def exp(self) -> NDArray:
        return self._unary(self._device.ewise_exp)

    def tanh(self) -> NDArray:
        return self._unary(self._device.ewise_tanh)

    def sqrt(self) -> NDArray:
        return self._unary(self._device.ewise_sqrt)

    # ------------------------------------------------------------------ matmul
    def __matmul__(self, other: NDArray) -> NDArray:
        """Matrix product; leading (batch) axes broadcast like numpy.matmul."""
        other = self._operand(other)
        if not isinstance(other, NDArray):
            raise TypeError(f"matmul: operand must be an NDArray, got {type(other).__name__}")
        if self.ndim < 2 or other.ndim < 2:
            raise ValueError(f"matmul needs >= 2-D operands, got {self._shape} @ {other._shape}")
        if other._device is not self._device and other._device != self._device:
            raise ValueError(f"matmul: arrays on {self._device} and {other._device}")
        (m, n), (n2, p) = self._shape[-2:], other._shape[-2:]
        if n != n2:
            raise ValueError(f"matmul: inner dimensions differ in {self._shape} @ {other._shape}")
        if self.ndim == 2 and other.ndim == 2:
            return self._matmul_2d(other)
        try:
            batch = np.broadcast_shapes(self._shape[:-2], other._shape[:-2])
        except ValueError:
            raise ValueError(
                f"matmul: batch dimensions of {self._shape} and {other._shape} do not broadcast"
            ) from None
        if other.ndim == 2:  # one weight for every batch row: a single 2-D product
            flat = self.broadcast_to(batch + (m, n)).reshape((math.prod(batch) * m, n))
            return flat._matmul_2d(other).reshape(batch + (m, p))
        a = self.broadcast_to(batch + (m, n))
        b = other.broadcast_to(batch + (n, p))
        out = NDArray.make(batch + (m, p), device=self._device)
        for index in np.ndindex(*batch):
            out[index] = a[index]._matmul_2d(b[index])
        return out

    def _matmul_2d(self, other: NDArray) -> NDArray:
        (m, n), p = self._shape, other._shape[1]
        out = _fresh((m, p), self._device)
        if m * p == 0:
            return out
        if n == 0:
            out.fill(0.0)
            return out
        device = self._device
        tf32 = _matmul_mode.tf32 and "matmul_tf32" in device.__dict__
        matmul = device.matmul_tf32 if tf32 else device.matmul
        matmul(self._compact_read()._handle, other._compact_read()._handle, out._handle, m, n, p)
        return out

    # ------------------------------------------------------------------ reductions
    def _reduce(self, axis, keepdims: bool, fn, name: str) -> NDArray:
        axes = tuple(range(self.ndim)) if axis is None else _normalize_axes(axis, self.ndim, name)
        kept = tuple(i for i in range(self.ndim) if i not in axes)
        out_shape = tuple(self._shape[i] for i in kept)
        reduce_size = math.prod(self._shape[i] for i in axes)
        out = _fresh(out_shape, self._device)
        if reduce_size == 0:
            if name == "max":
                raise ValueError(f"max of an empty axis in shape {self._shape}")
            out.fill(0.0)
        elif out.size:
            order = kept + tuple(sorted(axes))
            if order == tuple(range(self.ndim)):  # reduced axes already trailing
                fn(self._compact_read()._handle, out._handle, reduce_size)
            elif name == "sum" and kept == tuple(range(len(axes), self.ndim)):
                # Leading axes (a batch, N*H*W of NHWC): ones(1, R) @ x(R, C) reads x in
                # place, where reduce_sum would first need a transposed copy of x.
                rows = self.reshape((reduce_size, out.size))
                ones = _fresh((1, reduce_size), self._device)
                self._device.fill(ones._handle, 1.0)
                rows = rows._compact_read()
                self._device.matmul(
                    ones._handle, rows._handle, out._handle, 1, reduce_size, out.size
                )
            else:
                fn(self.permute(order)._compact_read()._handle, out._handle, reduce_size)
        if keepdims:
            kept_shape = tuple(1 if i in axes else d for i, d in enumerate(self._shape))
            out = out._view(kept_shape, None, 0)
        return out

    def sum(self, axis=None, keepdims: bool = False) -> NDArray:
        return self._reduce(axis, keepdims, self._device.reduce_sum, "sum")

    def max(self, axis=None, keepdims: bool = False) -> NDArray:
        return self._reduce(axis, keepdims, self._device.reduce_max, "max")

    # ------------------------------------------------------------------ shape utilities
    def flip(self, axes) -> NDArray:
        """A compact copy reversed along axes (read through negative strides)."""
        axes = _normalize_axes(tuple(range(self.ndim)) if axes is None else axes, self.ndim, "flip")
        offset = self._offset
        strides = list(self._strides)
        for ax in axes:
            if self._shape[ax]:
                offset += (self._shape[ax] - 1) * strides[ax]
            strides[ax] = -strides[ax]
        view = self._view(self._shape, tuple(strides), offset)
        return view._copy()  # a copy even for no axes: never this array's buffer

    def pad(self, axes: Sequence[tuple[int, int]]) -> NDArray:
        """A zero-padded copy; axes[i] = (before, after) for axis i."""
        if len(axes) != self.ndim or any(lo < 0 or hi < 0 for lo, hi in axes):
            raise ValueError(f"pad: need one (before, after) >= 0 per axis of {self._shape}")
        out = self._device.zeros(
            tuple(d + lo + hi for d, (lo, hi) in zip(self._shape, axes, strict=True))
        )
        out[tuple(slice(lo, lo + d) for d, (lo, _) in zip(self._shape, axes, strict=True))] = self
        return out


def array(a, dtype: str = "float32", device: BackendDevice | None = None) -> NDArray:
    return NDArray(a, device=device, dtype=dtype)


def empty(shape, dtype: str = "float32", device: BackendDevice | None = None) -> NDArray:
    return (device or default_device()).empty(shape, dtype)


def full(shape, fill_value: float, dtype: str = "float32", device=None) -> NDArray:
    return (device or default_device()).full(shape, fill_value, dtype)
