"""Basic random and constant tensors; randomness comes from numpy's global generator via the
device, so `np.random.seed` makes every initialiser reproducible."""
import math
import numbers

import numpy as np

import needle as ndl
from needle.backend_ndarray.ndarray import _star_shape


def check_number(name: str, value: float, low: float = -math.inf, high: float = math.inf,
                 low_open: bool = False, high_open: bool = True) -> None:
    """Refuse a setting that is not a finite real number in [low, high) (the flags open or close
    either end): NaN compares false and would pass a bare `value < high`, and True is an int.
    The one check behind initialiser arguments and optimiser settings, so each names the
    setting the same way wherever it is given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, not {type(value).__name__}: {value!r}")
    above = low < value if low_open else low <= value
    below = value < high if high_open else value <= high
    if not (math.isfinite(value) and above and below):
        left = "(" if low_open or low == -math.inf else "["
        right = ")" if high_open or high == math.inf else "]"
        raise ValueError(f"{name} must lie in {left}{low}, {high}{right}, got {value}")


def _device(device):
    """Default to the device Tensor(...) uses, so layers and inputs made without one agree."""
    return ndl.default_device() if device is None else device


def rand(*shape, low=0.0, high=1.0, device=None, dtype="float32", requires_grad=False):
    """Uniform samples in [low, high)."""
    check_number("low", low)
    check_number("high", high, low, high_open=False)  # low == high: the constant low
    device = _device(device)
    array = device.rand(*shape, dtype=dtype) * (high - low) + low
    top = _below(high)  # float32 rounding can land a draw on high itself
    if high > low and top >= low:
        array = -((-array).maximum(-top))
    return ndl.Tensor(array, device=device, dtype=dtype, requires_grad=requires_grad)


def _below(high: float) -> float:
    """The largest float32 below high."""
    top = np.float32(high)
    return float(top if top < high else np.nextafter(top, np.float32(-np.inf)))


def randn(*shape, mean=0.0, std=1.0, device=None, dtype="float32", requires_grad=False):
    """Gaussian samples with the given mean and standard deviation."""
    check_number("mean", mean)
    check_number("std", std, 0.0)  # NaN would fill the tensor with NaN
    device = _device(device)
    array = device.randn(*shape, dtype=dtype) * std + mean
    return ndl.Tensor(array, device=device, dtype=dtype, requires_grad=requires_grad)


uniform = rand  # the common name for CMU needle's `rand`
normal = randn  # the common name for CMU needle's `randn`


def constant(*shape, c=1.0, device=None, dtype="float32", requires_grad=False):
    """A tensor filled with c; like rand, takes constant(2, 3) or constant((2, 3))."""
    device = _device(device)
    array = device.full(_star_shape(shape), c, dtype=dtype)
    return ndl.Tensor(array, device=device, dtype=dtype, requires_grad=requires_grad)


def ones(*shape, device=None, dtype="float32", requires_grad=False):
    return constant(*shape, c=1.0, device=device, dtype=dtype, requires_grad=requires_grad)


def zeros(*shape, device=None, dtype="float32", requires_grad=False):
    return constant(*shape, c=0.0, device=device, dtype=dtype, requires_grad=requires_grad)


def randb(*shape, p=0.5, device=None, dtype="float32", requires_grad=False):
    """Bernoulli(p) samples as 0.0/1.0 (1 with probability p), e.g. dropout masks."""
    check_number("p", p, 0.0, 1.0, high_open=False)  # NaN would give all zeros, 1.5 all ones
    device = _device(device)
    array = device.rand(*shape) <= p
    return ndl.Tensor(array, device=device, dtype=dtype, requires_grad=requires_grad)


def one_hot(n, i, device=None, dtype="float32", requires_grad=False):
    """Rows of the n x n identity selected by the integer labels i (a Tensor, array or list).
    Labels arrive as float32 Tensors, so a fractional one is refused, not truncated to a row."""
    device = _device(device)
    return ndl.Tensor(
        device.one_hot(n, i, dtype=dtype),  # it refuses fractional labels
        device=device,
        dtype=dtype,
        requires_grad=requires_grad,
    )


def zeros_like(array, *, device=None, requires_grad=False):
    device = device if device else array.device
    return zeros(*array.shape, dtype=array.dtype, device=device, requires_grad=requires_grad)


def ones_like(array, *, device=None, requires_grad=False):
    device = device if device else array.device
    return ones(*array.shape, dtype=array.dtype, device=device, requires_grad=requires_grad)
