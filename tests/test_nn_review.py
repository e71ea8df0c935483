"""Review of the nn layers' numerics on edge-case shapes and inputs.

The defects fixed in this review have torch-free regression tests (numpy references, finite
differences, hand-derived values). Where PyTorch is installed (the bench extra, not CI), the
last tests also compare every layer's forward and gradients against it in float64.
"""
import math

import numpy as np
import pytest
from helpers import numeric_grad, tensor

from needle import nn, ops
from needle.models import LanguageModel
from needle.nn.nn_transformer import softmax


def stable_softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ---------------------------------------------------------------- softmax and logsumexp


def test_softmax_rows_sum_to_one_for_huge_and_fully_masked_logits(device):
    # float32 rounds logsumexp = max + log(sum) to max here, so exp(x - logsumexp) gave
    # [0.37, 0.14] and [1, 1] (rows summing to 0.5 and 2) before the fix
    x = np.array([[1e7, 1e7 - 1], [-1e9, -1e9], [0.0, 1.0]], np.float32)
    got = softmax(tensor(x, device)).numpy()
    np.testing.assert_allclose(got, stable_softmax(x), rtol=1e-6)


def test_fully_masked_attention_rows_are_uniform_not_nan(device):
    # causal with 5 queries and 3 keys: queries 0 and 1 may see no key at all
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s) for s in [(1, 2, 5, 4), (1, 2, 3, 4), (1, 2, 3, 4)])
    Q, K, V = (tensor(a, device) for a in (q, k, v))
    out, probs = nn.MultiHeadAttention(causal=True, device=device)(Q, K, V)
    out, probs = out.numpy(), probs.numpy()
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)  # each entry was 1 before
    np.testing.assert_allclose(probs[:, :, :2], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(out[:, :, :2], np.broadcast_to(v.mean(2, keepdims=True),
                                                              (1, 2, 2, 4)), rtol=1e-5, atol=1e-6)
    logits = q @ np.swapaxes(k, -1, -2) / 2.0
    visible = np.arange(3)[None, :] <= np.arange(5)[:, None] - 2
    expected = stable_softmax(np.where(visible, logits, -np.inf)[:, :, 2:])
    np.testing.assert_allclose(probs[:, :, 2:], expected, rtol=1e-5, atol=1e-7)
    result, _ = nn.MultiHeadAttention(causal=True, device=device)(Q, K, V)
    result.sum().backward()
    for grad in (Q.grad, K.grad, V.grad):
        assert np.isfinite(grad.numpy()).all()


def test_logsumexp_gradient_is_softmax_even_for_huge_inputs(device):
    # before the fix: [1, 1], [0.37, 0.14], and off by 0.4% in the last row
    z = np.array([[-1e9, -1e9], [1e7, 1e7 - 1], [1e5, 1e5 + 1]], np.float32)
    Z = tensor(z, device)
    lse = ops.logsumexp(Z, axes=(1,))
    np.testing.assert_allclose(lse.numpy(), np.logaddexp.reduce(z.astype(np.float64), axis=1),
                               rtol=1e-7)
    (lse * tensor([1.0, 2.0, 3.0], device, False)).sum().backward()
    np.testing.assert_allclose(Z.grad.numpy(), stable_softmax(z) * [[1], [2], [3]], rtol=1e-5)


# ---------------------------------------------------------------- SoftmaxLoss


def test_softmax_loss_allows_minus_inf_logits(device):
    # a masked class (-inf) made the loss NaN through -inf * 0 in the label pick
    z = np.array([[-np.inf, -1.0, 0.0], [3e38, -3e38, 0.0]], np.float32)
    Z = tensor(z, device)
    loss = nn.SoftmaxLoss()(Z, tensor([1, 0], device, False))
    assert loss.numpy() == pytest.approx(math.log(1 + math.e) / 2, rel=1e-6)
    loss.backward()
    expected = np.array([[0, -math.e / (1 + math.e), math.e / (1 + math.e)], [0, 0, 0]]) / 2
    np.testing.assert_allclose(Z.grad.numpy(), expected, rtol=1e-6, atol=1e-7)
    impossible = nn.SoftmaxLoss()(tensor([[0.0, -np.inf]], device), tensor([1], device, False))
    assert impossible.numpy() > 1e38  # a label of probability 0: huge, not NaN


def test_labels_and_embedding_indices_must_be_integers(device):
    logits = tensor(np.zeros((2, 3)), device)
    assert nn.SoftmaxLoss()(logits, tensor([2.0, 0.0], device, False)).numpy() == pytest.approx(
        math.log(3))
    for bad in ([0.5, 1.0], [np.nan, 1.0]):  # 0.5 silently counted as class 0 before
        with pytest.raises(ValueError, match="labels must be integers"):
            nn.SoftmaxLoss()(logits, tensor(bad, device, False))
    emb = nn.Embedding(4, 2, device=device)
    for bad in ([1.5], [np.nan]):
        with pytest.raises(ValueError, match="Embedding indices must be integers"):
            emb(tensor(bad, device, False))


# ---------------------------------------------------------------- shape errors


@pytest.mark.parametrize("make, call, message", [
    (lambda d: nn.RNN(3, 4, 2, device=d), lambda m, t: m(t(5, 2, 3), t(2, 1, 4)),
     r"RNN expects h0 of shape \(2, 2, 4\), got \(2, 1, 4\)"),
    (lambda d: nn.RNN(3, 4, 2, device=d), lambda m, t: m(t(5, 2, 3), t(2, 4)),
     r"RNN expects h0 of shape \(2, 2, 4\), got \(2, 4\)"),
    (lambda d: nn.LSTM(3, 4, 2, device=d), lambda m, t: m(t(5, 2, 3), (t(2, 2, 4), t(2, 2, 3))),
     r"LSTM expects c0 of shape \(2, 2, 4\), got \(2, 2, 3\)"),
    (lambda d: nn.LSTM(3, 4, 1, device=d), lambda m, t: m(t(5, 2, 3), t(1, 2, 4)),
     r"LSTM expects its state as a pair \(h, c\), got Tensor"),
    (lambda d: nn.RNNCell(3, 4, device=d), lambda m, t: m(t(3, 3), t(1, 4)),
     r"RNNCell expects h of shape \(3, 4\), got \(1, 4\)"),
    (lambda d: nn.LSTMCell(3, 4, device=d), lambda m, t: m(t(3, 3), (t(3, 4), t(1, 4))),
     r"LSTMCell expects c of shape \(3, 4\), got \(1, 4\)"),
    # these broadcast silently before: a batch or head axis of 1 in q against k
    (lambda d: nn.MultiHeadAttention(device=d), lambda m, t: m(t(1, 2, 3, 4), *[t(2, 2, 3, 4)] * 2),
     r"MultiHeadAttention expects .*equal batch, heads.*\(1, 2, 3, 4\), \(2, 2, 3, 4\)"),
    (lambda d: nn.MultiHeadAttention(device=d), lambda m, t: m(t(2, 1, 3, 4), *[t(2, 2, 3, 4)] * 2),
     r"MultiHeadAttention expects"),
    (lambda d: nn.MultiHeadAttention(device=d), lambda m, t: m(t(2, 2, 3, 4), *[t(2, 2, 3, 5)] * 2),
     r"MultiHeadAttention expects"),
    (lambda d: nn.AttentionLayer(4, 2, 3, device=d), lambda m, t: m(t(2, 3, 4), t(1, 3, 4)),
     r"AttentionLayer expects k of shape \(2, \*, 4\), got \(1, 3, 4\)"),
    (lambda d: nn.AttentionLayer(4, 2, 3, device=d),
     lambda m, t: m(t(2, 3, 4), t(2, 5, 4), t(2, 4, 4)),
     r"AttentionLayer expects v of shape \(2, 5, 4\), got \(2, 4, 4\)"),
    (lambda d: nn.Residual(nn.Linear(3, 2, device=d)), lambda m, t: m(t(2, 3)),
     r"Residual: its function maps \(2, 3\) to \(2, 2\)"),
    (lambda d: LanguageModel(4, 10, 5, device=d), lambda m, t: m(t(3, 2, 4)),
     r"LanguageModel expects token ids of shape \(seq_len, batch\), got \(3, 2, 4\)"),
])
def test_wrong_shapes_name_the_layer_and_the_shapes(make, call, message, device):
    def t(*shape):
        return tensor(np.zeros(shape), device)

    with pytest.raises(ValueError, match=message):
        call(make(device), t)


def test_recurrent_layers_accept_correct_states(device):
    rng = np.random.default_rng(1)
    lstm = nn.LSTM(3, 4, 2, device=device)
    X = tensor(rng.standard_normal((5, 2, 3)), device)
    state = (tensor(rng.standard_normal((2, 2, 4)), device),) * 2
    out, (h, c) = lstm(X, list(state))  # a list works as well as a tuple
    assert out.shape == (5, 2, 4) and h.shape == c.shape == (2, 2, 4)
    cell_h, cell_c = lstm.lstm_cells[0](X[0], (h[0], c[0]))
    assert cell_h.shape == cell_c.shape == (2, 4)


@pytest.mark.parametrize("args, message", [
    ((2, 0), "stride must be a positive int, got 0"),  # stride 0 meant "kernel_size" before
    ((0,), "kernel_size must be a positive int, got 0"),  # ZeroDivisionError before
    (((2, 2),), r"kernel_size must be a positive int, got \(2, 2\)"),  # TypeError before
    ((2, -1), "stride must be a positive int, got -1"),
])
def test_pooling_arguments_are_validated(args, message):
    for pool in (nn.MaxPool2d, nn.AvgPool2d):
        with pytest.raises(ValueError, match=f"{pool.__name__}: {message}"):
            pool(*args)
    assert nn.MaxPool2d(3).stride == 3 and nn.AvgPool2d(3, 1).stride == 1


# ---------------------------------------------------------------- edge-case shapes, numpy refs


def conv_loops(x, w, stride, padding):
    """NHWC x, (KH, KW, C_in, C_out) w, zero padding, as plain loops."""
    n, h, wd, _ = x.shape
    kh, kw, _, c_out = w.shape
    xp = np.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    h_out, w_out = (h + 2 * padding - kh) // stride + 1, (wd + 2 * padding - kw) // stride + 1
    out = np.zeros((n, h_out, w_out, c_out))
    for i in range(h_out):
        for j in range(w_out):
            patch = xp[:, i * stride : i * stride + kh, j * stride : j * stride + kw, :]
            out[:, i, j] = np.einsum("nyxc,yxco->no", patch, w)
    return out


@pytest.mark.parametrize("x_shape, w_shape, stride, padding", [
    ((1, 1, 1, 1), (3, 3, 1, 1), 1, 1),  # batch 1, channel 1, 1x1 image
    ((1, 2, 2, 1), (5, 5, 1, 2), 1, 2),  # kernel larger than the image
    ((2, 5, 4, 2), (4, 4, 2, 1), 2, 2),  # even kernel, stride 2
    ((1, 3, 3, 2), (1, 1, 2, 2), 1, 3),  # padding beyond the kernel
    ((1, 4, 5, 1), (2, 3, 1, 2), 3, 1),  # non-square kernel, stride > kernel
    ((1, 3, 3, 1), (3, 3, 1, 1), 5, 0),  # one output pixel
])
def test_conv_edge_cases_match_loops_and_finite_differences(x_shape, w_shape, stride, padding,
                                                            device):
    rng = np.random.default_rng(sum(x_shape) + sum(w_shape))
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    X, W = tensor(x, device), tensor(w, device)
    out = ops.conv(X, W, stride=stride, padding=padding)
    expected = conv_loops(x, w, stride, padding)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)
    R = rng.standard_normal(expected.shape)
    (out * tensor(R, device, False)).sum().backward()
    for i, got in enumerate([X.grad, W.grad]):
        grad = numeric_grad(lambda x, w: np.sum(conv_loops(x, w, stride, padding) * R), [x, w], i)
        np.testing.assert_allclose(got.numpy(), grad, rtol=1e-4, atol=1e-4)


