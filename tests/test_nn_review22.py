"""Review of the sequence, attention and convolution modules: bad sizes and states are refused
with a ValueError naming the layer (they were silently misread, or failed later with an
IndexError, ZeroDivisionError or TypeError), plus numpy checks of cases the other tests skip."""
import numpy as np
import pytest
from helpers import numeric_grad, tensor
from test_nn_conv import conv_reference
from test_nn_sequence import lstm_reference, rnn_reference

from needle import nn, ops

# ---------------------------------------------------------------- convolution


@pytest.mark.parametrize("kwargs, message", [
    ({"kernel_size": (3, 5)}, r"kernel_size must be one int or a pair of equal ints, got \(3, 5\)"),
    ({"stride": (1, 2)}, r"stride must be one int or a pair of equal ints, got \(1, 2\)"),
    ({"kernel_size": 0}, "kernel_size must be a positive int, got 0"),  # ZeroDivisionError
    ({"kernel_size": 2.0}, "kernel_size must be a positive int, got 2.0"),  # TypeError
    ({"stride": 0}, "stride must be a positive int, got 0"),  # accepted until forward
    ({"in_channels": 0}, "in_channels must be a positive int, got 0"),  # ZeroDivisionError
])
def test_conv_refuses_sizes_it_would_misread(kwargs, message):
    """A (3, 5) kernel used to become 3x3 and a (1, 2) stride 1, silently."""
    sizes = {"in_channels": 2, "out_channels": 3, "kernel_size": 3, "stride": 1} | kwargs
    with pytest.raises(ValueError, match=f"Conv: {message}"):
        nn.Conv(**sizes)


def test_conv_still_takes_a_square_tuple(device):
    conv = nn.Conv(2, 3, (3, 3), stride=(2, 2), device=device)
    assert (conv.kernel_size, conv.stride, conv.weight.shape) == (3, 2, (3, 3, 2, 3))


@pytest.mark.parametrize("stride, padding", [(1.5, 0), (1, 1.0)])
def test_conv_op_refuses_non_integer_stride_and_padding(stride, padding, device):
    x, w = tensor(np.ones((1, 5, 5, 2)), device), tensor(np.ones((3, 3, 2, 1)), device)
    with pytest.raises(ValueError, match="conv needs an int stride and padding"):
        ops.conv(x, w, stride=stride, padding=padding)


def test_conv_layer_on_a_non_square_image_with_an_even_kernel(device):
    """Coverage: 5x7 input, kernel 2 (output one pixel taller and wider before striding),
    stride 2, no bias; output and gradients against loops and finite differences."""
    rng = np.random.default_rng(0)
    conv = nn.Conv(2, 3, 2, stride=2, bias=False, device=device)
    x, w = rng.standard_normal((1, 2, 5, 7)), conv.weight.numpy()
    expected = conv_reference(x, w, 0.0, 2)
    X = tensor(x, device)
    out = conv(X)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)
    R = rng.standard_normal(expected.shape)
    (out * tensor(R, device, False)).sum().backward()
    for i, got in enumerate([X.grad, conv.weight.grad]):
        grad = numeric_grad(lambda x, w: np.sum(conv_reference(x, w, 0.0, 2) * R), [x, w], i)
        np.testing.assert_allclose(got.numpy(), grad, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- recurrent layers


@pytest.mark.parametrize("make, message", [
    (lambda: nn.RNN(3, 4, num_layers=0), "RNN: num_layers must be a positive int, got 0"),
    (lambda: nn.LSTM(3, 4, num_layers=0), "LSTM: num_layers must be a positive int, got 0"),
    (lambda: nn.LSTM(3, 0), "LSTMCell: hidden_size must be a positive int, got 0"),
])
def test_recurrent_layers_need_a_layer_and_a_hidden_unit(make, message):
    """No layer failed in forward with an IndexError, no hidden unit in 1 / sqrt(0)."""
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("layer", [nn.RNN, nn.LSTM])
def test_recurrent_layers_refuse_an_empty_sequence(layer, device):
    """It has no final state: LSTM failed with a TypeError on None, RNN inside stack."""
    with pytest.raises(ValueError, match=rf"{layer.__name__} expects at least one time step, "
                                         r"got input of shape \(0, 2, 3\)"):
        layer(3, 4, device=device)(tensor(np.zeros((0, 2, 3)), device))


@pytest.mark.parametrize("make, shape", [(nn.LSTMCell, (2, 4)), (nn.LSTM, (1, 2, 4))])
def test_lstm_state_with_a_missing_part_is_refused(make, shape, device):
    """(h, None) failed deep inside the cell (float(None)) or in the shape check."""
    x = tensor(np.zeros((2, 3) if make is nn.LSTMCell else (5, 2, 3)), device)
    with pytest.raises(ValueError, match=r"expects its state as a pair \(h, c\) of Tensors, "
                                         r"got \(Tensor, NoneType\)"):
        make(3, 4, device=device)(x, (tensor(np.zeros(shape), device), None))


@pytest.mark.parametrize("kind", ["tanh", "relu", "lstm"])
def test_recurrent_layers_without_bias_with_a_state_batch_one_and_one_step(kind, device):
    """Coverage: two stacked layers, bias=False, a given initial state, batch 1, length 1."""
    rng = np.random.default_rng(1)
    x, h0, c0 = (rng.standard_normal(s) for s in [(1, 1, 3), (2, 1, 4), (2, 1, 4)])
    if kind == "lstm":
        model = nn.LSTM(3, 4, 2, bias=False, device=device)
        layers = [(c.W_ih.numpy(), c.W_hh.numpy(), 0, 0) for c in model.lstm_cells]
        out, (h, c) = model(tensor(x, device), (tensor(h0, device), tensor(c0, device)))
        got, expected = (out, h, c), lstm_reference(x, h0, c0, layers)
    else:
        model = nn.RNN(3, 4, 2, bias=False, nonlinearity=kind, device=device)
        layers = [(c.W_ih.numpy(), c.W_hh.numpy(), 0, 0) for c in model.rnn_cells]
        act = np.tanh if kind == "tanh" else (lambda z: np.maximum(z, 0))
        got = model(tensor(x, device), tensor(h0, device))
        expected = rnn_reference(x, h0, layers, act)
    assert len(model.parameters()) == 4
    for tensor_out, array in zip(got, expected, strict=True):
        np.testing.assert_allclose(tensor_out.numpy(), array, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("num_head, dim_head, name, value", [
    (0, 4, "num_head", "0"), (2.0, 4, "num_head", "2.0"), (2, 0, "dim_head", "0"),
])
def test_attention_layer_head_sizes_must_be_positive_ints(num_head, dim_head, name, value):
    """They failed inside Linear's initialiser or a reshape, naming neither."""
    with pytest.raises(ValueError, match=f"AttentionLayer: {name} must be a positive int, "
                                         f"got {value}"):
        nn.AttentionLayer(8, num_head, dim_head)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, 1e30])
def test_ids_beyond_int64_are_refused_as_such(bad, device):
    """inf or 1e30 as an embedding index or label was cast to -2^63 (with numpy's "invalid
    value in cast" warning) and then reported as an index of -9223372036854775808."""
    import warnings

    ids = tensor([[1.0], [bad]], device, requires_grad=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="Embedding indices must be integers within "
                                             "int64's range, got -?(inf|1.0+\\d*e\\+30)"):
            nn.Embedding(5, 3, device=device)(ids)
        with pytest.raises(ValueError, match="labels must be integers within int64's range"):
            nn.SoftmaxLoss()(tensor(np.zeros((2, 3)), device), ids.reshape((2,)))
