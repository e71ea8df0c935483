"""Recurrent layers and embeddings; sequences are (seq_len, batch, features) as in CMU needle."""
import math

from needle import init, ops
from needle.autograd import Tensor
from needle.ops.ops_nn import integer_ids

from .nn_basic import Module, Parameter, check_positive_ints, check_shape

__all__ = [
    "RNNCell",
    "RNN",
    "LSTMCell",
    "LSTM",
    "Embedding",
]


def _uniform(*shape, bound, device, dtype):
    return Parameter(init.rand(*shape, low=-bound, high=bound, device=device, dtype=dtype))


def _state_pair(module: Module, h) -> tuple[Tensor, Tensor]:
    """An LSTM state must be a pair (h, c) of Tensors: a lone Tensor would be split along its
    rows, and a None in the pair would fail deep inside the cell (c is not optional)."""
    if isinstance(h, Tensor) or len(h) != 2:
        raise ValueError(f"{type(module).__name__} expects its state as a pair (h, c), "
                         f"got {type(h).__name__}")
    if not all(isinstance(state, Tensor) for state in h):
        raise ValueError(f"{type(module).__name__} expects its state as a pair (h, c) of "
                         f"Tensors, got ({', '.join(type(state).__name__ for state in h)})")
    return h[0], h[1]


def _check_state_tensor(module: Module, state, what: str) -> None:
    """An RNN state is one Tensor: an LSTM's (h, c) pair, or a list, failed with an
    AttributeError (no .shape) instead of saying what was wrong."""
    if state is not None and not isinstance(state, Tensor):
        raise ValueError(f"{type(module).__name__} expects {what} as a Tensor, "
                         f"got {type(state).__name__}")


def _check_sequence(module: Module, X: Tensor, input_size: int) -> None:
    """X must be (seq_len, batch, input_size) with seq_len >= 1: with no step there is no
    final state to return (PyTorch refuses it too)."""
    check_shape(module, X, 3, {2: input_size})
    if X.shape[0] == 0:
        raise ValueError(f"{type(module).__name__} expects at least one time step, "
                         f"got input of shape {tuple(X.shape)}")


class _Cell(Module):
    """Weights shared by RNN and LSTM cells: gates = x W_ih + h W_hh + b_ih + b_hh."""

    def __init__(self, input_size, hidden_size, gates, bias, device, dtype):
        super().__init__()
        check_positive_ints(self, hidden_size=hidden_size)  # the bound is 1 / sqrt(hidden_size)
        self.input_size = input_size
        self.hidden_size = hidden_size
        bound = 1.0 / math.sqrt(hidden_size)
        width = gates * hidden_size
        self.W_ih = _uniform(input_size, width, bound=bound, device=device, dtype=dtype)
        self.W_hh = _uniform(hidden_size, width, bound=bound, device=device, dtype=dtype)
        self.bias_ih = self.bias_hh = None
        if bias:
            self.bias_ih = _uniform(width, bound=bound, device=device, dtype=dtype)
            self.bias_hh = _uniform(width, bound=bound, device=device, dtype=dtype)

    def check(self, X: Tensor, **states: Tensor | None) -> None:
        """X must be (batch, input_size) and each given state (batch, hidden_size): a wrong
        state would otherwise fail deep in matmul/add, or broadcast a batch of 1 silently."""
        check_shape(self, X, 2, {1: self.input_size})
        for what, state in states.items():
            _check_state_tensor(self, state, what)
            if state is not None:
                check_shape(self, state, 2, {0: X.shape[0], 1: self.hidden_size}, what)

    def gates(self, X: Tensor, h: Tensor) -> Tensor:
        out = X @ self.W_ih + h @ self.W_hh
        if self.bias_ih is not None:
            bias = (self.bias_ih + self.bias_hh).reshape((1, self.W_ih.shape[1]))
            out = out + ops.broadcast_to(bias, out.shape)
        return out

    def zeros(self, X: Tensor) -> Tensor:
        """The default initial state: zeros for X's batch, on X's device."""
        return init.zeros(X.shape[0], self.hidden_size, device=X.device)


class RNNCell(_Cell):
    """h' = tanh(x W_ih + h W_hh + b) (or relu)."""

    def __init__(self, input_size, hidden_size, bias=True, nonlinearity="tanh",
                 device=None, dtype="float32"):
        super().__init__(input_size, hidden_size, 1, bias, device, dtype)
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
        self.nonlinearity = ops.tanh if nonlinearity == "tanh" else ops.relu

    def forward(self, X: Tensor, h: Tensor | None = None) -> Tensor:
        self.check(X, h=h)
        h = self.zeros(X) if h is None else h
        return self.nonlinearity(self.gates(X, h))


