"""Review 25 of needle as a user training models: each test failed before its fix. References
are numpy (the batch statistics, a dataset's own examples) and the eager mode of autograd."""
import gzip
import pickle
import struct

import numpy as np
import pytest

import needle as ndl
from needle import autograd, data, nn
from tests.helpers import tensor

CPU = ndl.cpu()
RNG = np.random.default_rng(25)


@pytest.mark.parametrize("make, shape", [(nn.BatchNorm1d, (6, 3)), (nn.BatchNorm2d, (4, 3, 2, 2))],
                         ids=["1d", "2d"])
def test_batchnorm_trains_in_lazy_mode_as_in_eager_mode(make, shape, monkeypatch):
    """In LAZY_MODE the op had not computed when the layer read its batch statistics for the
    running averages: AttributeError 'BatchNorm' object has no attribute 'mean'."""
    layer = make(3, device=CPU)
    x_np = RNG.standard_normal(shape).astype(np.float32) * 2.0 + 1.0
    axes = (0,) if len(shape) == 2 else (0, 2, 3)

    def step():
        layer.running_mean = ndl.init.zeros(3, device=CPU)
        layer.running_var = ndl.init.ones(3, device=CPU)
        x = tensor(x_np, CPU)
        out = layer(x)
        (out * out).sum().backward()
        return out.numpy(), x.grad.numpy(), layer.running_mean.numpy(), layer.running_var.numpy()

    eager = step()
    monkeypatch.setattr(autograd, "LAZY_MODE", True)
    lazy = step()
    for got, expected in zip(lazy, eager, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    mean, var = x_np.mean(axis=axes), x_np.var(axis=axes)
    np.testing.assert_allclose(lazy[2], 0.1 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lazy[3], 0.9 + 0.1 * var, rtol=1e-5)


class Doubled(data.ArrayDataset):
    """A user's dataset: ArrayDataset's rows, but its examples are the inputs doubled."""

    def __getitem__(self, index):
        x, y = super().__getitem__(index)
        return x * 2.0, y + 10


class Shifted(data.NDArrayDataset):
    def __getitem__(self, index):
        a, b = super().__getitem__(index)
        return a + 100.0, b


@pytest.mark.parametrize("shuffle", [False, True])
def test_dataloader_gives_a_subclass_its_own_examples(shuffle):
    """DataLoader read ArrayDataset / NDArrayDataset rows straight from the arrays, so a
    subclass's __getitem__ was silently skipped: dataset[i] and the batches disagreed."""
    X = RNG.standard_normal((7, 3)).astype(np.float32)
    y = np.arange(7, dtype=np.float32)
    for dataset in (Doubled(X, y), Shifted(X, y)):
        loader = data.DataLoader(dataset, batch_size=3, shuffle=shuffle, seed=1)
        xs, ys = zip(*[(a.numpy(), b.numpy()) for a, b in loader], strict=True)
        got_x, got_y = np.concatenate(xs), np.concatenate(ys)
        order = got_y.astype(int) - 10 if isinstance(dataset, Doubled) else got_y.astype(int)
        assert sorted(order) == list(range(7))
        expected = [dataset[int(i)] for i in order]
        np.testing.assert_array_equal(got_x, np.stack([e[0] for e in expected]))
        np.testing.assert_array_equal(got_y, np.array([e[1] for e in expected]))


def write_mnist(folder, images: np.ndarray, labels: np.ndarray):
    image_path, label_path = folder / "images-idx3-ubyte.gz", folder / "labels-idx1-ubyte.gz"
    n, rows, cols = images.shape
    image_path.write_bytes(gzip.compress(struct.pack(">IIII", 2051, n, rows, cols)
                                         + images.astype(np.uint8).tobytes()))
    label_path.write_bytes(gzip.compress(struct.pack(">II", 2049, n)
                                         + labels.astype(np.uint8).tobytes()))
    return str(image_path), str(label_path)


def write_cifar(folder, images: np.ndarray, labels: np.ndarray) -> None:
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": images.reshape(len(images), -1).astype(np.uint8),
                 b"labels": [int(v) for v in labels]}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))


def flip_all(img: np.ndarray) -> np.ndarray:
    return img[:, ::-1]


def test_mnist_and_cifar_examples_unchanged_with_and_without_transforms(tmp_path):
    """The file readers now see transforms through apply_transforms: their examples, and
    the loader's batches, are what they were (flat MNIST rows, C x H x W CIFAR images)."""
    digits = RNG.integers(0, 256, (5, 4, 3))
    labels = RNG.integers(0, 10, 5)
    paths = write_mnist(tmp_path, digits, labels)
    plain = data.MNISTDataset(*paths)
    flipped = data.MNISTDataset(*paths, transforms=[flip_all])
    x, label = flipped[2]
    np.testing.assert_allclose(x, (digits[2][:, ::-1] / 255.0).reshape(-1), rtol=1e-6)
    assert label == labels[2] and plain[2][0].shape == (12,)
    batch = next(iter(data.DataLoader(flipped, batch_size=5)))
    np.testing.assert_allclose(batch[0].numpy(), digits[:, :, ::-1].reshape(5, -1) / 255.0,
                               rtol=1e-6)

    images = RNG.integers(0, 256, (4, 3, 32, 32))
    write_cifar(tmp_path, images, np.arange(4))
    cifar = data.CIFAR10Dataset(str(tmp_path), train=False, transforms=[flip_all])
    np.testing.assert_allclose(cifar[1][0], images[1][:, :, ::-1] / 255.0, rtol=1e-6)
    batch = next(iter(data.DataLoader(data.CIFAR10Dataset(str(tmp_path), train=False), 4)))
    np.testing.assert_allclose(batch[0].numpy(), images / 255.0, rtol=1e-6)
