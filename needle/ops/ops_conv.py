"""Convolution and the ops its gradient is built from (flip, dilate, undilate).

Its products (im2col @ kernel, and the kernel gradient's) go through MatMul.compute, so remote
offload sees a CNN's convolutions as it sees its linear layers."""

from __future__ import annotations

from numbers import Integral

from ..autograd import NDArray, Tensor, TensorOp
from ..backend_ndarray.ndarray import _normalize_axes
from .ops_mathematic import MatMul
from .ops_shape import getitem, scatter_into_zeros, transpose

_MATMUL = MatMul()

__all__ = [
    "Flip",
    "flip",
    "Dilate",
    "dilate",
    "UnDilate",
    "undilate",
    "Conv",
    "conv",
    "ConvKernelGrad",
]


class Flip(TensorOp):
    def __init__(self, axes):
        self.axes = axes

    def compute(self, a: NDArray) -> NDArray:
        return a.flip(self.axes)

    def gradient(self, out_grad, node):
        return flip(out_grad, self.axes)


def flip(a: Tensor, axes) -> Tensor:
    return Flip(axes)(a)


def _dilated_index(shape, axes, dilation: int) -> tuple[slice, ...]:
    """Index of the original entries inside the dilated array (every dilation+1-th)."""
    axes = _normalize_axes(axes, len(shape), "dilate")
    return tuple(
        slice(None, None, dilation + 1) if i in axes else slice(None) for i in range(len(shape))
    )


class _DilationOp(TensorOp):
    """Shared by Dilate and UnDilate: the axes and the number of zeros between entries."""

    def __init__(self, axes, dilation: int):
        if dilation < 0:
            raise ValueError(f"dilation must be >= 0, got {dilation}")
        self.axes = axes
        self.dilation = dilation


class Dilate(_DilationOp):
    """Insert `dilation` zeros after every entry along axes (size d -> d * (dilation + 1))."""

    def compute(self, a: NDArray) -> NDArray:
        index = _dilated_index(a.shape, self.axes, self.dilation)
        stretched = tuple(
            d * (self.dilation + 1) if s.step else d for d, s in zip(a.shape, index, strict=True)
        )
        out = a.device.zeros(stretched)
        out[index] = a
        return out

    def gradient(self, out_grad, node):
        return undilate(out_grad, self.axes, self.dilation)


def dilate(a: Tensor, axes, dilation: int) -> Tensor:
    return Dilate(axes, dilation)(a)


class UnDilate(_DilationOp):
    """Keep every (dilation + 1)-th entry along axes: the inverse of dilate."""

    def compute(self, a: NDArray) -> NDArray:
        return a[_dilated_index(a.shape, self.axes, self.dilation)]

    def gradient(self, out_grad, node):
        grad = dilate(out_grad, self.axes, self.dilation)
        if grad.shape == node.inputs[0].shape:
            return grad
        return getitem(grad, tuple(slice(0, d) for d in node.inputs[0].shape))


def undilate(a: Tensor, axes, dilation: int) -> Tensor:
    return UnDilate(axes, dilation)(a)


def _im2col(a: NDArray, kh: int, kw: int, stride: int, padding: int):
    """Every (kh, kw) window of the padded NHWC input as one row: (N*H_out*W_out, kh*kw*C).

    Built as a strided view over the padded input and compacted once.
    """
    if padding:
        a = a.pad(((0, 0), (padding, padding), (padding, padding), (0, 0)))
    n, h, w, c = a.shape
    if kh > h or kw > w:
        raise ValueError(f"conv kernel ({kh}, {kw}) larger than padded input {a.shape}")
    h_out, w_out = (h - kh) // stride + 1, (w - kw) // stride + 1
    sn, sh, sw, sc = a.strides
    windows = a.as_strided((n, h_out, w_out, kh, kw, c), (sn, sh * stride, sw * stride, sh, sw, sc))
    return windows.compact().reshape((n * h_out * w_out, kh * kw * c)), (n, h_out, w_out)


