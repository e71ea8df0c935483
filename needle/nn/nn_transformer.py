"""Multi-head attention and a pre-norm Transformer (the layout of CMU needle's hw4)."""
import numpy as np

from needle import init, ops
from needle.autograd import Tensor

from .nn_basic import (
    Dropout,
    LayerNorm1d,
    Linear,
    Module,
    ReLU,
    Sequential,
    check_positive_ints,
    check_shape,
)
from .nn_sequence import Embedding

__all__ = [
    "MultiHeadAttention",
    "AttentionLayer",
    "TransformerLayer",
    "Transformer",
]

_MASKED = float("-inf")  # a masked logit: exp gives exactly 0 whatever the other logits are
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def softmax(x: Tensor) -> Tensor:
    """Softmax over the last axis, as exp(x - max) / sum so that every row sums to 1.

    exp(x - logsumexp(x)) does not once |x| is large (float32 rounds logsumexp = max + log(n)
    to max). The max is a constant: softmax does not change when a constant is subtracted
    from a row. Entries of -inf (masked) get exactly 0; a row of only -inf (a query that may
    see no key) is uniform, as a row of equal logits: its shift is kept >= -FLOAT32_MAX so
    that -inf - -inf makes no NaN, and its exps of 0 become a constant 1 each.
    """
    last = len(x.shape) - 1
    top = x.realize_cached_data().max(last, keepdims=True)
    empty = (top == _MASKED).broadcast_to(x.shape)  # 1 in the rows of only -inf
    shift = top.maximum(-_FLOAT32_MAX).broadcast_to(x.shape)
    e = ops.exp(x - Tensor.make_const(shift)) + Tensor.make_const(empty)
    total = ops.summation(e, axes=(last,)).reshape((*x.shape[:-1], 1))
    return e / ops.broadcast_to(total, x.shape)