def test_batchnorm_running_statistics_follow_the_course_convention(device):
    """running = (1 - momentum) running + momentum batch, with the biased batch variance (CMU
    needle's convention; PyTorch tracks the unbiased one). BatchNorm2d with a batch of 1 takes
    its statistics over the pixels."""
    rng = np.random.default_rng(2)
    bn = nn.BatchNorm2d(2, momentum=0.3, device=device)
    mean, var = np.zeros(2), np.ones(2)
    for _ in range(2):
        x = rng.standard_normal((1, 2, 3, 2)) * 2 + 1
        out = bn(tensor(x, device)).numpy()
        m, v = x.mean((0, 2, 3)), x.var((0, 2, 3))
        shape = (1, 2, 1, 1)
        np.testing.assert_allclose(out, (x - m.reshape(shape)) / np.sqrt(v.reshape(shape) + 1e-5),
                                   rtol=1e-4, atol=1e-5)
        mean, var = 0.7 * mean + 0.3 * m, 0.7 * var + 0.3 * v
    np.testing.assert_allclose(bn.running_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.running_var.numpy(), var, rtol=1e-5)
    bn.eval()
    x = rng.standard_normal((1, 2, 1, 1))
    X = tensor(x, device)
    out = bn(X)
    np.testing.assert_allclose(out.numpy().ravel(), (x.ravel() - mean) / np.sqrt(var + 1e-5),
                               rtol=1e-5)
    out.sum().backward()  # eval mode is an affine map of x
    np.testing.assert_allclose(X.grad.numpy().ravel(), 1 / np.sqrt(var + 1e-5), rtol=1e-5)
    np.testing.assert_allclose(bn.running_var.numpy(), var, rtol=1e-5)  # eval leaves them


