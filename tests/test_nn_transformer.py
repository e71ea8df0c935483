"""Attention and Transformer layers against a plain numpy implementation."""
import numpy as np
import pytest
from helpers import tensor

from needle import nn


def softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def attention_reference(q, k, v, causal):
    logits = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        queries, keys = logits.shape[-2:]
        future = np.arange(keys)[None, :] > np.arange(queries)[:, None] + (keys - queries)
        logits = np.where(future, -np.inf, logits)
    probs = softmax(logits)
    return probs @ v, probs


def layernorm(x, ln):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + ln.eps) * ln.weight.numpy() + ln.bias.numpy()


def attention_layer_reference(x, layer, causal):
    """(B, T, D) -> (B, T, D) for a pre-norm AttentionLayer with q = k = v = x."""
    B, T, _ = x.shape
    H, Dh = layer.num_head, layer.dim_head

    def heads(norm, proj):
        return (layernorm(x, norm) @ proj.weight.numpy()).reshape(B, T, H, Dh).transpose(0, 2, 1, 3)

    out, _ = attention_reference(heads(layer.prenorm_q, layer.q_projection),
                                 heads(layer.prenorm_k, layer.k_projection),
                                 heads(layer.prenorm_v, layer.v_projection), causal)
    return out.transpose(0, 2, 1, 3).reshape(B, T, H * Dh) @ layer.out_projection.weight.numpy()


def transformer_layer_reference(x, layer, causal):
    x = x + attention_layer_reference(x, layer.attention, causal)
    norm, lin1, _, _, lin2, _ = layer.ffn.modules
    hidden = np.maximum(layernorm(x, norm) @ lin1.weight.numpy() + lin1.bias.numpy(), 0)
    return x + hidden @ lin2.weight.numpy() + lin2.bias.numpy()


@pytest.mark.parametrize("causal", [False, True])
def test_multihead_attention_matches_numpy(causal, device):
    np.random.seed(0)
    q, k, v = (np.random.randn(2, 3, 5, 4) for _ in range(3))
    attn = nn.MultiHeadAttention(causal=causal)  # no weights: the mask follows q's device
    out, probs = attn(tensor(q, device), tensor(k, device), tensor(v, device))
    ref_out, ref_probs = attention_reference(q, k, v, causal)
    np.testing.assert_allclose(probs.numpy(), ref_probs, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-4, atol=1e-5)
    if causal:
        assert np.all(np.triu(probs.numpy()[0, 0], 1) == 0)


def test_attention_gradients_match_finite_differences(device):
    np.random.seed(1)
    q, k, v = (np.random.randn(1, 2, 3, 2) for _ in range(3))
    R = np.random.randn(1, 2, 3, 2)
    Q, K, V = (tensor(a, device) for a in (q, k, v))
    out, _ = nn.MultiHeadAttention(causal=True, device=device)(Q, K, V)
    (out * tensor(R, device, False)).sum().backward()
    arrays = [q, k, v]
    for i, got in enumerate([Q.grad, K.grad, V.grad]):
        grad = np.zeros_like(arrays[i])
        for idx in np.ndindex(*grad.shape):
            up, down = [a.copy() for a in arrays], [a.copy() for a in arrays]
            up[i][idx] += 1e-6
            down[i][idx] -= 1e-6
            grad[idx] = (np.sum(attention_reference(*up, True)[0] * R)
                         - np.sum(attention_reference(*down, True)[0] * R)) / 2e-6
        np.testing.assert_allclose(got.numpy(), grad, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_transformer_layer_matches_numpy(causal, device):
    np.random.seed(2)
    layer = nn.TransformerLayer(8, num_head=2, dim_head=3, hidden_size=16, causal=causal,
                                device=device)
    for p in layer.parameters():  # non-trivial norms too
        p.data = tensor(np.random.randn(*p.shape) * 0.5, device)
    x = np.random.randn(2, 5, 8)
    np.testing.assert_allclose(layer(tensor(x, device)).numpy(),
                               transformer_layer_reference(x, layer, causal), rtol=1e-3, atol=1e-4)


def test_causal_transformer_output_ignores_future_tokens(device):
    np.random.seed(3)
    model = nn.Transformer(8, 16, 2, num_head=2, dim_head=4, device=device, sequence_len=10)
    x = np.random.randn(6, 2, 8)  # (seq_len, batch, features)
    changed = x.copy()
    changed[4:] = np.random.randn(2, 2, 8)
    out, _ = model(tensor(x, device))
    out_changed, _ = model(tensor(changed, device))
    assert out.shape == (6, 2, 8)
    np.testing.assert_allclose(out.numpy()[:4], out_changed.numpy()[:4], rtol=1e-5, atol=1e-5)
    assert not np.allclose(out.numpy()[4:], out_changed.numpy()[4:])


def test_transformer_adds_positions_and_stacks_layers(device):
    np.random.seed(4)
    model = nn.Transformer(6, 12, 2, num_head=2, dim_head=3, device=device, batch_first=True,
                           sequence_len=8)
    x = np.random.randn(2, 5, 6)
    out, _ = model(tensor(x, device))
    h = x + model.positional_embedding.weight.numpy()[:5]
    for layer in model.layers.modules:
        h = transformer_layer_reference(h, layer, causal=True)
    np.testing.assert_allclose(out.numpy(), h, rtol=1e-3, atol=1e-4)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_attention_rejects_bad_shapes(device):
    with pytest.raises(ValueError, match="MultiHeadAttention expects"):
        nn.MultiHeadAttention(device=device)(*(tensor(np.zeros((2, 3, 4)), device),) * 3)
    with pytest.raises(ValueError, match="exceeds sequence_len 4"):
        nn.Transformer(4, 8, 1, num_head=1, dim_head=4, sequence_len=4, device=device)(
            tensor(np.zeros((5, 1, 4)), device))
