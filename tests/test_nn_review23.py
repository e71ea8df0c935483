"""Review of attention masking, the softmax loss, logsumexp and the recurrent layers' states.

References are numpy (float64) implementations written here; masked attention follows the
usual definition, where a masked key gets weight exactly 0 whatever its logit.
"""
import numpy as np
import pytest
from helpers import numeric_grad, tensor

from needle import nn, ops
from needle.nn.nn_transformer import softmax

FLOAT32_MAX = float(np.finfo(np.float32).max)


def masked_attention(q, k, v):
    """Causal softmax(q k^T / sqrt(d)) v in float64, future keys set to -inf."""
    logits = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    queries, keys = logits.shape[-2:]
    future = np.arange(keys)[None, :] > np.arange(queries)[:, None] + (keys - queries)
    logits = np.where(future, -np.inf, logits)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    probs = e / e.sum(-1, keepdims=True)
    return probs @ v, probs


# ---------------------------------------------------------------- causal attention


@pytest.mark.parametrize("position, value", [(2, 1e9), (0, -1e9)])
def test_causal_attention_never_weighs_a_future_key_whatever_the_logits(position, value,
                                                                       device):
    """The mask added -1e9 to future logits: a future key with a logit of 2e9 (position 2
    here) still won query 0 (probs [0, 0, 1]), and a visible key below -1e9 (position 0) lost
    to the future ones (query 0 got [0, 0.5, 0.5] instead of [1, 0, 0])."""
    rng = np.random.default_rng(0)
    q = np.ones((1, 2, 3, 4))
    k, v = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 2, 3, 4))
    k[:, :, position] = value
    out, probs = nn.MultiHeadAttention(causal=True, device=device)(
        tensor(q, device), tensor(k, device), tensor(v, device))
    ref_out, ref_probs = masked_attention(q, k, v)
    np.testing.assert_allclose(probs.numpy(), ref_probs, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-5, atol=1e-6)
    assert np.all(np.triu(probs.numpy(), 1) == 0)


def test_attention_layer_outputs_do_not_depend_on_later_tokens_with_large_weights(device):
    """Projections with large weights give logits of order 1e9 and more; perturbing the last
    two tokens changed the outputs at the first four before the fix."""
    rng = np.random.default_rng(1)
    layer = nn.AttentionLayer(8, 2, 4, causal=True, device=device)
    for projection in (layer.q_projection, layer.k_projection):
        projection.weight.data = tensor(rng.standard_normal((8, 8)) * 3e4, device)
    x = rng.standard_normal((2, 6, 8))
    changed = x.copy()
    changed[:, 4:] = rng.standard_normal((2, 2, 8))
    before = layer(tensor(x, device, requires_grad=False)).numpy()
    after = layer(tensor(changed, device, requires_grad=False)).numpy()
    np.testing.assert_allclose(before[:, :4], after[:, :4], rtol=1e-6, atol=1e-6)
    assert not np.allclose(before[:, 4:], after[:, 4:])


def test_softmax_gives_masked_entries_zero_and_fully_masked_rows_uniform(device):
    """-inf entries are masked; a row of only -inf is uniform (as the layer's fully masked
    queries are), and the gradient matches finite differences of the visible entries."""
    x = np.array([[1.0, -np.inf, 2.0, 0.5], [-np.inf] * 4, [3e9, -np.inf, -3e9, 0.0]])
    X = tensor(x, device)
    probs = softmax(X)
    visible = np.isfinite(x)
    expected = np.where(visible, np.exp(np.where(visible, x, 0) - [[2.0], [0], [3e9]]), 0)
    expected[1] = 1
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(probs.numpy(), expected, rtol=1e-6)
    weights = np.array([[0.3, -1.0, 2.0, 0.7]] * 3)
    (probs * tensor(weights, device, False)).sum().backward()

    def f(row):
        e = np.exp(row - row.max())
        return np.sum(e / e.sum() * weights[0, [0, 2, 3]])

    grad = X.grad.numpy()
    np.testing.assert_allclose(grad[0, [0, 2, 3]], numeric_grad(f, [x[0, [0, 2, 3]]], 0),
                               rtol=1e-4, atol=1e-6)
    assert np.all(grad[:2, 1] == 0) and np.all(grad[1] == 0)


