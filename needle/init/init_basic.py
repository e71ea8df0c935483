"""Basic random and constant tensors; randomness comes from numpy's global generator via the
device, so `np.random.seed` makes every initialiser reproducible."""
import needle as ndl
from needle.backend_ndarray.ndarray import _star_shape


def _device(device):
    """Default to the device Tensor(...) uses, so layers and inputs made without one agree."""
    return ndl.default_device() if device is None else device


def rand(*shape, low=0.0, high=1.0, device=None, dtype="float32", requires_grad=False):
    """Uniform samples in [low, high)."""
    device = _device(device)
    array = device.rand(*shape, dtype=dtype) * (high - low) + low
    return ndl.Tensor(array, device=device, dtype=dtype, requires_grad=requires_grad)


def randn(*shape, mean=0.0, std=1.0, device=None, dtype="float32", requires_grad=False):
    """Gaussian samples with the given mean and standard deviation."""
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
