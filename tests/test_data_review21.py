"""Review of needle.data and needle.train on what a user hits: PTB token ids kept exact through
batchify, a UTF-8 byte-order mark in a PTB file, a PTB split too short for one window caught
before training, labels or inputs given as Python lists, Normalize with the wrong number of
channel values and RandomCrop with a non-integer padding. References are numpy and
hand-built arrays; files are written here in the real formats."""
import io

import numpy as np
import pytest

from needle import data
from needle.train import main

# ---------------------------------------------------------------- PTB


def test_batchify_keeps_token_ids_exact_and_usable_as_indices(tmp_path):
    """float32 rows rounded ids above 2**24 (2**24 + 1 read back as 2**24: two words merged)
    and could not index idx2word; the course's batchify keeps the ints."""
    tokens = [2**24 + k for k in range(12)]
    batches = data.batchify(tokens, 3)
    expected = np.array(tokens).reshape(3, 4).T  # the course's batchify, in numpy
    assert np.issubdtype(batches.dtype, np.integer)
    np.testing.assert_array_equal(batches, expected)
    # get_batch's Tensors are float32: ids it cannot hold exactly are refused, not rounded
    with pytest.raises(ValueError, match=r"token id 16777226 is above 2\*\*24 .* float32"):
        data.get_batch(batches, 0, 2)
    small = data.batchify(list(range(12)), 3)
    X, y = data.get_batch(small, 1, 2)
    np.testing.assert_array_equal(X.numpy(), np.arange(12).reshape(3, 4).T[1:3])
    np.testing.assert_array_equal(y.numpy(), np.arange(12).reshape(3, 4).T[2:4].reshape(-1))

    (tmp_path / "train.txt").write_text("the cat sat\nthe dog sat\n")
    (tmp_path / "test.txt").write_text("a cat\n")
    corpus = data.Corpus(str(tmp_path))
    rows = data.batchify(corpus.train, 2)
    words = [corpus.dictionary.idx2word[i] for i in rows[:, 1]]  # decode a column back
    assert words == "the dog sat <eos>".split()


def test_corpus_ignores_a_utf8_byte_order_mark(tmp_path):
    """A file saved with a BOM (Windows editors) made its first word a distinct token,
    '\\ufeffthe' beside 'the'."""
    (tmp_path / "train.txt").write_bytes(b"\xef\xbb\xbfthe cat\nthe dog\n")
    (tmp_path / "test.txt").write_bytes(b"\xef\xbb\xbfdog\n")
    corpus = data.Corpus(str(tmp_path))
    assert corpus.dictionary.idx2word == ["the", "cat", "<eos>", "dog"]
    assert corpus.train == [0, 1, 2, 0, 3, 2] and corpus.test == [3, 2]


@pytest.mark.parametrize("test_words", [10, 100])
def test_cli_refuses_a_short_ptb_split_before_training(tmp_path, test_words):
    """test.txt with fewer than two rows of --batch-size tokens: one row failed only after a
    whole training epoch, fewer than one failed without naming the file."""
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(20)]
    (tmp_path / "train.txt").write_text(
        "\n".join(" ".join(rng.choice(vocab, 9)) for _ in range(100)) + "\n")
    (tmp_path / "test.txt").write_text(" ".join(rng.choice(vocab, test_words - 1)) + "\n")
    progress = io.StringIO()
    with pytest.raises(ValueError, match=rf"test\.txt: {test_words} tokens .* batch size 64 "
                                         r"needs at least 128"):
        main(["--data", "ptb", "--data-dir", str(tmp_path), "--model", "lstm", "--epochs", "1",
              "--batch-size", "64", "--bptt", "5"], stream=progress)
    assert "train [" not in progress.getvalue()  # no epoch was run first


# ---------------------------------------------------------------- ArrayDataset


