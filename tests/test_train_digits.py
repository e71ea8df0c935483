"""Real-data training on the `cpu` backend: scikit-learn's bundled 8x8 digits and a small
English text (scikit-learn's bundled dataset descriptions). Accuracies and losses only."""
import csv
import glob
import gzip
import json
import os
import pickle
import struct

import numpy as np
import pytest
import sklearn
from threadpoolctl import threadpool_limits

import needle as ndl
from needle import data, models, nn, optim
from needle.train import load_digits, main, run_epoch, run_lm_epoch

CPU = ndl.cpu()


@pytest.fixture(autouse=True)
def one_openmp_thread():
    """The C++ backend's OpenMP loops spin-wait for their threads; on 2 cores shared with other
    test processes that makes each parallel op take milliseconds. One thread keeps these
    trainings (the same arithmetic) to seconds."""
    with threadpool_limits(limits=1, user_api="openmp"):
        yield


def digits_loaders(flat: bool):
    X_train, y_train, X_test, y_test = load_digits(seed=0)
    if flat:
        X_train, X_test = X_train.reshape(len(X_train), -1), X_test.reshape(len(X_test), -1)
    train = data.DataLoader(data.ArrayDataset(X_train, y_train), 64, shuffle=True, seed=0,
                            device=CPU)
    test = data.DataLoader(data.ArrayDataset(X_test, y_test), 256, device=CPU)
    return train, test


@pytest.mark.parametrize("name, build, epochs", [
    ("mlp", lambda: models.MLP(64, (128,), 10, device=CPU), 6),
    ("small-resnet", lambda: models.SmallResNet(1, 10, width=16, device=CPU), 5),
])
def test_digits_reach_95_percent_test_accuracy(name, build, epochs):
    np.random.seed(0)
    train, test = digits_loaders(flat=name == "mlp")
    model = build()
    opt = optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        run_epoch(model, train, nn.SoftmaxLoss(), opt)
    result = run_epoch(model, test, nn.SoftmaxLoss())
    assert result["acc"] >= 0.95, f"{name} test accuracy {result['acc']:.3f}"


def test_transformer_lm_loss_drops_below_unigram_entropy(tmp_path):
    descr = os.path.join(os.path.dirname(sklearn.__file__), "datasets", "descr", "*.rst")
    lines = [line for f in sorted(glob.glob(descr)) for line in open(f).read().splitlines()
             if line.strip()]
    (tmp_path / "train.txt").write_text("\n".join(lines[:200]))
    (tmp_path / "test.txt").write_text("\n".join(lines[200:220]))
    corpus = data.Corpus(str(tmp_path))
    counts = np.bincount(corpus.train)
    p = counts[counts > 0] / counts.sum()
    unigram_entropy = float(-(p * np.log(p)).sum())  # the best loss without context, in nats
    assert unigram_entropy > 5.0  # a real text: hundreds of distinct words

    np.random.seed(0)
    rows = data.batchify(corpus.train, 16)
    model = models.LanguageModel(32, len(corpus.dictionary), 64, num_layers=2,
                                 seq_model="transformer", seq_len=16, num_head=4, dim_head=8,
                                 device=CPU)
    opt = optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(6):
        run_lm_epoch(model, rows, 16, opt, clip=1.0, device=CPU)
    loss = run_lm_epoch(model, rows, 16, device=CPU)["loss"]
    assert loss < 0.5 * unigram_entropy, f"loss {loss:.3f}, unigram entropy {unigram_entropy:.3f}"


