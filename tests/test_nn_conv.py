"""Conv and pooling layers against direct numpy loops and finite differences."""
import numpy as np
import pytest
from helpers import numeric_grad, tensor

from needle import nn


def conv_reference(x, w, b, stride):
    """NCHW x, (K, K, C_in, C_out) w, 'same' zero padding K // 2, written as plain loops."""
    n, c_in, h, wd = x.shape
    k, c_out, p = w.shape[0], w.shape[3], w.shape[0] // 2
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    h_out, w_out = (h + 2 * p - k) // stride + 1, (wd + 2 * p - k) // stride + 1
    out = np.zeros((n, c_out, h_out, w_out))
    for i in range(h_out):
        for j in range(w_out):
            patch = xp[:, :, i * stride : i * stride + k, j * stride : j * stride + k]
            out[:, :, i, j] = np.einsum("ncyx,yxco->no", patch, w) + b
    return out


def pool_reference(x, k, s, reduce):
    n, c, h, w = x.shape
    h_out, w_out = (h - k) // s + 1, (w - k) // s + 1
    out = np.zeros((n, c, h_out, w_out))
    for i in range(h_out):
        for j in range(w_out):
            out[:, :, i, j] = reduce(x[:, :, i * s : i * s + k, j * s : j * s + k], axis=(2, 3))
    return out


@pytest.mark.parametrize("k, stride", [(3, 1), (3, 2), (1, 1), (5, 1)])
def test_conv_matches_loops_and_finite_differences(k, stride, device):
    np.random.seed(k + stride)
    conv = nn.Conv(2, 3, k, stride=stride, device=device)
    w, b = conv.weight.numpy(), conv.bias.numpy()
    x = np.random.randn(2, 2, 5, 5)
    out_shape = conv_reference(x, w, b, stride).shape
    R = np.random.randn(*out_shape)
    X = tensor(x, device)
    out = conv(X)
    np.testing.assert_allclose(out.numpy(), conv_reference(x, w, b, stride), rtol=1e-4, atol=1e-4)
    (out * tensor(R, device, False)).sum().backward()

    def ref(x, w, b):
        return np.sum(conv_reference(x, w, b, stride) * R)

    for i, got in enumerate([X.grad, conv.weight.grad, conv.bias.grad]):
        np.testing.assert_allclose(got.numpy(), numeric_grad(ref, [x, w, b], i), rtol=1e-3,
                                   atol=1e-3)


def test_conv_without_bias_and_bad_channels(device):
    conv = nn.Conv(3, 4, 3, bias=False, device=device)
    assert conv.bias is None and len(conv.parameters()) == 1
    x = np.random.randn(1, 3, 4, 4)
    np.testing.assert_allclose(conv(tensor(x, device)).numpy(),
                               conv_reference(x, conv.weight.numpy(), 0.0, 1), rtol=1e-4, atol=1e-4)
    expected = r"Conv expects input of shape \(\*, 3, \*, \*\), got \(1, 2, 4, 4\)"
    with pytest.raises(ValueError, match=expected):
        conv(tensor(np.zeros((1, 2, 4, 4)), device))


@pytest.mark.parametrize("k, s, shape", [(2, 2, (2, 3, 4, 6)), (3, 2, (1, 2, 7, 5)),
                                         (2, 2, (1, 1, 5, 5)), (4, 4, (2, 2, 4, 4))])
def test_pooling_matches_loops_and_finite_differences(k, s, shape, device):
    x = np.random.randn(*shape)  # distinct values: max has a unique argmax
    for module, reduce in [(nn.MaxPool2d(k, s), np.max), (nn.AvgPool2d(k, s), np.mean)]:
        expected = pool_reference(x, k, s, reduce)
        R = np.random.randn(*expected.shape)
        X = tensor(x, device)
        out = module(X)
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)
        (out * tensor(R, device, False)).sum().backward()
        grad = numeric_grad(
            lambda x, reduce=reduce, R=R: np.sum(pool_reference(x, k, s, reduce) * R), [x], 0
        )
        np.testing.assert_allclose(X.grad.numpy(), grad, rtol=1e-4, atol=1e-4)


def test_pooling_rejects_bad_input(device):
    with pytest.raises(ValueError, match="NCHW"):
        nn.MaxPool2d(2)(tensor(np.zeros((2, 4)), device))
    with pytest.raises(ValueError, match="larger than image"):
        nn.AvgPool2d(3)(tensor(np.zeros((1, 1, 2, 2)), device))