class Conv(TensorOp):
    """2-D convolution: NHWC input, (K, K, C_in, C_out) kernel, im2col + one matmul."""

    def __init__(self, stride: int = 1, padding: int = 0):
        """Both must be ints: a float one would fail deep in as_strided or pad."""
        if not isinstance(stride, Integral) or not isinstance(padding, Integral):
            raise ValueError(f"conv needs an int stride and padding, got {stride!r}, {padding!r}")
        if stride < 1 or padding < 0:
            raise ValueError(f"conv needs stride >= 1 and padding >= 0, got {stride}, {padding}")
        self.stride = stride
        self.padding = padding

    def compute(self, a: NDArray, b: NDArray) -> NDArray:
        if a.ndim != 4 or b.ndim != 4 or a.shape[3] != b.shape[2]:
            raise ValueError(
                f"conv needs input (N, H, W, C_in) and kernel (K, K, C_in, C_out), "
                f"got {a.shape} and {b.shape}"
            )
        kh, kw, c_in, c_out = b.shape
        cols, out_shape = _im2col(a, kh, kw, self.stride, self.padding)
        out = _MATMUL.compute(cols, b.compact().reshape((kh * kw * c_in, c_out)))
        return out.reshape(out_shape + (c_out,))

    def gradient(self, out_grad, node):
        a, b = node.inputs
        grad_a = _conv_input_grad(out_grad, b, a.shape, self.stride, self.padding)
        grad_b = ConvKernelGrad(self.stride, self.padding, b.shape[:2])(a, out_grad)
        return grad_a, grad_b


def conv(a: Tensor, b: Tensor, stride: int = 1, padding: int = 0) -> Tensor:
    return Conv(stride, padding)(a, b)


def _conv_input_grad(out_grad: Tensor, kernel: Tensor, input_shape, stride: int, padding: int):
    """d conv(a, kernel) / d a applied to out_grad: a full correlation with the flipped kernel."""
    kh, kw = kernel.shape[:2]
    h, w = input_shape[1] + 2 * padding, input_shape[2] + 2 * padding
    # As a stride-1 problem: out_grad spread back onto the full (h-kh+1, w-kw+1) grid.
    grad = out_grad
    if stride > 1:
        grad = dilate(grad, (1, 2), stride - 1)
        grad = getitem(grad, (slice(None), slice(0, h - kh + 1), slice(0, w - kw + 1)))
    flipped = transpose(flip(kernel, (0, 1)), (2, 3))
    if kh == kw and padding <= kh - 1:
        return conv(grad, flipped, padding=kh - 1 - padding)
    n, hf, wf, c_out = grad.shape
    full = (n, hf + 2 * (kh - 1), wf + 2 * (kw - 1), c_out)
    inner = (slice(None), slice(kh - 1, kh - 1 + hf), slice(kw - 1, kw - 1 + wf))
    grad_a = conv(scatter_into_zeros(grad, full, inner), flipped)
    if padding:
        grad_a = getitem(
            grad_a, (slice(None), slice(padding, h - padding), slice(padding, w - padding))
        )
    return grad_a


class ConvKernelGrad(TensorOp):
    """d conv(a, kernel) / d kernel applied to out_grad: out_grad^T @ im2col(a), reshaped.

    Bilinear in (a, out_grad), so its own gradient is again a conv and a conv input-gradient.
    """

    def __init__(self, stride: int, padding: int, kernel_size: tuple[int, int]):
        self.stride = stride
        self.padding = padding
        self.kernel_size = tuple(kernel_size)

    def compute(self, a: NDArray, out_grad: NDArray) -> NDArray:
        kh, kw = self.kernel_size
        cols, (n, h_out, w_out) = _im2col(a, kh, kw, self.stride, self.padding)
        c_out = out_grad.shape[3]
        grad_rows = out_grad.reshape((n * h_out * w_out, c_out)).permute((1, 0))
        kernel_grad = _MATMUL.compute(grad_rows, cols).reshape((c_out, kh, kw, a.shape[3]))
        return kernel_grad.permute((1, 2, 3, 0))

    def gradient(self, out_grad, node):
        a, grad = node.inputs
        return (
            _conv_input_grad(grad, out_grad, a.shape, self.stride, self.padding),
            conv(a, out_grad, self.stride, self.padding),
        )
