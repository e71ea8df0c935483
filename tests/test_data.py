"""DataLoader, transforms and the MNIST / CIFAR-10 / PTB readers on small files written here
in the exact on-disk formats."""
import gzip
import os
import pickle
import struct

import numpy as np
import pytest

from needle import data


def write_idx(path, images, labels, compress):
    n, rows, cols = images.shape
    img = struct.pack(">IIII", 2051, n, rows, cols) + images.astype(np.uint8).tobytes()
    lab = struct.pack(">II", 2049, n) + labels.astype(np.uint8).tobytes()
    opener = gzip.open if compress else open
    with opener(path + "-images", "wb") as f:
        f.write(img)
    with opener(path + "-labels", "wb") as f:
        f.write(lab)
    return path + "-images", path + "-labels"


# ---------------------------------------------------------------- Dataset and DataLoader


def test_dataloader_batches_in_order_with_last_partial_batch():
    X = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    y = np.arange(10)
    loader = data.DataLoader(data.ArrayDataset(X, y), batch_size=4)
    batches = list(loader)
    assert len(loader) == 3 and [b[0].shape for b in batches] == [(4, 3), (4, 3), (2, 3)]
    np.testing.assert_array_equal(np.concatenate([b[0].numpy() for b in batches]), X)
    np.testing.assert_array_equal(np.concatenate([b[1].numpy() for b in batches]), y)
    dropped = data.DataLoader(data.ArrayDataset(X, y), batch_size=4, drop_last=True)
    assert len(dropped) == 2 and [b[0].shape[0] for b in dropped] == [4, 4]


def test_shuffle_is_a_permutation_reproducible_from_the_seed():
    X = np.arange(20, dtype=np.float32)[:, None]
    ds = data.ArrayDataset(X, np.arange(20))

    def epochs(seed):
        loader = data.DataLoader(ds, batch_size=6, shuffle=True, seed=seed)
        return [np.concatenate([b[1].numpy() for b in loader]) for _ in range(2)]

    first, second = epochs(7)
    assert sorted(first) == list(range(20)) and not np.array_equal(first, np.arange(20))
    assert not np.array_equal(first, second)  # a new order every epoch
    again = epochs(7)
    np.testing.assert_array_equal(first, again[0])
    np.testing.assert_array_equal(second, again[1])
    assert not np.array_equal(first, epochs(8)[0])


def test_shuffle_without_a_seed_follows_numpy_global_seed():
    """As in the CMU course: np.random.seed fixes the order of an unseeded loader."""
    ds = data.ArrayDataset(np.zeros((20, 1), np.float32), np.arange(20))

    def order():
        loader = data.DataLoader(ds, batch_size=20, shuffle=True)
        return next(iter(loader))[1].numpy()

    np.random.seed(3)
    first = order()
    np.random.seed(3)
    np.testing.assert_array_equal(order(), first)
    np.random.seed(3)
    np.testing.assert_array_equal(first, np.random.permutation(20))


def test_loader_applies_transforms_and_rejects_bad_arguments():
    ds = data.ArrayDataset(np.ones((4, 2, 2, 1), dtype=np.float32), None,
                           transforms=[data.Normalize([0.5], [0.25])])
    (batch,) = next(iter(data.DataLoader(ds, batch_size=4)))
    np.testing.assert_allclose(batch.numpy(), np.full((4, 2, 2, 1), 2.0))
    with pytest.raises(ValueError, match="batch_size must be positive"):
        data.DataLoader(ds, batch_size=0)
    with pytest.raises(ValueError, match="3 inputs but 2 labels"):
        data.ArrayDataset(np.zeros((3, 1)), np.zeros(2))
    with pytest.raises(ValueError, match="std must be positive"):
        data.Normalize([0.0], [0.0])


# ---------------------------------------------------------------- transforms


def test_random_flip_horizontal():
    img = np.arange(2 * 3 * 2).reshape(2, 3, 2)
    np.testing.assert_array_equal(data.RandomFlipHorizontal(p=1.0)(img), img[:, ::-1, :])
    np.testing.assert_array_equal(data.RandomFlipHorizontal(p=0.0)(img), img)
    np.random.seed(0)
    flips = [data.RandomFlipHorizontal(0.5)(img)[0, 0, 0] != img[0, 0, 0] for _ in range(400)]
    assert 0.4 < np.mean(flips) < 0.6