class MultiHeadAttention(Module):
    """softmax(q k^T / sqrt(d) [+ causal mask]) v on (batch, heads, length, dim) tensors.

    Returns (result, attention probabilities).
    """

    def __init__(self, *, dropout=0.0, causal=False, device=None, dtype="float32"):
        """device and dtype keep CMU's signature; the layer has no weights, and its mask is
        made on the device of q."""
        super().__init__()
        self.causal = causal
        self.attn_drop = Dropout(dropout)

    def causal_mask(self, queries: int, keys: int, device) -> Tensor:
        """Masks key j for query i when j > i + (keys - queries) (the later positions).

        Masked entries are -inf, not a large finite number: -1e9 added to a logit of 2e9 (or
        to any logit beside visible ones below -1e9) let a query attend to the future."""
        later = np.triu(np.ones((queries, keys), dtype=bool), keys - queries + 1)
        mask = np.where(later, np.float32(_MASKED), np.float32(0.0))
        return Tensor(mask.reshape(1, 1, queries, keys), device=device, requires_grad=False)

    def forward(self, q: Tensor, k: Tensor, v: Tensor):
        # matmul would broadcast a batch or head axis of 1 in q against k: check them too
        if (len(q.shape) != 4 or len(k.shape) != 4 or tuple(k.shape) != tuple(v.shape)
                or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]):
            raise ValueError(
                "MultiHeadAttention expects q, k, v of shape (batch, heads, length, dim) with "
                "k and v alike and equal batch, heads and q/k dim, "
                f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        batch, heads, queries, dim = q.shape
        keys = k.shape[2]
        if keys == 0:  # softmax over no key is 0 / 0; it failed as "max of an empty axis"
            raise ValueError(f"MultiHeadAttention expects at least one key, got k of shape "
                             f"{tuple(k.shape)}")
        logits = ops.matmul(q, ops.transpose(k)) / float(np.sqrt(dim))
        if self.causal:
            mask = self.causal_mask(queries, keys, q.device)
            logits = logits + ops.broadcast_to(mask, logits.shape)
        probs = softmax(logits)
        return ops.matmul(self.attn_drop(probs), v), probs


class AttentionLayer(Module):
    """Pre-norm multi-head attention with q/k/v and output projections (no biases)."""

    def __init__(self, q_features, num_head, dim_head, *, out_features=None, k_features=None,
                 v_features=None, dropout=0.0, causal=True, device=None, dtype="float32"):
        super().__init__()
        # 0 or 2.0 heads would fail inside Linear's initialiser or a reshape, naming neither
        check_positive_ints(self, num_head=num_head, dim_head=dim_head)
        k_features = k_features or q_features
        v_features = v_features or q_features
        out_features = out_features or q_features
        self.q_features = q_features
        self.k_features = k_features
        self.v_features = v_features
        self.num_head = num_head
        self.dim_head = dim_head
        inner = num_head * dim_head
        self.prenorm_q = LayerNorm1d(q_features, device=device, dtype=dtype)
        self.prenorm_k = LayerNorm1d(k_features, device=device, dtype=dtype)
        self.prenorm_v = LayerNorm1d(v_features, device=device, dtype=dtype)
        self.q_projection = Linear(q_features, inner, bias=False, device=device, dtype=dtype)
        self.k_projection = Linear(k_features, inner, bias=False, device=device, dtype=dtype)
        self.v_projection = Linear(v_features, inner, bias=False, device=device, dtype=dtype)
        self.attn = MultiHeadAttention(dropout=dropout, causal=causal, device=device, dtype=dtype)
        self.out_projection = Linear(inner, out_features, bias=False, device=device, dtype=dtype)

    def _heads(self, x: Tensor, norm: LayerNorm1d, projection: Linear) -> Tensor:
        """(batch, length, features) -> (batch, heads, length, dim_head)."""
        batch, length, _ = x.shape
        y = projection(norm(x)).reshape((batch, length, self.num_head, self.dim_head))
        return ops.transpose(y, (1, 2))

    def forward(self, q: Tensor, k: Tensor | None = None, v: Tensor | None = None) -> Tensor:
        k = q if k is None else k
        v = q if v is None else v
        check_shape(self, q, 3, {2: self.q_features}, "q")
        batch, length, _ = q.shape
        check_shape(self, k, 3, {0: batch, 2: self.k_features}, "k")
        check_shape(self, v, 3, {0: batch, 1: k.shape[1], 2: self.v_features}, "v")
        heads, _ = self.attn(
            self._heads(q, self.prenorm_q, self.q_projection),
            self._heads(k, self.prenorm_k, self.k_projection),
            self._heads(v, self.prenorm_v, self.v_projection),
        )
        inner = self.num_head * self.dim_head
        merged = ops.transpose(heads, (1, 2)).reshape((batch, length, inner))
        return self.out_projection(merged)


class TransformerLayer(Module):
    """x + attention(x), then + FFN(layernorm(x)); dropout on each residual branch."""

    def __init__(self, q_features, num_head, dim_head, hidden_size, *, dropout=0.0, causal=True,
                 device=None, dtype="float32"):
        super().__init__()
        self.attention = AttentionLayer(
            q_features, num_head, dim_head, out_features=q_features, dropout=dropout,
            causal=causal, device=device, dtype=dtype,
        )
        self.dropout = Dropout(dropout)
        self.ffn = Sequential(
            LayerNorm1d(q_features, device=device, dtype=dtype),
            Linear(q_features, hidden_size, device=device, dtype=dtype),
            ReLU(),
            Dropout(dropout),
            Linear(hidden_size, q_features, device=device, dtype=dtype),
            Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.dropout(self.attention(x))
        return x + self.ffn(x)


class Transformer(Module):
    """A stack of TransformerLayers with learned positional embeddings.

    Like the recurrent layers it maps (seq_len, batch, features) (or batch first) to the same
    shape and returns (output, state) where state is unused, so models can swap them.
    """

    def __init__(self, embedding_size, hidden_size, num_layers, *, num_head=8, dim_head=32,
                 dropout=0.0, causal=True, device=None, dtype="float32", batch_first=False,
                 sequence_len=2048):
        super().__init__()
        self.embedding_size = embedding_size
        self.batch_first = batch_first
        self.sequence_len = sequence_len
        self.positional_embedding = Embedding(sequence_len, embedding_size, device, dtype)
        self.layers = Sequential(*[
            TransformerLayer(embedding_size, num_head, dim_head, hidden_size, dropout=dropout,
                             causal=causal, device=device, dtype=dtype)
            for _ in range(num_layers)
        ])

    def forward(self, x: Tensor, h=None):
        check_shape(self, x, 3, {2: self.embedding_size})
        if not self.batch_first:
            x = ops.transpose(x, (0, 1))
        batch, length, _ = x.shape
        if length == 0:  # as RNN and LSTM: there is nothing to attend to
            raise ValueError(f"Transformer expects at least one position, got input of shape "
                             f"{tuple(x.shape)}")
        if length > self.sequence_len:
            raise ValueError(f"sequence of {length} exceeds sequence_len {self.sequence_len}")
        positions = Tensor(np.arange(length), device=x.device, requires_grad=False)
        pos = self.positional_embedding(positions).reshape((1, length, self.embedding_size))
        x = self.layers(x + ops.broadcast_to(pos, x.shape))
        if not self.batch_first:
            x = ops.transpose(x, (0, 1))
        return x, init.zeros_like(x)