@pytest.mark.parametrize("make, shape", [(nn.BatchNorm1d, (1, 3)), (nn.BatchNorm2d, (1, 3, 1, 1))])
def test_batchnorm_refuses_one_value_per_channel_when_training(make, shape, device):
    """One value per channel has variance 0: the output was the bias alone and the running
    variance decayed towards 0 (eval mode then divided by ~sqrt(eps)). PyTorch refuses it too;
    eval mode takes any batch, and 2 values per channel train."""
    bn = make(3, device=device)
    with pytest.raises(ValueError, match=r"more than 1 value per channel.*\(1, 3"):
        bn(tensor(np.ones(shape), device))
    np.testing.assert_array_equal(bn.running_var.numpy(), np.ones(3))  # left as they were
    two = (2, *shape[1:])
    x = np.arange(np.prod(two), dtype=np.float64).reshape(two)
    axes = (0,) if len(two) == 2 else (0, 2, 3)
    out = bn(tensor(x, device)).numpy()
    expected = (x - x.mean(axes, keepdims=True)) / np.sqrt(x.var(axes, keepdims=True) + 1e-5)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    bn.eval()
    assert bn(tensor(np.ones(shape), device)).shape == shape


def test_dropout_gradient_is_the_scaled_mask(device):
    x = np.full((50, 40), 2.0)
    X = tensor(x, device)
    out = nn.Dropout(0.25)(X)
    out.sum().backward()
    kept = out.numpy() != 0
    np.testing.assert_allclose(out.numpy(), kept * 2.0 / 0.75, rtol=1e-6)
    np.testing.assert_allclose(X.grad.numpy(), kept / 0.75, rtol=1e-6)
    assert kept.mean() == pytest.approx(0.75, abs=0.05)


