"""Convolution and pooling over NCHW images (the course's layout; ops.conv itself is NHWC)."""
import math

from needle import init, ops
from needle.autograd import Tensor

from .nn_basic import Module, Parameter, check_positive_ints, check_shape

__all__ = [
    "Conv",
    "MaxPool2d",
    "AvgPool2d",
]


def _square(name: str, value):
    """(k, k) as k: only square kernels and equal strides are supported, and taking the first
    entry as CMU's Conv does turned (3, 5) silently into a 3x3 kernel."""
    if not isinstance(value, tuple):
        return value
    if len(value) != 2 or value[0] != value[1]:
        raise ValueError(f"Conv: {name} must be one int or a pair of equal ints, got {value!r}")
    return value[0]


class Conv(Module):
    """2-D convolution with 'same' padding (kernel_size // 2) and an optional bias."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, bias=True,
                 device=None, dtype="float32"):
        super().__init__()
        kernel_size, stride = _square("kernel_size", kernel_size), _square("stride", stride)
        check_positive_ints(self, in_channels=in_channels, out_channels=out_channels,
                            kernel_size=kernel_size, stride=stride)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel_size
        self.stride = stride
        k2 = kernel_size * kernel_size
        self.weight = Parameter(init.kaiming_uniform(
            in_channels * k2, out_channels * k2,
            shape=(kernel_size, kernel_size, in_channels, out_channels),
            device=device, dtype=dtype,
        ))
        self.bias = None
        if bias:
            bound = 1.0 / math.sqrt(in_channels * k2)
            self.bias = Parameter(
                init.rand(out_channels, low=-bound, high=bound, device=device, dtype=dtype)
            )

    def forward(self, x: Tensor) -> Tensor:
        check_shape(self, x, 4, {1: self.in_channels})
        nhwc = x.transpose((1, 2)).transpose((2, 3))
        out = ops.conv(nhwc, self.weight, stride=self.stride, padding=self.kernel_size // 2)
        if self.bias is not None:
            out = out + ops.broadcast_to(self.bias.reshape((1, 1, 1, self.out_channels)), out.shape)
        return out.transpose((2, 3)).transpose((1, 2))


class _Pool2d(Module):
    """Pooling over k x k windows taken every `stride` pixels (default stride = k), no padding."""

    def __init__(self, kernel_size: int, stride: int | None = None):
        super().__init__()
        stride = kernel_size if stride is None else stride
        check_positive_ints(self, kernel_size=kernel_size, stride=stride)
        self.kernel_size = kernel_size
        self.stride = stride

    def reduce(self, x: Tensor, axis: int) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        if len(x.shape) != 4:
            raise ValueError(f"{type(self).__name__} expects NCHW input, got {tuple(x.shape)}")
        n, c, h, w = x.shape
        k, s = self.kernel_size, self.stride
        if h < k or w < k:
            raise ValueError(f"{type(self).__name__}: window {k} is larger than image {h}x{w}")
        ho, wo = (h - k) // s + 1, (w - k) // s + 1
        if s == k and (h, w) == (ho * k, wo * k):
            # windows tile the image exactly: a reshape instead of k*k strided copies
            tiles = x.reshape((n, c, ho, k, wo, k))
            return self.reduce(self.reduce(tiles, 5), 3)
        views = [
            x[:, :, i : i + s * (ho - 1) + 1 : s, j : j + s * (wo - 1) + 1 : s]
            for i in range(k) for j in range(k)
        ]
        return self.reduce(ops.stack(views, 0), 0)


class MaxPool2d(_Pool2d):
    def reduce(self, x: Tensor, axis: int) -> Tensor:
        return ops.max(x, axes=(axis,))


class AvgPool2d(_Pool2d):
    def reduce(self, x: Tensor, axis: int) -> Tensor:
        return ops.summation(x, axes=(axis,)) / x.shape[axis]
