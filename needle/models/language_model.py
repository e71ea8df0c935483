"""Word-level language models: embedding -> RNN / LSTM / Transformer -> linear decoder."""
from needle import nn
from needle.nn.nn_basic import check_positive_ints


class LanguageModel(nn.Module):
    """forward(x (seq_len, batch) token ids, h) -> (logits (seq_len * batch, vocab), h)."""

    def __init__(self, embedding_size: int, output_size: int, hidden_size: int,
                 num_layers: int = 1, seq_model: str = "rnn", seq_len: int = 40,
                 num_head: int = 4, dim_head: int = 16, dropout: float = 0.0,
                 device=None, dtype="float32"):
        super().__init__()
        check_positive_ints(self, embedding_size=embedding_size, output_size=output_size,
                      hidden_size=hidden_size, num_layers=num_layers)
        if seq_model == "transformer":
            check_positive_ints(self, seq_len=seq_len, num_head=num_head, dim_head=dim_head)
        elif dropout and seq_model in ("rnn", "lstm"):  # it would be ignored without a word
            raise ValueError(f"LanguageModel: dropout applies to the transformer only, not to "
                             f"seq_model {seq_model!r}")
        self.embedding = nn.Embedding(output_size, embedding_size, device=device, dtype=dtype)
        if seq_model == "rnn":
            self.seq_model = nn.RNN(embedding_size, hidden_size, num_layers,
                                    device=device, dtype=dtype)
            features = hidden_size
        elif seq_model == "lstm":
            self.seq_model = nn.LSTM(embedding_size, hidden_size, num_layers,
                                     device=device, dtype=dtype)
            features = hidden_size
        elif seq_model == "transformer":
            self.seq_model = nn.Transformer(
                embedding_size, hidden_size, num_layers, num_head=num_head, dim_head=dim_head,
                dropout=dropout, causal=True, sequence_len=seq_len, device=device, dtype=dtype,
            )
            features = embedding_size
        else:
            raise ValueError(f"seq_model must be 'rnn', 'lstm' or 'transformer', got {seq_model!r}")
        self.features = features
        self.linear = nn.Linear(features, output_size, device=device, dtype=dtype)

    def forward(self, x, h=None):
        if len(x.shape) != 2:
            raise ValueError(f"LanguageModel expects token ids of shape (seq_len, batch), "
                             f"got {tuple(x.shape)}")
        seq_len, batch = x.shape
        out, h = self.seq_model(self.embedding(x), h)
        return self.linear(out.reshape((seq_len * batch, self.features))), h