def test_rnn_gradients_with_initial_state_match_finite_differences(device):
    rng = np.random.default_rng(3)
    T, B, I, H = 3, 1, 2, 2
    rnn = nn.RNN(I, H, num_layers=2, device=device)
    x, h0, R = rng.standard_normal((T, B, I)), rng.standard_normal((2, B, H)), \
        rng.standard_normal((T, B, H))
    weights = [[getattr(c, n).numpy() for n in ("W_ih", "W_hh", "bias_ih", "bias_hh")]
               for c in rnn.rnn_cells]

    def ref(x, h0, W_hh1):
        layers = [weights[0], [weights[1][0], W_hh1, *weights[1][2:]]]
        for (W_ih, W_hh, b_ih, b_hh), h in zip(layers, h0, strict=True):
            outs = []
            for xt in x:
                h = np.tanh(xt @ W_ih + b_ih + h @ W_hh + b_hh)
                outs.append(h)
            x = np.stack(outs)
        return np.sum(x * R)

    X, H0 = tensor(x, device), tensor(h0, device)
    out, _ = rnn(X, H0)
    (out * tensor(R, device, False)).sum().backward()
    for i, got in enumerate([X.grad, H0.grad, rnn.rnn_cells[1].W_hh.grad]):
        grad = numeric_grad(ref, [x, h0, weights[1][1]], i)
        np.testing.assert_allclose(got.numpy(), grad, rtol=1e-4, atol=1e-5)