def test_random_crop_shifts_with_zero_fill():
    img = np.arange(1, 5 * 5 + 1, dtype=np.float32).reshape(5, 5, 1)
    np.random.seed(3)
    for _ in range(20):
        state = np.random.get_state()
        dx, dy = np.random.randint(low=-2, high=3, size=2)
        np.random.set_state(state)
        out = data.RandomCrop(padding=2)(img)
        padded = np.pad(img, ((2, 2), (2, 2), (0, 0)))
        np.testing.assert_array_equal(out, padded[2 + dx : 7 + dx, 2 + dy : 7 + dy])
        assert out.shape == img.shape


# ---------------------------------------------------------------- MNIST


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_reader_parses_idx_files(tmp_path, compress):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 28, 28))
    labels = rng.integers(0, 10, size=5)
    img_path, lab_path = write_idx(str(tmp_path / "train"), images, labels, compress)
    ds = data.MNISTDataset(img_path, lab_path)
    assert len(ds) == 5
    x, y = ds[3]
    assert x.shape == (784,) and x.dtype == np.float32
    np.testing.assert_allclose(x, images[3].ravel() / 255.0, rtol=1e-6)
    assert y == labels[3]
    flipped = data.MNISTDataset(img_path, lab_path, transforms=[data.RandomFlipHorizontal(1.0)])
    np.testing.assert_allclose(flipped[3][0].reshape(28, 28), images[3][:, ::-1] / 255.0)
    for dataset, expected in ((ds, images), (flipped, images[:, :, ::-1])):
        X, Y = next(iter(data.DataLoader(dataset, batch_size=5)))
        np.testing.assert_allclose(X.numpy(), expected.reshape(5, -1) / 255.0, rtol=1e-6)
        np.testing.assert_array_equal(Y.numpy(), labels)
    X, Y = data.parse_mnist(img_path, lab_path)
    assert X.shape == (5, 784) and X.max() <= 1.0
    np.testing.assert_array_equal(Y, labels)


