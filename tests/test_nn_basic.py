"""needle.init and the basic nn modules against numpy references and finite differences."""
import math

import numpy as np
import pytest
from helpers import numeric_grad, tensor

import needle as ndl
from needle import init, nn

# ---------------------------------------------------------------- init


def test_initialisers_follow_their_formulas():
    np.random.seed(0)
    fan_in, fan_out = 400, 300
    x = init.xavier_uniform(fan_in, fan_out).numpy()
    bound = math.sqrt(6 / (fan_in + fan_out))
    assert x.shape == (fan_in, fan_out) and np.abs(x).max() <= bound
    assert np.std(x) == pytest.approx(bound / math.sqrt(3), rel=0.02)
    assert np.std(init.xavier_normal(fan_in, fan_out, gain=2.0).numpy()) == pytest.approx(
        2 * math.sqrt(2 / (fan_in + fan_out)), rel=0.02)
    k = init.kaiming_uniform(fan_in, fan_out).numpy()
    assert np.abs(k).max() <= math.sqrt(6 / fan_in)
    assert np.std(k) == pytest.approx(math.sqrt(2 / fan_in), rel=0.02)
    assert np.std(init.kaiming_normal(fan_in, fan_out).numpy()) == pytest.approx(
        math.sqrt(2 / fan_in), rel=0.02)
    conv = init.kaiming_uniform(27, 72, shape=(3, 3, 3, 8))
    assert conv.shape == (3, 3, 3, 8)
    u = init.uniform(1000, low=2.0, high=3.0).numpy()
    assert u.min() >= 2.0 and u.max() < 3.0 and u.mean() == pytest.approx(2.5, abs=0.03)
    g = init.normal(20000, mean=1.0, std=0.5).numpy()
    assert g.mean() == pytest.approx(1.0, abs=0.02) and g.std() == pytest.approx(0.5, rel=0.03)
    np.testing.assert_array_equal(init.constant(2, 3, c=7.0).numpy(), np.full((2, 3), 7.0))
    np.testing.assert_array_equal(init.zeros(3).numpy(), np.zeros(3))
    np.testing.assert_array_equal(init.ones(2, 2).numpy(), np.ones((2, 2)))
    np.testing.assert_array_equal(init.one_hot(4, np.array([3, 0])).numpy(), np.eye(4)[[3, 0]])
    with pytest.raises(ValueError, match="nonlinearity"):
        init.kaiming_uniform(3, 3, nonlinearity="swish")


def test_initialisers_are_reproducible_from_numpy_seed():
    np.random.seed(5)
    a = init.kaiming_uniform(8, 4).numpy()
    np.random.seed(5)
    np.testing.assert_array_equal(a, init.kaiming_uniform(8, 4).numpy())


# ---------------------------------------------------------------- Linear and activations


def test_linear_forward_and_gradients_match_numpy(device):
    np.random.seed(1)
    layer = nn.Linear(5, 3, device=device)
    W, b = layer.weight.numpy(), layer.bias.numpy()
    x = np.random.randn(4, 5)
    R = np.random.randn(4, 3)

    def ref(x, W, b):
        return np.sum((x @ W + b) * R)

    X = tensor(x, device)
    out = layer(X)
    np.testing.assert_allclose(out.numpy(), x @ W + b, rtol=1e-5, atol=1e-5)
    (out * tensor(R, device, False)).sum().backward()
    for i, got in enumerate([X.grad, layer.weight.grad, layer.bias.grad]):
        np.testing.assert_allclose(got.numpy(), numeric_grad(ref, [x, W, b], i), rtol=1e-4,
                                   atol=1e-4)


def test_linear_on_3d_input_and_without_bias(device):
    layer = nn.Linear(4, 2, bias=False, device=device)
    x = np.random.randn(2, 3, 4)
    np.testing.assert_allclose(layer(tensor(x, device)).numpy(), x @ layer.weight.numpy(),
                               rtol=1e-5, atol=1e-5)
    assert layer.parameters() == [layer.weight]