class LSTMCell(_Cell):
    """One LSTM step; gates are laid out (input, forget, cell, output) as in PyTorch."""

    def __init__(self, input_size, hidden_size, bias=True, device=None, dtype="float32"):
        super().__init__(input_size, hidden_size, 4, bias, device, dtype)

    def forward(self, X: Tensor, h: tuple[Tensor, Tensor] | None = None):
        h0, c0 = (None, None) if h is None else _state_pair(self, h)
        self.check(X, h=h0, c=c0)
        if h is None:
            h0 = c0 = self.zeros(X)
        batch, hidden = X.shape[0], self.hidden_size
        i, f, g, o = ops.split(self.gates(X, h0).reshape((batch, 4, hidden)), axis=1)
        c = ops.sigmoid(f) * c0 + ops.sigmoid(i) * ops.tanh(g)
        return ops.sigmoid(o) * ops.tanh(c), c


class RNN(Module):
    """A stack of RNNCells over a sequence; returns (outputs of the last layer, final h)."""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, nonlinearity="tanh",
                 device=None, dtype="float32"):
        super().__init__()
        check_positive_ints(self, num_layers=num_layers)  # forward reads the first cell
        self.rnn_cells = [
            RNNCell(input_size if k == 0 else hidden_size, hidden_size, bias, nonlinearity,
                    device, dtype)
            for k in range(num_layers)
        ]

    def forward(self, X: Tensor, h0: Tensor | None = None):
        first = self.rnn_cells[0]
        _check_sequence(self, X, first.input_size)
        _check_state_tensor(self, h0, "h0")
        if h0 is not None:
            expected = {0: len(self.rnn_cells), 1: X.shape[1], 2: first.hidden_size}
            check_shape(self, h0, 3, expected, "h0")
        layer_input = list(ops.split(X, axis=0))
        h_start = [None] * len(self.rnn_cells) if h0 is None else list(ops.split(h0, axis=0))
        h_final = []
        for cell, h in zip(self.rnn_cells, h_start, strict=True):
            outputs = []
            for x in layer_input:
                h = cell(x, h)
                outputs.append(h)
            h_final.append(h)
            layer_input = outputs
        return ops.stack(layer_input, 0), ops.stack(h_final, 0)


class LSTM(Module):
    """A stack of LSTMCells; returns (outputs of the last layer, (final h, final c))."""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True,
                 device=None, dtype="float32"):
        super().__init__()
        check_positive_ints(self, num_layers=num_layers)  # forward reads the first cell
        self.lstm_cells = [
            LSTMCell(input_size if k == 0 else hidden_size, hidden_size, bias, device, dtype)
            for k in range(num_layers)
        ]

    def forward(self, X: Tensor, h: tuple[Tensor, Tensor] | None = None):
        first = self.lstm_cells[0]
        _check_sequence(self, X, first.input_size)
        layer_input = list(ops.split(X, axis=0))
        if h is None:
            h_start = [None] * len(self.lstm_cells)
        else:
            h0, c0 = _state_pair(self, h)
            expected = {0: len(self.lstm_cells), 1: X.shape[1], 2: first.hidden_size}
            check_shape(self, h0, 3, expected, "h0")
            check_shape(self, c0, 3, expected, "c0")
            h_start = list(zip(ops.split(h0, axis=0), ops.split(c0, axis=0), strict=True))
        h_final, c_final = [], []
        for cell, state in zip(self.lstm_cells, h_start, strict=True):
            outputs = []
            for x in layer_input:
                state = cell(x, state)
                outputs.append(state[0])
            h_final.append(state[0])
            c_final.append(state[1])
            layer_input = outputs
        return ops.stack(layer_input, 0), (ops.stack(h_final, 0), ops.stack(c_final, 0))


class Embedding(Module):
    """Rows of a learned (num_embeddings, embedding_dim) table, looked up by integer index."""

    def __init__(self, num_embeddings, embedding_dim, device=None, dtype="float32"):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = Parameter(
            init.randn(num_embeddings, embedding_dim, device=device, dtype=dtype)
        )

    def forward(self, x: Tensor) -> Tensor:
        """x: integer indices of any shape -> (*x.shape, embedding_dim)."""
        indices = integer_ids(x, "Embedding indices")
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_embeddings):
            raise ValueError(
                f"Embedding index out of range [0, {self.num_embeddings}): "
                f"min {indices.min()}, max {indices.max()}"
            )
        one_hot = init.one_hot(self.num_embeddings, indices.reshape(-1), device=self.weight.device)
        return (one_hot @ self.weight).reshape((*indices.shape, self.embedding_dim))