def test_mnist_reader_rejects_corrupt_files(tmp_path):
    images = np.zeros((3, 4, 4))
    img_path, lab_path = write_idx(str(tmp_path / "t"), images, np.zeros(3), compress=False)
    with pytest.raises(ValueError, match="not an idx image file"):
        data.parse_mnist(lab_path, lab_path)
    with open(img_path, "rb") as f:
        raw = f.read()
    truncated = str(tmp_path / "truncated")
    with open(truncated, "wb") as f:
        f.write(raw[:-5])
    with pytest.raises(ValueError, match=r"header says 3 images of 4x4 .* file has 59 bytes"):
        data.parse_mnist(truncated, lab_path)
    other_img, other_lab = write_idx(str(tmp_path / "u"), np.zeros((2, 4, 4)), np.zeros(2), False)
    with pytest.raises(ValueError, match="3 images but 2 labels"):
        data.parse_mnist(img_path, other_lab)
    gz_img, gz_lab = write_idx(str(tmp_path / "g"), images, np.zeros(3), compress=True)
    with open(gz_img, "rb") as f:
        raw = f.read()
    for name, blob in (("cut.gz", raw[: len(raw) // 2]), ("bad.gz", raw[:2] + b"\0" * 30)):
        with open(tmp_path / name, "wb") as f:
            f.write(blob)
        with pytest.raises(ValueError, match=rf"{name}: corrupt or truncated gzip"):
            data.parse_mnist(str(tmp_path / name), gz_lab)


def test_mnist_dataset_keeps_non_square_images_for_transforms(tmp_path):
    images = np.arange(2 * 4 * 7).reshape(2, 4, 7) % 256
    img_path, lab_path = write_idx(str(tmp_path / "r"), images, np.zeros(2), compress=False)
    ds = data.MNISTDataset(img_path, lab_path, transforms=[data.RandomFlipHorizontal(1.0)])
    np.testing.assert_allclose(ds[1][0].reshape(4, 7), images[1][:, ::-1] / 255.0)


# ---------------------------------------------------------------- CIFAR-10


def write_cifar(folder, batches):
    for name, (pixels, labels) in batches.items():
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": list(labels),
                         b"data": pixels, b"filenames": [b"x.png"] * len(labels)}, f)


def test_cifar10_reader_loads_train_and_test_batches(tmp_path):
    rng = np.random.default_rng(1)
    batches = {f"data_batch_{i}": (rng.integers(0, 256, (2, 3072), dtype=np.uint8),
                                   rng.integers(0, 10, 2)) for i in range(1, 6)}
    batches["test_batch"] = (rng.integers(0, 256, (3, 3072), dtype=np.uint8), [1, 2, 3])
    write_cifar(tmp_path, batches)
    train = data.CIFAR10Dataset(str(tmp_path), train=True)
    test = data.CIFAR10Dataset(str(tmp_path), train=False)
    assert len(train) == 10 and len(test) == 3
    x, y = train[4]  # batch 3, row 0
    np.testing.assert_allclose(x, batches["data_batch_3"][0][0].reshape(3, 32, 32) / 255.0)
    assert y == batches["data_batch_3"][1][0]
    flipped = data.CIFAR10Dataset(str(tmp_path), train=False,
                                  transforms=[data.RandomFlipHorizontal(p=1.0)])
    np.testing.assert_allclose(flipped[0][0], test[0][0][:, :, ::-1])


def test_cifar10_reader_refuses_code_and_bad_shapes(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned",))

    with open(tmp_path / "test_batch", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(ValueError, match="not a CIFAR-10 python batch.*not allowed"):
        data.CIFAR10Dataset(str(tmp_path), train=False)
    write_cifar(tmp_path, {"test_batch": (np.zeros((2, 100), dtype=np.uint8), [0, 1])})
    with pytest.raises(ValueError, match=r"expected data \(N, 3072\)"):
        data.CIFAR10Dataset(str(tmp_path), train=False)
    with open(tmp_path / "test_batch", "wb") as f:
        f.write(b"\x80\x04garbage")
    with pytest.raises(ValueError, match="not a CIFAR-10 python batch"):
        data.CIFAR10Dataset(str(tmp_path), train=False)


# ---------------------------------------------------------------- PTB


def test_ptb_corpus_dictionary_batchify_and_get_batch(tmp_path):
    (tmp_path / "train.txt").write_text(" the cat sat \n the dog sat down \n a b c \n")
    (tmp_path / "test.txt").write_text(" the bird sat \n")
    corpus = data.Corpus(str(tmp_path))
    words = "the cat sat <eos> the dog sat down <eos> a b c <eos>".split()
    assert [corpus.dictionary.idx2word[i] for i in corpus.train] == words
    assert corpus.dictionary.word2idx["the"] == 0 and corpus.dictionary.word2idx["<eos>"] == 3
    assert [corpus.dictionary.idx2word[i] for i in corpus.test] == "the bird sat <eos>".split()
    assert len(corpus.dictionary) == 10
    assert len(data.Corpus(str(tmp_path), max_lines=1).train) == 4

    batches = data.batchify(corpus.train, batch_size=3)
    assert batches.shape == (4, 3)
    np.testing.assert_array_equal(batches[:, 1], corpus.train[4:8])  # columns are contiguous
    X, y = data.get_batch(batches, 0, bptt=2)
    np.testing.assert_array_equal(X.numpy(), batches[0:2])
    np.testing.assert_array_equal(y.numpy(), batches[1:3].reshape(-1))
    X, y = data.get_batch(batches, 2, bptt=5)  # truncated at the end
    assert X.shape == (1, 3) and y.shape == (3,)
    with pytest.raises(IndexError, match="leaves no targets"):
        data.get_batch(batches, 3, bptt=2)
    with pytest.raises(ValueError, match="too few"):
        data.batchify([1, 2], batch_size=3)
    np.testing.assert_array_equal(data.batchify(corpus.train, 3, None, "float32"), batches)