def test_layer_initialisers_follow_the_course_formulas():
    """Linear: kaiming_uniform(in, out), bias kaiming_uniform(out, 1) (CMU's choice); Conv:
    kaiming_uniform with fan_in = C_in k^2, bias U(+-1/sqrt(fan_in)); RNN/LSTM:
    U(+-1/sqrt(hidden)); Embedding: N(0, 1)."""
    np.random.seed(0)
    lin = nn.Linear(300, 200)
    checks = [(lin.weight, math.sqrt(6 / 300)), (lin.bias, math.sqrt(6 / 200))]
    conv = nn.Conv(8, 16, 3)
    checks += [(conv.weight, math.sqrt(6 / 72)), (conv.bias, 1 / math.sqrt(72))]
    cell = nn.LSTM(10, 50).lstm_cells[0]
    checks += [(p, 1 / math.sqrt(50)) for p in (cell.W_ih, cell.W_hh, cell.bias_ih)]
    for param, bound in checks:
        values = param.numpy()
        assert np.abs(values).max() <= bound  # uniform: max near the bound, std bound/sqrt(3)
        assert np.abs(values).max() > 0.9 * bound
        assert values.std() == pytest.approx(bound / math.sqrt(3), rel=0.1)
    assert cell.W_ih.shape == (10, 200) and conv.weight.shape == (3, 3, 8, 16)
    assert nn.Embedding(300, 100).weight.numpy().std() == pytest.approx(1.0, rel=0.02)


# ---------------------------------------------------------------- against PyTorch (optional)


def _torch_helpers():
    torch = pytest.importorskip("torch")

    def tt(a):
        return torch.tensor(np.asarray(a, np.float64), requires_grad=True)

    def close(got, expected, tol=1e-4):
        got = got.numpy() if hasattr(got, "numpy") else got
        expected = expected.detach().numpy() if hasattr(expected, "detach") else expected
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)

    return torch, tt, close


def _backward_both(out, ref, device, torch, rng):
    R = rng.standard_normal(tuple(ref.shape))
    (out * tensor(R, device, False)).sum().backward()
    (ref * torch.tensor(R)).sum().backward()