def test_cli_trains_logs_plots_checkpoints_and_resumes(tmp_path, capsys):
    log_csv, log_json = str(tmp_path / "m.csv"), str(tmp_path / "m.json")
    plot, ckpt = str(tmp_path / "curves.png"), str(tmp_path / "mlp.npz")
    args = ["--data", "digits", "--model", "mlp", "--epochs", "2", "--lr", "3e-3",
            "--schedule", "cosine", "--clip", "5"]
    history = main(args + ["--log", log_csv, "--plot", plot, "--save", ckpt])
    assert [row["epoch"] for row in history] == [1, 2]
    with open(log_csv) as f:
        rows = list(csv.DictReader(f))
    assert float(rows[1]["test_acc"]) == pytest.approx(history[1]["test_acc"])
    assert float(rows[0]["lr"]) == pytest.approx(3e-3)  # cosine: the lr of epoch 1
    with open(plot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    progress = capsys.readouterr().err
    assert "epoch 2/2 train [" in progress and "samples/s" in progress and "acc" in progress

    resumed = main(args[:-6] + ["--epochs", "3", "--resume", ckpt, "--log", log_json])
    assert [row["epoch"] for row in resumed] == [3]  # the checkpoint's 2 epochs count
    with open(log_json) as f:
        assert json.load(f) == resumed
    # the resumed model starts where the checkpoint left off, far better than from scratch
    assert resumed[0]["train_loss"] < history[0]["train_loss"]
    assert main(args[:-6] + ["--epochs", "2", "--resume", ckpt]) == []  # nothing left to do


@pytest.mark.parametrize("schedule", ["cosine", "step"])
def test_resumed_cli_run_repeats_the_uninterrupted_one(tmp_path, schedule):
    """A run stopped after epoch 1 and resumed with the same command is the same run: the
    same lr per epoch, the same shuffles, and bit-identical metrics and weights."""
    common = ["--data", "digits", "--model", "mlp", "--lr", "3e-3", "--schedule", schedule,
              "--optimizer", "sgd", "--momentum", "0.9", "--seed", "3"]
    whole, first, rest = (str(tmp_path / name) for name in ("whole.npz", "1.npz", "rest.npz"))
    uninterrupted = main(common + ["--epochs", "3", "--save", whole])
    stopped = main(common + ["--epochs", "1", "--save", first])
    os.replace(first, rest)
    resumed = main(common + ["--epochs", "3", "--resume", rest, "--save", rest])

    def numbers(rows):  # all but the throughput
        return [{k: v for k, v in row.items() if not k.endswith("_per_s")} for row in rows]
    assert numbers(stopped) == numbers(uninterrupted[:1])
    assert numbers(resumed) == numbers(uninterrupted[1:])  # lr, losses, accuracies: exactly
    with np.load(whole) as a, np.load(rest) as b:
        assert sorted(a.files) == sorted(b.files)
        for key in a.files:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_cli_rejects_bad_combinations():
    with pytest.raises(SystemExit, match="--model lstm or transformer with --data ptb"):
        main(["--data", "digits", "--model", "lstm"])
    with pytest.raises(ValueError, match="needs --data-dir"):
        main(["--data", "mnist", "--model", "mlp"])
    with pytest.raises(FloatingPointError, match="loss is nan at batch"):
        main(["--data", "digits", "--model", "mlp", "--optimizer", "sgd", "--lr", "1e30"])


def test_cli_trains_from_mnist_and_cifar10_files(tmp_path):
    """The file readers wired into the CLI: tiny sets in the real formats, one epoch each."""
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 32), ("t10k", 16)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        with gzip.open(tmp_path / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
            f.write(struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes())
        with open(tmp_path / f"{prefix}-labels-idx1-ubyte", "wb") as f:
            f.write(struct.pack(">II", 2049, n) + rng.integers(0, 10, n, dtype=np.uint8).tobytes())
    history = main(["--data", "mnist", "--data-dir", str(tmp_path), "--model", "small-resnet",
                    "--epochs", "1", "--batch-size", "16"])
    assert len(history) == 1 and 0.0 <= history[0]["test_acc"] <= 1.0

    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(tmp_path / name, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8),
                         b"labels": [int(v) for v in rng.integers(0, 10, 4)]}, f)
    history = main(["--data", "cifar10", "--data-dir", str(tmp_path), "--model", "resnet9",
                    "--epochs", "1", "--batch-size", "8"])
    assert np.isfinite(history[0]["train_loss"])


def test_an_epoch_with_no_examples_is_a_clear_error():
    """A loader that yields nothing (batch size above the split's size with drop_last, an
    empty split) and token rows too few for one window: ValueError naming why (it was a
    ZeroDivisionError after the loop)."""
    model = nn.Sequential(nn.Linear(4, 3, device=CPU))
    x, y = np.ones((5, 4), np.float32), np.zeros(5, np.uint8)
    loader = data.DataLoader(data.ArrayDataset(x, y), batch_size=8, drop_last=True, device=CPU)
    with pytest.raises(ValueError, match="no examples.*5 examples, batch size 8, drop_last"):
        run_epoch(model, loader, nn.SoftmaxLoss())
    lm = models.LanguageModel(4, 10, hidden_size=4, device=CPU)
    with pytest.raises(ValueError, match="no window"):
        run_lm_epoch(lm, np.zeros((1, 2), np.float32), 16, device=CPU)
