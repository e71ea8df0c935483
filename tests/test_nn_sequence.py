"""RNN, LSTM and Embedding against a plain numpy implementation and finite differences."""
import numpy as np
import pytest
from helpers import tensor

from needle import nn


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def rnn_reference(X, h0, layers, nonlinearity=np.tanh):
    """layers: [(W_ih, W_hh, b_ih, b_hh)]; X (T, B, I), h0 (L, B, H)."""
    h_final = []
    for (W_ih, W_hh, b_ih, b_hh), h in zip(layers, h0, strict=True):
        outputs = []
        for x in X:
            h = nonlinearity(x @ W_ih + b_ih + h @ W_hh + b_hh)
            outputs.append(h)
        X = np.stack(outputs)
        h_final.append(h)
    return X, np.stack(h_final)


def lstm_reference(X, h0, c0, layers):
    """Gates (i, f, g, o) as PyTorch lays them out."""
    h_final, c_final = [], []
    for (W_ih, W_hh, b_ih, b_hh), h, c in zip(layers, h0, c0, strict=True):
        outputs = []
        for x in X:
            i, f, g, o = np.split(x @ W_ih + b_ih + h @ W_hh + b_hh, 4, axis=1)
            c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
            h = sigmoid(o) * np.tanh(c)
            outputs.append(h)
        X = np.stack(outputs)
        h_final.append(h)
        c_final.append(c)
    return X, np.stack(h_final), np.stack(c_final)


def weights(cells):
    return [tuple(getattr(c, n).numpy() for n in ("W_ih", "W_hh", "bias_ih", "bias_hh"))
            for c in cells]


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_rnn_matches_numpy(nonlinearity, device):
    np.random.seed(0)
    T, B, I, H, L = 4, 3, 5, 6, 2
    rnn = nn.RNN(I, H, num_layers=L, nonlinearity=nonlinearity, device=device)
    X, h0 = np.random.randn(T, B, I), np.random.randn(L, B, H)
    fn = np.tanh if nonlinearity == "tanh" else (lambda z: np.maximum(z, 0))
    out, h_n = rnn(tensor(X, device), tensor(h0, device))
    ref_out, ref_h = rnn_reference(X, h0, weights(rnn.rnn_cells), fn)
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(h_n.numpy(), ref_h, rtol=1e-4, atol=1e-5)
    out, _ = rnn(tensor(X, device))  # no h0: zeros
    np.testing.assert_allclose(out.numpy(), rnn_reference(X, np.zeros_like(h0),
                               weights(rnn.rnn_cells), fn)[0], rtol=1e-4, atol=1e-5)


def test_lstm_matches_numpy(device):
    np.random.seed(1)
    T, B, I, H, L = 5, 2, 3, 4, 2
    lstm = nn.LSTM(I, H, num_layers=L, device=device)
    X, h0, c0 = np.random.randn(T, B, I), np.random.randn(L, B, H), np.random.randn(L, B, H)
    out, (h_n, c_n) = lstm(tensor(X, device), (tensor(h0, device), tensor(c0, device)))
    ref = lstm_reference(X, h0, c0, weights(lstm.lstm_cells))
    for got, expected in zip((out, h_n, c_n), ref, strict=True):
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-5)


def test_lstm_gradients_match_finite_differences(device):
    np.random.seed(2)
    T, B, I, H = 3, 2, 3, 2
    lstm = nn.LSTM(I, H, num_layers=2, device=device)
    X = np.random.randn(T, B, I)
    R = np.random.randn(T, B, H)
    layers = weights(lstm.lstm_cells)
    zeros = np.zeros((2, B, H))

    def loss(X, W_ih0, W_hh0):
        cells = [(W_ih0, W_hh0, *layers[0][2:]), layers[1]]
        return np.sum(lstm_reference(X, zeros, zeros, cells)[0] * R)

    Xt = tensor(X, device)
    out, _ = lstm(Xt)
    (out * tensor(R, device, False)).sum().backward()
    cell = lstm.lstm_cells[0]
    arrays = [np.float64(a) for a in (X, layers[0][0], layers[0][1])]
    for i, got in enumerate([Xt.grad, cell.W_ih.grad, cell.W_hh.grad]):
        grad = np.zeros_like(arrays[i])
        for idx in np.ndindex(*grad.shape):
            up = [a.copy() for a in arrays]
            down = [a.copy() for a in arrays]
            up[i][idx] += 1e-6
            down[i][idx] -= 1e-6
            grad[idx] = (loss(*up) - loss(*down)) / 2e-6
        np.testing.assert_allclose(got.numpy(), grad, rtol=1e-3, atol=1e-4)


def test_cells_single_step(device):
    cell = nn.LSTMCell(3, 2, device=device)
    x = np.random.randn(4, 3)
    h, c = cell(tensor(x, device))
    _, h_ref, c_ref = lstm_reference(x[None], np.zeros((1, 4, 2)), np.zeros((1, 4, 2)),
                                     weights([cell]))
    np.testing.assert_allclose(h.numpy(), h_ref[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(c.numpy(), c_ref[0], rtol=1e-4, atol=1e-5)
    rnn_cell = nn.RNNCell(3, 2, bias=False, device=device)
    assert len(rnn_cell.parameters()) == 2
    np.testing.assert_allclose(rnn_cell(tensor(x, device)).numpy(),
                               np.tanh(x @ rnn_cell.W_ih.numpy()), rtol=1e-4, atol=1e-5)


def test_recurrent_layers_reject_wrong_feature_size(device):
    with pytest.raises(ValueError, match=r"LSTM expects input of shape \(\*, \*, 3\)"):
        nn.LSTM(3, 2, device=device)(tensor(np.zeros((2, 2, 4)), device))
    with pytest.raises(ValueError, match="RNNCell"):
        nn.RNNCell(3, 2, device=device)(tensor(np.zeros((2, 4)), device))
    with pytest.raises(ValueError, match="nonlinearity"):
        nn.RNN(3, 2, nonlinearity="gelu")


def test_embedding_looks_up_rows_and_accumulates_gradients(device):
    emb = nn.Embedding(7, 3, device=device)
    idx = np.array([[1, 6], [1, 0], [3, 1]])
    out = emb(tensor(idx, device, False))
    np.testing.assert_allclose(out.numpy(), emb.weight.numpy()[idx], rtol=1e-6)
    out.sum().backward()
    counts = np.bincount(idx.ravel(), minlength=7)[:, None] * np.ones((1, 3))
    np.testing.assert_allclose(emb.weight.grad.numpy(), counts)
    with pytest.raises(ValueError, match=r"Embedding index out of range \[0, 7\)"):
        emb(tensor([[7]], device, False))
