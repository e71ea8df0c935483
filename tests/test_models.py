"""Model zoo shapes and training steps; checkpoint round trips and their error handling."""
import numpy as np
import pytest

import needle as ndl
from needle import checkpoint, models, nn, optim

CPU = ndl.cpu()


def tensor(a, requires_grad=False):
    return ndl.Tensor(np.asarray(a, dtype=np.float32), device=CPU, requires_grad=requires_grad)


def train_step(model, X, y, opt):
    opt.reset_grad()
    logits = model(X)
    loss = nn.SoftmaxLoss()(logits if not isinstance(logits, tuple) else logits[0], y)
    loss.backward()
    opt.step()
    return float(loss.numpy())


def test_mlp_structure_and_forward():
    np.random.seed(0)
    model = models.MLP(6, (8, 5), 3, device=CPU)
    assert [tuple(p.shape) for p in model.parameters()] == [(6, 8), (1, 8), (8, 5), (1, 5),
                                                             (5, 3), (1, 3)]
    x = np.random.randn(4, 6)
    W = [p.numpy() for p in model.parameters()]
    h = np.maximum(x @ W[0] + W[1], 0)
    h = np.maximum(h @ W[2] + W[3], 0)
    np.testing.assert_allclose(model(tensor(x)).numpy(), h @ W[4] + W[5], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("build, shape", [
    (lambda: models.ResNet9(device=CPU), (2, 3, 32, 32)),
    (lambda: models.ResNet18(10, width=4, device=CPU), (2, 3, 32, 32)),
    (lambda: models.SmallResNet(1, 10, width=4, device=CPU), (3, 1, 8, 8)),
])
def test_conv_models_produce_logits_and_learn_a_batch(build, shape):
    np.random.seed(0)
    model = build()
    X = tensor(np.random.rand(*shape))
    y = tensor(np.arange(shape[0]) % 10)
    assert model(X).shape == (shape[0], 10)
    opt = optim.Adam(model.parameters(), lr=0.01)
    losses = [train_step(model, X, y, opt) for _ in range(4)]
    assert losses[-1] < losses[0]
    assert all(p.grad is not None for p in model.parameters())


def test_resnet18_has_the_standard_layout():
    model = models.ResNet18(10, device=CPU)  # width 64: the real network, built not run
    n_params = sum(int(np.prod(p.shape)) for p in model.parameters())
    assert n_params == 11_173_962  # PyTorch's CIFAR ResNet-18 (conv without bias, BN affine)
    convs = [m for m in model.children() if isinstance(m, nn.Conv)]
    assert len(convs) == 1 + 16 + 3  # stem, 8 blocks x 2, 3 projection shortcuts


@pytest.mark.parametrize("seq_model", ["rnn", "lstm", "transformer"])
def test_language_models_shapes_and_learning(seq_model):
    np.random.seed(0)
    vocab, seq_len, batch = 11, 6, 3
    model = models.LanguageModel(8, vocab, 12, num_layers=2, seq_model=seq_model,
                                 seq_len=seq_len, num_head=2, dim_head=4, device=CPU)
    X = tensor(np.random.randint(0, vocab, (seq_len, batch)))
    y = tensor(np.random.randint(0, vocab, seq_len * batch))
    logits, h = model(X)
    assert logits.shape == (seq_len * batch, vocab)
    if seq_model == "lstm":
        assert h[0].shape == h[1].shape == (2, batch, 12)
    opt = optim.Adam(model.parameters(), lr=0.01)
    losses = [train_step(model, X, y, opt) for _ in range(5)]
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="seq_model must be"):
        models.LanguageModel(8, vocab, 12, seq_model="gru")


def test_checkpoint_round_trip_restores_outputs_and_optimizer(tmp_path):
    np.random.seed(0)
    model = models.SmallResNet(1, 10, width=4, device=CPU)
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    X, y = tensor(np.random.rand(4, 1, 8, 8)), tensor([1, 2, 3, 4])
    for _ in range(2):
        train_step(model, X, y, opt)
    path = str(tmp_path / "ckpt.npz")
    checkpoint.save(path, model, opt)
    model.eval()
    expected_eval = model(X).numpy()
    model.train()
    train_step(model, X, y, opt)
    expected_next = model.state_dict()

    np.random.seed(1)  # different initial weights
    clone = models.SmallResNet(1, 10, width=4, device=CPU)
    clone_opt = optim.SGD(clone.parameters(), lr=0.5, momentum=0.9)
    checkpoint.load(path, clone, clone_opt)
    assert clone_opt.lr == 0.05
    clone.eval()
    np.testing.assert_array_equal(clone(X).numpy(), expected_eval)  # BN running stats included
    clone.train()
    train_step(clone, X, y, clone_opt)  # momentum buffers restored: the same next step
    for key, value in expected_next.items():
        np.testing.assert_allclose(clone.state_dict()[key], value, rtol=1e-5, atol=1e-6)


def test_checkpoint_errors_are_clear_and_leave_the_model_unchanged(tmp_path):
    model = models.MLP(4, (5,), 3, device=CPU)
    path = str(tmp_path / "mlp.npz")
    checkpoint.save(path, model)
    before = model.state_dict()
    with pytest.raises(KeyError, match="missing"):
        checkpoint.load(path, models.MLP(4, (5, 5), 3, device=CPU))
    with pytest.raises(ValueError, match="has shape"):
        checkpoint.load(path, models.MLP(4, (6,), 3, device=CPU))
    with pytest.raises(ValueError, match="no optimizer state"):
        checkpoint.load(path, model, optim.Adam(model.parameters()))
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(b"PK\x03\x04 this is not a zip")
    with pytest.raises(ValueError, match="not a readable needle checkpoint"):
        checkpoint.load(str(corrupt), model)
    for key, value in before.items():
        np.testing.assert_array_equal(model.state_dict()[key], value)
