"""Reference backend in pure numpy: the same primitives as the C++ and CUDA modules.

Every function takes flat float32 `Array` buffers plus (shape, strides, offset) in
elements, exactly like the compiled backends, so NDArray's view logic is shared.
"""

import numpy as np

__device_name__ = "numpy"
__tile_size__ = 1

_ITEMSIZE = 4


class Array:
    """A flat buffer of `size` float32 elements."""

    __slots__ = ("array",)

    def __init__(self, size: int):
        if size < 0:
            raise ValueError(f"Array size must be >= 0, got {size}")
        self.array = np.empty(size, dtype=np.float32)

    @property
    def size(self) -> int:
        return self.array.size

    def ptr(self) -> int:
        return self.array.ctypes.data


def _strided(a: Array, shape, strides, offset: int) -> np.ndarray:
    """The strided view (shape, strides, offset) of a's buffer, without copying.

    numpy checks that the view stays inside the buffer (ValueError otherwise). An empty view
    touches no element, so its offset may lie anywhere (a[:, 1] of a (2, 0, 3) array is at
    offset 1 of an empty buffer), as the C++ and CUDA backends accept.
    """
    if 0 in tuple(shape):
        return np.empty(tuple(shape), np.float32)
    return np.ndarray(
        tuple(shape),
        np.float32,
        a.array,
        offset * _ITEMSIZE,
        tuple(s * _ITEMSIZE for s in strides),
    )


def _check_sizes(out: Array, *inputs: Array) -> None:
    for x in inputs:
        if x.array.size != out.array.size:
            raise ValueError(f"buffer sizes differ: {x.array.size} and {out.array.size}")


def fill(out: Array, val: float) -> None:
    with np.errstate(all="ignore"):  # past float32's range: inf, quietly, as in C++
        out.array.fill(val)


def from_numpy(a: np.ndarray, out: Array) -> None:
    if a.size != out.array.size:
        raise ValueError(f"from_numpy: {a.size} elements into a buffer of {out.array.size}")
    out.array[:] = a.reshape(-1)


def to_numpy(a: Array, shape, strides, offset: int) -> np.ndarray:
    return np.array(_strided(a, shape, strides, offset), dtype=np.float32)


def compact(a: Array, out: Array, shape, strides, offset: int) -> None:
    np.copyto(out.array.reshape(shape), _strided(a, shape, strides, offset))


def ewise_setitem(a: Array, out: Array, shape, strides, offset: int) -> None:
    _strided(out, shape, strides, offset)[...] = a.array.reshape(shape)


def scalar_setitem(size: int, val: float, out: Array, shape, strides, offset: int) -> None:
    with np.errstate(all="ignore"):
        _strided(out, shape, strides, offset)[...] = val


def _ewise(fn):
    def op(a: Array, b: Array, out: Array) -> None:
        _check_sizes(out, a, b)
        with np.errstate(all="ignore"):  # inf and NaN as IEEE gives them, as the C++ does
            fn(a.array, b.array, out=out.array)

    op.__name__ = fn.__name__
    return op


def _scalar(fn):
    def op(a: Array, val: float, out: Array) -> None:
        _check_sizes(out, a)
        with np.errstate(all="ignore"):
            fn(a.array, np.float32(val), out=out.array)

    op.__name__ = fn.__name__
    return op


def _unary(fn):
    def op(a: Array, out: Array) -> None:
        _check_sizes(out, a)
        with np.errstate(all="ignore"):
            fn(a.array, out=out.array)

    op.__name__ = fn.__name__
    return op


def _equal(x, y, out):
    np.copyto(out, np.equal(x, y))


def _greater_equal(x, y, out):
    np.copyto(out, np.greater_equal(x, y))


ewise_add = _ewise(np.add)
ewise_mul = _ewise(np.multiply)
ewise_div = _ewise(np.divide)
ewise_pow = _ewise(np.power)
ewise_maximum = _ewise(np.maximum)
ewise_eq = _ewise(_equal)
ewise_ge = _ewise(_greater_equal)

scalar_add = _scalar(np.add)
scalar_mul = _scalar(np.multiply)
scalar_div = _scalar(np.divide)
scalar_power = _scalar(np.power)
scalar_maximum = _scalar(np.maximum)
scalar_eq = _scalar(_equal)
scalar_ge = _scalar(_greater_equal)

ewise_log = _unary(np.log)
ewise_exp = _unary(np.exp)
ewise_tanh = _unary(np.tanh)
ewise_sqrt = _unary(np.sqrt)


def matmul(a: Array, b: Array, out: Array, m: int, n: int, p: int) -> None:
    if a.array.size != m * n or b.array.size != n * p or out.array.size != m * p:
        raise ValueError(
            f"matmul: buffers of {a.array.size}, {b.array.size}, {out.array.size} elements "
            f"do not fit m={m}, n={n}, p={p}"
        )
    with np.errstate(all="ignore"):  # inf and NaN as IEEE gives them, as in C++
        if m == 1:  # sums over leading axes (ones(1, R) @ x): added in double, as in C++
            out.array[:] = a.array.astype(np.float64) @ b.array.reshape(n, p).astype(np.float64)
        else:
            np.matmul(a.array.reshape(m, n), b.array.reshape(n, p), out=out.array.reshape(m, p))


def _groups(a: Array, out: Array, reduce_size: int) -> np.ndarray:
    if reduce_size < 1 or a.array.size != out.array.size * reduce_size:
        raise ValueError(
            f"reduce: {a.array.size} elements are not {out.array.size} groups of {reduce_size}"
        )
    return a.array.reshape(out.array.size, reduce_size)


def reduce_sum(a: Array, out: Array, reduce_size: int) -> None:
    groups = _groups(a, out, reduce_size)
    with np.errstate(all="ignore"):  # a float32 overflow is inf, silently, as in C++
        if reduce_size <= 256:  # numpy's sum is slow on many short rows; a BLAS gemv is not
            np.matmul(groups, np.ones(reduce_size, dtype=np.float32), out=out.array)
        else:  # long rows: numpy's pairwise summation, more accurate than one running sum
            np.sum(groups, axis=1, out=out.array)


def reduce_max(a: Array, out: Array, reduce_size: int) -> None:
    np.max(_groups(a, out, reduce_size), axis=1, out=out.array)