def test_array_dataset_accepts_python_lists():
    """Labels (or inputs) as lists failed at the first batch with numpy's 'only integer
    scalar arrays can be converted to a scalar index'."""
    X = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    y = [0, 2, 1]
    for inputs in (np.array(X, np.float32), X):
        loader = data.DataLoader(data.ArrayDataset(inputs, y), batch_size=2)
        batches = [(a.numpy(), b.numpy()) for a, b in loader]
        np.testing.assert_array_equal(np.concatenate([a for a, _ in batches]), np.array(X))
        np.testing.assert_array_equal(np.concatenate([b for _, b in batches]), np.array(y))
    (only,) = next(iter(data.DataLoader(data.ArrayDataset(X), batch_size=3)))
    np.testing.assert_array_equal(only.numpy(), np.array(X))


# ---------------------------------------------------------------- transforms


def test_normalize_refuses_channel_values_that_do_not_match_the_image():
    """Three (CIFAR) values on a 1-channel MNIST image broadcast it to 3 channels: the
    example silently grew from 784 to 2352 values and failed far away, in the model."""
    img = np.arange(2 * 2 * 3, dtype=np.float32).reshape(2, 2, 3)
    mean, std = [1.0, 2.0, 3.0], [0.5, 1.0, 2.0]
    out = data.Normalize(mean, std)(img)
    np.testing.assert_allclose(out, (img - np.array(mean)) / np.array(std), rtol=1e-6)
    assert out.shape == img.shape
    np.testing.assert_allclose(data.Normalize([1.0], [2.0])(img), (img - 1.0) / 2.0)
    with pytest.raises(ValueError, match=r"Normalize: 3 channel values for an image of "
                                         r"shape \(4, 4, 1\)"):
        data.Normalize(mean, std)(np.ones((4, 4, 1), np.float32))
    with pytest.raises(ValueError, match="channel values"):
        data.Normalize([0.5, 0.5], [1.0, 1.0])(np.ones((4, 4, 3), np.float32))


def test_random_crop_refuses_a_non_integer_padding():
    """RandomCrop(2.0) was accepted and failed at the first image with numpy's '`pad_width`
    must be of integral type'."""
    for bad in (2.0, 1.5, True, "2"):
        with pytest.raises(ValueError, match="padding must be an integer, got"):
            data.RandomCrop(bad)
    img = np.arange(1, 17, dtype=np.float32).reshape(4, 4)
    np.random.seed(0)
    state = np.random.get_state()
    dx, dy = np.random.randint(low=-2, high=3, size=2)
    np.random.set_state(state)
    out = data.RandomCrop(np.int64(2))(img)
    np.testing.assert_array_equal(out, np.pad(img, 2)[2 + dx: 6 + dx, 2 + dy: 6 + dy])


def test_ndarray_dataset_as_in_the_course():
    # CMU hw2's NDArrayDataset(*arrays) was missing: course code failed with AttributeError
    rng = np.random.default_rng(0)
    X, y, w = rng.standard_normal((7, 3)), np.arange(7), rng.standard_normal(7)
    ds = data.NDArrayDataset(X, y, w)
    assert len(ds) == 7
    x3, y3, w3 = ds[3]
    np.testing.assert_array_equal(x3, X[3])
    assert (y3, w3) == (y[3], w[3])
    batches = list(data.DataLoader(ds, batch_size=3, shuffle=True, seed=1))
    assert [b[0].shape for b in batches] == [(3, 3), (3, 3), (1, 3)]
    seen = np.concatenate([b[1].numpy() for b in batches]).astype(int)
    assert sorted(seen) == list(range(7))  # each example once
    for xb, yb, wb in batches:  # fields stay aligned through the shuffle
        idx = yb.numpy().astype(int)
        np.testing.assert_allclose(xb.numpy(), X[idx].astype(np.float32))
        np.testing.assert_allclose(wb.numpy(), w[idx].astype(np.float32))
    with pytest.raises(ValueError, match="differ in length"):
        data.NDArrayDataset(X, y[:5])
    with pytest.raises(ValueError, match="at least one"):
        data.NDArrayDataset()