@pytest.mark.parametrize("n, c_in, c_out, h, w, k, stride", [
    (1, 1, 1, 1, 1, 3, 1), (1, 1, 2, 2, 2, 5, 1), (2, 3, 1, 5, 7, 3, 2), (1, 2, 3, 4, 4, 1, 3),
    (3, 2, 2, 6, 5, 4, 2), (2, 1, 3, 8, 8, 5, 3),
])
def test_conv_layer_matches_pytorch(n, c_in, c_out, h, w, k, stride, device):
    torch, tt, close = _torch_helpers()
    rng = np.random.default_rng(k + stride)
    conv = nn.Conv(c_in, c_out, k, stride=stride, device=device)
    x = rng.standard_normal((n, c_in, h, w))
    X, tx = tensor(x, device), tt(x)
    tw, tb = tt(conv.weight.numpy().transpose(3, 2, 0, 1)), tt(conv.bias.numpy())
    out, ref = conv(X), torch.nn.functional.conv2d(tx, tw, tb, stride=stride, padding=k // 2)
    close(out, ref)
    _backward_both(out, ref, device, torch, rng)
    close(X.grad, tx.grad)
    close(conv.weight.grad, tw.grad.numpy().transpose(2, 3, 1, 0))
    close(conv.bias.grad, tb.grad)


@pytest.mark.parametrize("shape, k, stride", [
    ((1, 1, 1, 1), 1, None), ((1, 1, 5, 5), 2, None), ((2, 3, 7, 6), 3, 2), ((1, 2, 4, 4), 2, 1),
    ((1, 1, 6, 6), 2, 3),
])
def test_pooling_matches_pytorch(shape, k, stride, device):
    torch, tt, close = _torch_helpers()
    rng = np.random.default_rng(len(shape) + k)
    x = rng.standard_normal(shape)
    F = torch.nn.functional
    for ours, theirs in [(nn.MaxPool2d, F.max_pool2d), (nn.AvgPool2d, F.avg_pool2d)]:
        X, tx = tensor(x, device), tt(x)
        out, ref = ours(k, stride)(X), theirs(tx, k, stride)
        close(out, ref)
        _backward_both(out, ref, device, torch, rng)
        close(X.grad, tx.grad)


@pytest.mark.parametrize("shape", [(2, 1), (5, 4), (3, 1, 1, 1), (1, 2, 3, 3), (4, 3, 1, 5)])
def test_batchnorm_matches_pytorch_in_train_and_eval(shape, device):
    torch, tt, close = _torch_helpers()
    rng = np.random.default_rng(sum(shape))
    C = shape[1]
    ours = (nn.BatchNorm1d if len(shape) == 2 else nn.BatchNorm2d)(C, momentum=0.3, device=device)
    theirs = (torch.nn.BatchNorm1d if len(shape) == 2 else torch.nn.BatchNorm2d)(
        C, momentum=0.3, dtype=torch.float64)
    w, b = rng.standard_normal(C), rng.standard_normal(C)
    ours.weight.data, ours.bias.data = tensor(w, device), tensor(b, device)
    with torch.no_grad():
        theirs.weight.copy_(torch.tensor(w))
        theirs.bias.copy_(torch.tensor(b))
    for training in (True, False):
        if not training:  # PyTorch's running variance is unbiased, ours biased: share one
            ours.running_var.data = tensor(theirs.running_var.detach().numpy(), device)
            ours.eval()
            theirs.eval()
        x = rng.standard_normal(shape) * 3 + 1
        X, tx = tensor(x, device), tt(x)
        out, ref = ours(X), theirs(tx)
        close(out, ref)
        _backward_both(out, ref, device, torch, rng)
        close(X.grad, tx.grad, 1e-3)
        close(ours.weight.grad, theirs.weight.grad)
        close(ours.bias.grad, theirs.bias.grad)
        close(ours.running_mean, theirs.running_mean)
        ours.weight.grad = ours.bias.grad = theirs.weight.grad = theirs.bias.grad = None


def test_layernorm_linear_activations_and_losses_match_pytorch(device):
    torch, tt, close = _torch_helpers()
    F = torch.nn.functional
    rng = np.random.default_rng(7)
    for shape in [(1, 1), (3, 5), (2, 3, 4)]:
        D = shape[-1]
        ln, lin = nn.LayerNorm1d(D, device=device), nn.Linear(D, 3, device=device)
        w, b = rng.standard_normal(D), rng.standard_normal(D)
        ln.weight.data, ln.bias.data = tensor(w, device), tensor(b, device)
        x = rng.standard_normal(shape) * 10 + 100
        X, tx, tw, tb = tensor(x, device), tt(x), tt(w), tt(b)
        lw, lb = tt(lin.weight.numpy()), tt(lin.bias.numpy().ravel())
        out = lin(ln(X))
        ref = F.layer_norm(tx, (D,), tw, tb, 1e-5) @ lw + lb
        close(out, ref, 1e-3)
        _backward_both(out, ref, device, torch, rng)
        for got, expected in [(X.grad, tx.grad), (ln.weight.grad, tw.grad),
                              (ln.bias.grad, tb.grad), (lin.weight.grad, lw.grad),
                              (lin.bias.grad, lb.grad.reshape(1, 3))]:
            close(got, expected, 1e-3)
    x = np.array([-1e4, -100, -30, -1e-3, 0, 1e-3, 30, 100, 1e4, -89, 89, -1e12, 1e12])
    for ours, theirs in [(nn.ReLU(), torch.relu), (nn.Tanh(), torch.tanh),
                         (nn.Sigmoid(), torch.sigmoid),
                         (nn.GELU(), lambda z: F.gelu(z, approximate="tanh"))]:
        X, tx = tensor(x, device), tt(x)
        out, ref = ours(X), theirs(tx)
        close(out, ref, 1e-6)
        out.sum().backward()
        ref.sum().backward()
        close(X.grad, tx.grad, 1e-6)
    z = np.array([[1e4, -1e4, 0], [0, 0, 0], [-1e30, 1e30, 0], [-np.inf, 2, 1]], np.float32)
    Z, tz = tensor(z, device), tt(z)
    labels = [1, 2, 1, 2]
    out, ref = nn.SoftmaxLoss()(Z, tensor(labels, device, False)), F.cross_entropy(
        tz, torch.tensor(labels))
    close(out, ref, 1e-6)
    (out * 2).backward()
    (ref * 2).backward()
    close(Z.grad, tz.grad, 1e-6)


def _load_cells(cells, theirs, torch):
    with torch.no_grad():
        for k, c in enumerate(cells):
            getattr(theirs, f"weight_ih_l{k}").copy_(torch.tensor(c.W_ih.numpy().T))
            getattr(theirs, f"weight_hh_l{k}").copy_(torch.tensor(c.W_hh.numpy().T))
            getattr(theirs, f"bias_ih_l{k}").copy_(torch.tensor(c.bias_ih.numpy()))
            getattr(theirs, f"bias_hh_l{k}").copy_(torch.tensor(c.bias_hh.numpy()))


def _close_cell_grads(cells, theirs, close):
    for k, c in enumerate(cells):
        close(c.W_ih.grad, getattr(theirs, f"weight_ih_l{k}").grad.numpy().T)
        close(c.W_hh.grad, getattr(theirs, f"weight_hh_l{k}").grad.numpy().T)
        close(c.bias_ih.grad, getattr(theirs, f"bias_ih_l{k}").grad)
        close(c.bias_hh.grad, getattr(theirs, f"bias_hh_l{k}").grad)


@pytest.mark.parametrize("kind", ["rnn_tanh", "rnn_relu", "lstm"])
@pytest.mark.parametrize("T, B, I, H, L", [(1, 1, 1, 1, 1), (3, 2, 5, 4, 3)])
def test_recurrent_layers_match_pytorch(kind, T, B, I, H, L, device):
    torch, tt, close = _torch_helpers()
    rng = np.random.default_rng(T + L)
    if kind == "lstm":
        ours, theirs = nn.LSTM(I, H, L, device=device), torch.nn.LSTM(I, H, L,
                                                                      dtype=torch.float64)
        cells = ours.lstm_cells
    else:
        nl = kind[4:]
        ours = nn.RNN(I, H, L, nonlinearity=nl, device=device)
        theirs = torch.nn.RNN(I, H, L, nonlinearity=nl, dtype=torch.float64)
        cells = ours.rnn_cells
    _load_cells(cells, theirs, torch)
    x, h0, c0 = rng.standard_normal((T, B, I)), *rng.standard_normal((2, L, B, H))
    X, H0, C0, tx, th0, tc0 = (*(tensor(a, device) for a in (x, h0, c0)), tt(x), tt(h0), tt(c0))
    if kind == "lstm":
        out, (hn, cn) = ours(X, (H0, C0))
        ref, (rhn, rcn) = theirs(tx, (th0, tc0))
        finals = [(hn, rhn), (cn, rcn)]
    else:
        out, hn = ours(X, H0)
        ref, rhn = theirs(tx, th0)
        finals = [(hn, rhn)]
    close(out, ref)
    loss, tloss = out.sum() * 0.0, ref.sum() * 0.0
    for got, expected in [(out, ref), *finals]:
        close(got, expected)
        R = rng.standard_normal(tuple(expected.shape))
        loss = loss + (got * tensor(R, device, False)).sum()
        tloss = tloss + (expected * torch.tensor(R)).sum()
    loss.backward()
    tloss.backward()
    close(X.grad, tx.grad)
    close(H0.grad, th0.grad)
    if kind == "lstm":
        close(C0.grad, tc0.grad)
    _close_cell_grads(cells, theirs, close)


def test_embedding_matches_pytorch_with_repeated_indices(device):
    torch, tt, close = _torch_helpers()
    emb = nn.Embedding(5, 3, device=device)
    theirs = torch.nn.Embedding(5, 3, dtype=torch.float64)
    with torch.no_grad():
        theirs.weight.copy_(torch.tensor(emb.weight.numpy()))
    idx = np.array([[1, 1, 4], [1, 0, 1]])
    out, ref = emb(tensor(idx, device, False)), theirs(torch.tensor(idx))
    close(out, ref)
    _backward_both(out, ref, device, torch, np.random.default_rng(0))
    close(emb.weight.grad, theirs.weight.grad)


@pytest.mark.parametrize("B, heads, Tq, Tk, D, causal", [
    (1, 1, 1, 1, 1, True), (2, 3, 4, 4, 5, True), (1, 2, 5, 3, 4, True), (1, 1, 3, 6, 2, True),
    (2, 1, 3, 4, 3, False),
])
def test_attention_matches_pytorch_on_rows_that_see_a_key(B, heads, Tq, Tk, D, causal, device):
    torch, tt, close = _torch_helpers()
    rng = np.random.default_rng(Tq * Tk)
    q = rng.standard_normal((B, heads, Tq, D))
    k, v = rng.standard_normal((2, B, heads, Tk, D))
    Q, K, V, tq, tk, tv = (*(tensor(a, device) for a in (q, k, v)), tt(q), tt(k), tt(v))
    out, probs = nn.MultiHeadAttention(causal=causal, device=device)(Q, K, V)
    logits = tq @ tk.transpose(-1, -2) / math.sqrt(D)
    masked = torch.ones(Tq, Tk, dtype=torch.bool).triu(Tk - Tq + 1) if causal else \
        torch.zeros(Tq, Tk, dtype=torch.bool)
    tp = torch.softmax(logits.masked_fill(masked, -np.inf), -1)  # NaN where a row sees no key
    first = max(Tq - Tk, 0) if causal else 0  # PyTorch's rows of NaN are left out
    close(probs.numpy()[:, :, first:], tp[:, :, first:], 1e-5)
    ref = tp[:, :, first:] @ tv
    out = out[:, :, first:]
    close(out, ref)
    _backward_both(out, ref, device, torch, rng)
    for got, expected in [(Q, tq), (K, tk), (V, tv)]:
        close(got.grad, expected.grad)


@pytest.mark.parametrize("B, T, D, heads, dim_head, hidden, layers, causal, batch_first", [
    (1, 1, 3, 1, 2, 5, 1, True, False), (2, 4, 6, 2, 3, 7, 2, True, False),
    (3, 3, 4, 3, 1, 2, 1, False, True),
])
def test_transformer_matches_pytorch(B, T, D, heads, dim_head, hidden, layers, causal,
                                     batch_first, device):
    torch, tt, close = _torch_helpers()
    F = torch.nn.functional
    rng = np.random.default_rng(B * T)
    model = nn.Transformer(D, hidden, layers, num_head=heads, dim_head=dim_head, causal=causal,
                           batch_first=batch_first, sequence_len=8, device=device)
    for name, t in model.named_tensors():  # non-trivial LayerNorms
        if "prenorm" in name or "modules.0" in name:
            t.data = tensor(rng.standard_normal(t.shape), device)
    P = {name: tt(t.numpy()) for name, t in model.named_tensors()}

    def norm(x, pre):
        return F.layer_norm(x, (x.shape[-1],), P[pre + ".weight"], P[pre + ".bias"], 1e-5)

    def attention(x, pre):
        def split(n):
            y = norm(x, f"{pre}.prenorm_{n}") @ P[f"{pre}.{n}_projection.weight"]
            return y.reshape(B, T, heads, dim_head).transpose(1, 2)

        logits = split("q") @ split("k").transpose(-1, -2) / math.sqrt(dim_head)
        if causal:
            logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -np.inf)
        y = (torch.softmax(logits, -1) @ split("v")).transpose(1, 2).reshape(B, T, -1)
        return y @ P[f"{pre}.out_projection.weight"]

    x = rng.standard_normal((B, T, D) if batch_first else (T, B, D))
    X, tx = tensor(x, device), tt(x)
    out, _ = model(X)
    y = (tx if batch_first else tx.transpose(0, 1)) + P["positional_embedding.weight"][:T]
    for i in range(layers):
        pre = f"layers.modules.{i}"
        y = y + attention(y, pre + ".attention")
        h = F.relu(norm(y, pre + ".ffn.modules.0") @ P[pre + ".ffn.modules.1.weight"]
                   + P[pre + ".ffn.modules.1.bias"].reshape(-1))
        y = y + h @ P[pre + ".ffn.modules.4.weight"] + P[pre + ".ffn.modules.4.bias"].reshape(-1)
    ref = y if batch_first else y.transpose(0, 1)
    close(out, ref, 1e-4)
    _backward_both(out, ref, device, torch, rng)
    close(X.grad, tx.grad, 1e-3)
    for name, t in model.named_tensors():
        if P[name].grad is not None:
            close(t.grad, P[name].grad, 1e-3)