def test_attention_needs_a_key_and_the_transformer_a_position(device):
    """No key (or an empty sequence) failed deep in softmax as "max of an empty axis"."""
    q, empty = tensor(np.zeros((1, 2, 3, 4)), device), tensor(np.zeros((1, 2, 0, 4)), device)
    with pytest.raises(ValueError, match=r"MultiHeadAttention expects at least one key, "
                                         r"got k of shape \(1, 2, 0, 4\)"):
        nn.MultiHeadAttention(device=device)(q, empty, empty)
    model = nn.Transformer(8, 16, 1, num_head=2, dim_head=4, device=device)
    with pytest.raises(ValueError, match="Transformer expects at least one position"):
        model(tensor(np.zeros((0, 2, 8)), device))
    out, probs = nn.MultiHeadAttention(causal=True, device=device)(empty, q, q)  # no query
    assert out.shape == (1, 2, 0, 4) and probs.shape == (1, 2, 0, 3)


# ---------------------------------------------------------------- softmax loss


@pytest.mark.parametrize("batch", [2, 3])
def test_softmax_loss_of_masked_labels_stays_finite(batch, device):
    """A -inf logit at the label counts as -FLOAT32_MAX, "a huge but finite loss": with two
    or more such rows the sum overflowed to inf before it was divided by the batch."""
    logits = tensor(np.tile([[-np.inf, 0.0, 1.0]], (batch, 1)), device)
    loss = nn.SoftmaxLoss()(logits, tensor(np.zeros(batch), device, False))
    assert loss.numpy() == np.float32(FLOAT32_MAX)
    loss.backward()
    softmax_row = np.exp([0.0, 1.0]) / np.exp([0.0, 1.0]).sum()
    expected = np.tile(np.r_[-1.0, softmax_row], (batch, 1)) / batch
    np.testing.assert_allclose(logits.grad.numpy(), expected, rtol=1e-6)


def test_softmax_loss_mean_is_unchanged_for_ordinary_and_mixed_batches(device):
    rng = np.random.default_rng(2)
    z = rng.standard_normal((5, 4)) * 10
    y = np.array([0, 3, 1, 1, 2])
    loss = nn.SoftmaxLoss()(tensor(z, device), tensor(y, device, False)).numpy()
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    assert loss == pytest.approx(np.mean(lse - z[np.arange(5), y]), rel=1e-6)
    masked = np.array([[-np.inf, 0.0], [0.0, 1.0]])
    loss = nn.SoftmaxLoss()(tensor(masked, device), tensor([0, 1], device, False)).numpy()
    assert loss == pytest.approx(FLOAT32_MAX / 2, rel=1e-6)


def test_softmax_loss_refuses_an_empty_batch(device):
    """The mean over no example divided by zero (ZeroDivisionError from the op)."""
    with pytest.raises(ValueError, match=r"needs at least one example, got logits of shape "
                                         r"\(0, 3\)"):
        nn.SoftmaxLoss()(tensor(np.zeros((0, 3)), device), tensor(np.zeros(0), device, False))


# ---------------------------------------------------------------- logsumexp


@pytest.mark.parametrize("shape, axes", [((3, 0), (1,)), ((0, 3), None), ((2, 0, 3), (1, 2)),
                                         ((2, 0, 3), -2)])
def test_logsumexp_over_an_empty_axis_is_minus_inf(shape, axes, device):
    """log of an empty sum is log 0 = -inf (numpy's logaddexp.reduce, scipy and PyTorch);
    it raised "max of an empty axis"."""
    z = np.zeros(shape)
    Z = tensor(z, device)
    out = ops.logsumexp(Z, axes=axes)
    expected = np.logaddexp.reduce(z, axis=axes)
    np.testing.assert_array_equal(out.numpy(), expected)
    out.sum().backward()
    assert Z.grad.shape == shape


# ---------------------------------------------------------------- recurrent states


@pytest.mark.parametrize("call", [
    lambda d, z: nn.RNN(3, 4, device=d)(z((5, 2, 3)), (z((1, 2, 4)), z((1, 2, 4)))),
    lambda d, z: nn.RNN(3, 4, device=d)(z((5, 2, 3)), [z((1, 2, 4))]),
    lambda d, z: nn.RNNCell(3, 4, device=d)(z((2, 3)), (z((2, 4)), z((2, 4)))),
], ids=["rnn-lstm-pair", "rnn-list", "cell-pair"])
def test_rnn_state_must_be_one_tensor(call, device):
    """An LSTM-style (h, c) pair given to an RNN failed with AttributeError: no .shape."""
    with pytest.raises(ValueError, match=r"RNN(Cell)? expects h0? as a Tensor, got "
                                         r"(tuple|list)"):
        call(device, lambda shape: tensor(np.zeros(shape), device))