def test_linear_rejects_wrong_input_width(device):
    expected = r"Linear expects input of shape \(\.\.\., 5\), got \(2, 4\)"
    with pytest.raises(ValueError, match=expected):
        nn.Linear(5, 3, device=device)(tensor(np.zeros((2, 4)), device))


@pytest.mark.parametrize("module, ref", [
    (nn.ReLU(), lambda x: np.maximum(x, 0)),
    (nn.Tanh(), np.tanh),
    (nn.Sigmoid(), lambda x: 1 / (1 + np.exp(-x))),
    (nn.GELU(), lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))),
    (nn.Identity(), lambda x: x),
    (nn.Flatten(), lambda x: x.reshape(x.shape[0], -1)),
])
def test_activations_match_numpy_values_and_gradients(module, ref, device):
    x = np.random.randn(3, 2, 4) + 0.05  # keep away from relu's kink at 0
    R = np.random.randn(*ref(x).shape)
    X = tensor(x, device)
    out = module(X)
    np.testing.assert_allclose(out.numpy(), ref(x), rtol=1e-5, atol=1e-5)
    (out * tensor(R, device, False)).sum().backward()
    np.testing.assert_allclose(X.grad.numpy(), numeric_grad(lambda x: np.sum(ref(x) * R), [x], 0),
                               rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- losses


def test_softmax_loss_matches_numpy_cross_entropy(device):
    logits = np.random.randn(6, 5) * 3
    labels = np.array([0, 4, 2, 2, 1, 3])

    def ref(z):
        z = z - z.max(axis=1, keepdims=True)
        log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        return -log_p[np.arange(len(labels)), labels].mean()

    Z = tensor(logits, device)
    loss = nn.SoftmaxLoss()(Z, tensor(labels, device, False))
    assert loss.numpy() == pytest.approx(ref(logits), rel=1e-5)
    (loss * 3.0).backward()
    np.testing.assert_allclose(Z.grad.numpy(), 3 * numeric_grad(ref, [logits], 0), atol=1e-5)


def test_softmax_loss_is_stable_for_huge_logits(device):
    logits = np.array([[1000.0, 0.0], [0.0, -1000.0]])
    loss = nn.SoftmaxLoss()(tensor(logits, device), tensor([1, 1], device, False))
    assert loss.numpy() == pytest.approx(1000.0, rel=1e-5)


def test_softmax_loss_rejects_bad_labels(device):
    logits = tensor(np.zeros((3, 4)), device)
    with pytest.raises(ValueError, match="labels"):
        nn.SoftmaxLoss()(logits, tensor([0, 1], device, False))
    with pytest.raises(IndexError, match=r"labels must lie in \[0, 4\)"):
        nn.SoftmaxLoss()(logits, tensor([0, 1, 4], device, False))


def test_mse_loss(device):
    a, b = np.random.randn(3, 4), np.random.randn(3, 4)
    A = tensor(a, device)
    loss = nn.MSELoss()(A, tensor(b, device, False))
    assert loss.numpy() == pytest.approx(np.mean((a - b) ** 2), rel=1e-5)
    loss.backward()
    np.testing.assert_allclose(A.grad.numpy(), 2 * (a - b) / a.size, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="equal shapes"):
        nn.MSELoss()(A, tensor(np.zeros((4, 3)), device))


# ---------------------------------------------------------------- normalisation


def test_batchnorm1d_statistics_and_running_averages(device):
    x = np.random.randn(16, 3) * np.array([1.0, 5.0, 0.1]) + np.array([2.0, -3.0, 0.5])
    bn = nn.BatchNorm1d(3, momentum=0.1, device=device)
    out = bn(tensor(x, device)).numpy()
    np.testing.assert_allclose(out.mean(axis=0), 0, atol=1e-5)
    np.testing.assert_allclose(out.var(axis=0), x.var(axis=0) / (x.var(axis=0) + 1e-5), rtol=1e-4)
    np.testing.assert_allclose(bn.running_mean.numpy(), 0.1 * x.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(bn.running_var.numpy(), 0.9 + 0.1 * x.var(axis=0), rtol=1e-5)
    bn.eval()
    y = np.random.randn(5, 3)
    expected = (y - bn.running_mean.numpy()) / np.sqrt(bn.running_var.numpy() + 1e-5)
    np.testing.assert_allclose(bn(tensor(y, device)).numpy(), expected, rtol=1e-4, atol=1e-5)


def test_batchnorm1d_gradient_matches_finite_differences(device):
    x, R = np.random.randn(6, 4), np.random.randn(6, 4)
    bn = nn.BatchNorm1d(4, device=device)
    w, b = np.random.randn(4), np.random.randn(4)
    bn.weight.data = tensor(w, device)
    bn.bias.data = tensor(b, device)

    def ref(x, w, b):
        y = (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5) * w + b
        return np.sum(y * R)

    X = tensor(x, device)
    (bn(X) * tensor(R, device, False)).sum().backward()
    for i, got in enumerate([X.grad, bn.weight.grad, bn.bias.grad]):
        np.testing.assert_allclose(got.numpy(), numeric_grad(ref, [x, w, b], i), rtol=1e-3,
                                   atol=1e-3)


def test_batchnorm2d_normalises_each_channel_over_batch_and_pixels(device):
    x = np.random.randn(4, 3, 5, 5) * np.array([1, 3, 0.5])[None, :, None, None]
    bn = nn.BatchNorm2d(3, device=device)
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    var = x.var(axis=(0, 2, 3), keepdims=True)
    np.testing.assert_allclose(bn(tensor(x, device)).numpy(), (x - mean) / np.sqrt(var + 1e-5),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(bn.running_mean.numpy(), 0.1 * mean.ravel(), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match=r"BatchNorm2d expects input of shape \(\*, 3, \*, \*\)"):
        bn(tensor(np.zeros((2, 4, 5, 5)), device))


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm2d_gradients_match_finite_differences(training, device):
    x, R = np.random.randn(3, 2, 2, 3), np.random.randn(3, 2, 2, 3)
    bn = nn.BatchNorm2d(2, device=device)
    w, b = np.random.randn(2), np.random.randn(2)
    bn.weight.data = tensor(w, device)
    bn.bias.data = tensor(b, device)
    mean, var = np.array([0.3, -0.2]), np.array([1.5, 0.7])
    bn.running_mean.data = tensor(mean, device)
    bn.running_var.data = tensor(var, device)
    if not training:
        bn.eval()

    def ref(x, w, b):
        shape = (1, 2, 1, 1)
        mu = x.mean((0, 2, 3), keepdims=True) if training else mean.reshape(shape)
        sigma2 = x.var((0, 2, 3), keepdims=True) if training else var.reshape(shape)
        y = (x - mu) / np.sqrt(sigma2 + 1e-5) * w.reshape(shape) + b.reshape(shape)
        return np.sum(y * R)

    X = tensor(x, device)
    (bn(X) * tensor(R, device, False)).sum().backward()
    for i, got in enumerate([X.grad, bn.weight.grad, bn.bias.grad]):
        np.testing.assert_allclose(got.numpy(), numeric_grad(ref, [x, w, b], i), rtol=1e-3,
                                   atol=1e-3)


def test_layernorm_matches_numpy_and_finite_differences(device):
    x, R = np.random.randn(2, 3, 5), np.random.randn(2, 3, 5)
    ln = nn.LayerNorm1d(5, device=device)
    w, b = np.random.randn(5), np.random.randn(5)
    ln.weight.data = tensor(w, device)
    ln.bias.data = tensor(b, device)

    def forward(x, w, b):
        return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w + b

    X = tensor(x, device)
    out = ln(X)
    np.testing.assert_allclose(out.numpy(), forward(x, w, b), rtol=1e-4, atol=1e-5)
    (out * tensor(R, device, False)).sum().backward()
    for i, got in enumerate([X.grad, ln.weight.grad, ln.bias.grad]):
        grad = numeric_grad(lambda *a: np.sum(forward(*a) * R), [x, w, b], i)
        np.testing.assert_allclose(got.numpy(), grad, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="LayerNorm1d"):
        ln(tensor(np.zeros((2, 4)), device))


def test_dropout_zeroes_and_rescales_in_training_only(device):
    np.random.seed(0)
    x = np.ones((200, 50))
    drop = nn.Dropout(0.3)
    out = drop(tensor(x, device)).numpy()
    np.testing.assert_allclose(np.unique(out), [0.0, 1 / 0.7], rtol=1e-6)
    assert (out == 0).mean() == pytest.approx(0.3, abs=0.02)
    drop.eval()
    np.testing.assert_array_equal(drop(tensor(x, device)).numpy(), x)
    with pytest.raises(ValueError, match="Dropout probability"):
        nn.Dropout(1.0)


# ---------------------------------------------------------------- containers and Module


def test_sequential_and_residual_compose(device):
    lin = nn.Linear(4, 4, device=device)
    model = nn.Sequential(nn.Residual(nn.Sequential(lin, nn.ReLU())), nn.Tanh())
    x = np.random.randn(3, 4)
    W, b = lin.weight.numpy(), lin.bias.numpy()
    expected = np.tanh(np.maximum(x @ W + b, 0) + x)
    np.testing.assert_allclose(model(tensor(x, device)).numpy(), expected, rtol=1e-5, atol=1e-5)
    assert len(model.parameters()) == 2


def test_module_tree_parameters_buffers_and_modes():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.1), nn.Linear(4, 2))
    params = model.parameters()
    assert [tuple(p.shape) for p in params] == [(3, 4), (1, 4), (4,), (4,), (4, 2), (1, 2)]
    assert all(isinstance(p, nn.Parameter) for p in params)
    assert sorted(model.state_dict()) == sorted([
        "modules.0.weight", "modules.0.bias", "modules.1.weight", "modules.1.bias",
        "modules.1.running_mean", "modules.1.running_var", "modules.3.weight", "modules.3.bias",
    ])
    children = [type(m).__name__ for m in model.children()]
    assert children == ["Linear", "BatchNorm1d", "Dropout", "Linear"]
    model.eval()
    assert not any(m.training for m in model.children()) and not model.training
    model.train()
    assert all(m.training for m in model.children())


def test_shared_parameters_are_listed_once():
    lin = nn.Linear(2, 2)
    assert len(nn.Sequential(lin, lin).parameters()) == 2


def test_load_state_dict_round_trip_and_clear_errors():
    np.random.seed(0)
    a = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    a(tensor(np.random.randn(5, 3), ndl.cpu_numpy()))  # moves running statistics
    b = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    b.load_state_dict(a.state_dict())
    for key, value in a.state_dict().items():
        np.testing.assert_array_equal(b.state_dict()[key], value)
    before = b.state_dict()
    with pytest.raises(KeyError, match=r"missing \['modules.1.running_var'\]"):
        b.load_state_dict({k: v for k, v in a.state_dict().items() if "running_var" not in k})
    bad = {**a.state_dict(), "modules.0.weight": np.zeros((4, 3), dtype=np.float32)}
    with pytest.raises(ValueError, match=r"'modules.0.weight' has shape \(4, 3\).*\(3, 4\)"):
        b.load_state_dict(bad)
    text = {**a.state_dict(), "modules.0.bias": np.array([["x"] * 4])}
    with pytest.raises(TypeError, match="'modules.0.bias' has non-numeric dtype"):
        b.load_state_dict(text)
    for key, value in before.items():  # a rejected state changes nothing
        np.testing.assert_array_equal(b.state_dict()[key], value)
