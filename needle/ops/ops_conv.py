"""Convolution and the ops its gradient is built from (flip, dilate, undilate)."""

from __future__ import annotations

from ..autograd import NDArray, Tensor, TensorOp
from ..backend_ndarray.ndarray import _normalize_axes
from .ops_shape import getitem, scatter_into_zeros, transpose


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


class Dilate(TensorOp):
    """Insert `dilation` zeros after every entry along axes (size d -> d * (dilation + 1))."""

    def __init__(self, axes, dilation: int):
        if dilation < 0:
            raise ValueError(f"dilation must be >= 0, got {dilation}")
        self.axes = axes
        self.dilation = dilation

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


class UnDilate(TensorOp):
    """Keep every (dilation + 1)-th entry along axes: the inverse of dilate."""

    def __init__(self, axes, dilation: int):
        if dilation < 0:
            raise ValueError(f"dilation must be >= 0, got {dilation}")
        self.axes = axes
        self.dilation = dilation

    def compute(self, a: NDArray) -> NDArray:
        return a[_dilated_index(a.shape, self.axes, self.dilation)]

    def gradient(self, out_grad, node):
        grad = dilate(out_grad, self.axes, self.dilation)
        if grad.shape == node.inputs[0].shape:
            return grad
        return getitem(grad, tuple(slice(0, d) for d in node.inputs[0].shape))


def undilate(a: Tensor, axes, dilation: int) -> Tensor:
    return UnDilate(axes, dilation)(a)


class Conv(TensorOp):
    """2-D convolution: NHWC input, (K, K, C_in, C_out) kernel, im2col + one matmul."""

    def __init__(self, stride: int = 1, padding: int = 0):
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
        p, s = self.padding, self.stride
        if p:
            a = a.pad(((0, 0), (p, p), (p, p), (0, 0)))
        n, h, w, c_in = a.shape
        kh, kw, _, c_out = b.shape
        if kh > h or kw > w:
            raise ValueError(f"conv kernel {b.shape} larger than padded input {a.shape}")
        h_out, w_out = (h - kh) // s + 1, (w - kw) // s + 1
        sn, sh, sw, sc = a.strides
        cols = a.as_strided((n, h_out, w_out, kh, kw, c_in), (sn, sh * s, sw * s, sh, sw, sc))
        cols = cols.compact().reshape((n * h_out * w_out, kh * kw * c_in))
        out = cols @ b.compact().reshape((kh * kw * c_in, c_out))
        return out.reshape((n, h_out, w_out, c_out))

    def gradient(self, out_grad, node):
        a, b = node.inputs
        kh, kw = b.shape[:2]
        h, w = a.shape[1] + 2 * self.padding, a.shape[2] + 2 * self.padding
        # As a stride-1 problem: out_grad spread back onto the full (h-kh+1, w-kw+1) grid.
        grad = out_grad
        if self.stride > 1:
            grad = dilate(grad, (1, 2), self.stride - 1)
            grad = getitem(grad, (slice(None), slice(0, h - kh + 1), slice(0, w - kw + 1)))
        # d input: full correlation of grad with the flipped kernel, minus the padding.
        kernel = transpose(flip(b, (0, 1)), (2, 3))
        p = self.padding
        if kh == kw and p <= kh - 1:
            grad_a = conv(grad, kernel, padding=kh - 1 - p)
        else:
            n, hf, wf, c_out = grad.shape
            full = (n, hf + 2 * (kh - 1), wf + 2 * (kw - 1), c_out)
            inner = (slice(None), slice(kh - 1, kh - 1 + hf), slice(kw - 1, kw - 1 + wf))
            grad_a = conv(scatter_into_zeros(grad, full, inner), kernel)
            if p:
                grad_a = getitem(grad_a, (slice(None), slice(p, h - p), slice(p, w - p)))
        # d kernel: correlate the (padded) input with grad, batch and channel axes swapped.
        a_t = transpose(a, (0, 3))
        grad_t = transpose(transpose(grad, (0, 1)), (1, 2))
        grad_b = conv(a_t, grad_t, padding=self.padding)
        grad_b = transpose(transpose(grad_b, (0, 1)), (1, 2))
        return grad_a, grad_b


def conv(a: Tensor, b: Tensor, stride: int = 1, padding: int = 0) -> Tensor:
    return Conv(stride, padding)(a, b)
