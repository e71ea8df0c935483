"""Train a model on local data: `python -m needle.train --help`.

Classification (digits, MNIST, CIFAR-10) or word-level language modelling (a PTB-style
corpus), with a progress bar per epoch, optional CSV/JSON metrics, a PNG of the curves and
checkpoints. Nothing is downloaded: digits ship with scikit-learn, the rest are read from
--data-dir in their standard file formats.
"""
import argparse
import contextlib
import csv
import itertools
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import TextIO

import numpy as np

from needle import checkpoint, data, models, nn, optim
from needle.autograd import no_grad
from needle.backend_ndarray import cpu, cpu_numpy, cuda

DEVICES = {"cpu": cpu, "cpu_numpy": cpu_numpy, "cuda": cuda}


class ProgressBar:
    """One line per epoch, redrawn in place: bar, batches, running metrics, samples/s."""

    def __init__(self, total: int, desc: str, stream: TextIO, width: int = 24):
        self.total, self.desc, self.stream, self.width = total, desc, stream, width
        self.start = time.perf_counter()
        self.last_draw = 0.0

    def update(self, done: int, samples: int, metrics: dict[str, float], final=False) -> None:
        now = time.perf_counter()
        if not final and now - self.last_draw < 0.1:
            return
        self.last_draw = now
        filled = self.width * done // max(self.total, 1)
        rate = samples / max(now - self.start, 1e-9)
        shown = " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self.stream.write(
            f"\r{self.desc} [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{done}/{self.total} {shown} {rate:,.0f} samples/s"
        )
        if final:
            self.stream.write("\n")
        self.stream.flush()


def _finite(loss, step: int, desc: str) -> float:
    """The loss as a float; stop at once when training has diverged."""
    value = float(loss.numpy())
    if not math.isfinite(value):
        raise FloatingPointError(
            f"{desc.strip()}: loss is {value} at batch {step}; lower the learning rate or clip"
        )
    return value


@contextlib.contextmanager
def _mode(model: nn.Module, training: bool) -> Iterator[None]:
    """model in training or eval mode for one epoch, then every module back in the mode it had:
    an evaluation amid a caller's own training loop must not leave dropout and BatchNorm's
    running statistics switched off (nor a training epoch switch them on in a frozen layer)."""
    modules = [model, *model.children()]
    before = [m.training for m in modules]
    model.train() if training else model.eval()
    try:
        yield
    finally:
        for module, flag in zip(modules, before, strict=True):
            module.training = flag


def _step(model, inputs, loss_fn, y, optimizer, clip):
    """model(*inputs) (logits, or (logits, state) for language models) and the loss on y; with
    an optimizer also backward, clipping and the update, without one no graph is recorded."""
    if optimizer is None:
        with no_grad():
            out = model(*inputs)
            return out, loss_fn(out[0] if isinstance(out, tuple) else out, y)
    optimizer.reset_grad()
    out = model(*inputs)
    loss = loss_fn(out[0] if isinstance(out, tuple) else out, y)
    loss.backward()
    if clip:
        optim.clip_grad_norm(optimizer.params, clip)
    optimizer.step()
    return out, loss


def run_epoch(model: nn.Module, loader: data.DataLoader, loss_fn: nn.Module,
              optimizer: optim.Optimizer | None = None, clip: float | None = None,
              desc: str = "", stream: TextIO | None = None) -> dict[str, float]:
    """One pass over loader; trains when an optimizer is given, else evaluates without a graph.
    Returns mean loss, accuracy and samples/s; the model's train/eval modes are as before."""
    bar = ProgressBar(len(loader), desc, stream) if stream else None
    total_loss, correct, seen = 0.0, 0, 0
    start = time.perf_counter()
    with _mode(model, optimizer is not None):
        for step, (X, y) in enumerate(loader, 1):
            logits, loss = _step(model, (X,), loss_fn, y, optimizer, clip)
            batch = y.shape[0]
            total_loss += _finite(loss, step, desc) * batch
            correct += int((logits.numpy().argmax(axis=1) == y.numpy()).sum())
            seen += batch
            if bar:
                bar.update(step, seen, {"loss": total_loss / seen, "acc": correct / seen})
    if not seen:  # else a ZeroDivisionError below
        raise ValueError(f"{desc or 'epoch'}: the loader gave no examples ({len(loader)} "
                         f"batches of {len(loader.dataset)} examples, batch size "
                         f"{loader.batch_size}{', drop_last' if loader.drop_last else ''})")
    seconds = time.perf_counter() - start
    metrics = {"loss": total_loss / seen, "acc": correct / seen, "samples_per_s": seen / seconds}
    if bar:
        bar.update(len(loader), seen, {"loss": metrics["loss"], "acc": metrics["acc"]}, final=True)
    return metrics


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float beyond ~709


def run_lm_epoch(model: models.LanguageModel, batches: np.ndarray, bptt: int,
                 optimizer: optim.Optimizer | None = None, clip: float | None = None,
                 device=None, desc: str = "", stream: TextIO | None = None) -> dict[str, float]:
    """One pass over batchified tokens (rows, batch) in windows of bptt steps; the recurrent
    state is carried across windows but not differentiated through them. The model's
    train/eval modes are as before."""
    loss_fn = nn.SoftmaxLoss()
    starts = range(0, len(batches) - 1, bptt)
    bar = ProgressBar(len(starts), desc, stream) if stream else None
    total_loss, correct, seen, h = 0.0, 0, 0, None
    start = time.perf_counter()
    with _mode(model, optimizer is not None):
        for step, i in enumerate(starts, 1):
            X, y = data.get_batch(batches, i, bptt, device=device)
            (logits, h), loss = _step(model, (X, h), loss_fn, y, optimizer, clip)
            h = tuple(t.detach() for t in h) if isinstance(h, tuple) else h.detach()
            total_loss += _finite(loss, step, desc) * y.shape[0]
            correct += int((logits.numpy().argmax(axis=1) == y.numpy()).sum())
            seen += y.shape[0]
            if bar:
                mean = total_loss / seen
                bar.update(step, seen, {"loss": mean, "ppl": _perplexity(mean)})
    if not seen:  # else a ZeroDivisionError below
        raise ValueError(f"{desc or 'epoch'}: {len(batches)} rows of tokens hold no window "
                         "with a next token (at least 2 are needed)")
    seconds = time.perf_counter() - start
    metrics = {"loss": total_loss / seen, "acc": correct / seen, "samples_per_s": seen / seconds}
    if bar:
        loss = metrics["loss"]
        shown = {"loss": loss, "ppl": _perplexity(loss), "acc": metrics["acc"]}
        bar.update(len(starts), seen, shown, final=True)
    return metrics


def token_rows(tokens: list[int], batch_size: int, path: str) -> np.ndarray:
    """batchify, refusing now, and naming the file, a split too short for one window (2 rows):
    it would otherwise fail only after a whole training epoch."""
    if len(tokens) < 2 * batch_size:
        raise ValueError(f"{path}: {len(tokens)} tokens (with an <eos> a line); batch size "
                         f"{batch_size} needs at least {2 * batch_size} for one window of "
                         "inputs and next tokens")
    return data.batchify(tokens, batch_size)


def load_digits(test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's bundled 8x8 digits as (N, 1, 8, 8) in [0, 1], split train/test at random
    with a fixed seed."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    X = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    y = digits.target.astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(X))
    n_test = int(len(X) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return X[train], y[train], X[test], y[test]


def _find(data_dir: str, *names: str) -> str:
    for name in names:
        for candidate in (name, name + ".gz"):
            path = os.path.join(data_dir, candidate)
            if os.path.exists(path):
                return path
    raise FileNotFoundError(f"none of {names} (or .gz) in {data_dir}")


def load_classification(name: str, data_dir: str | None, seed: int):
    """(X_train, y_train, X_test, y_test) with images NCHW in [0, 1]."""
    if name == "digits":
        return load_digits(seed=seed)
    if data_dir is None:
        raise ValueError(f"--data {name} needs --data-dir")
    if name == "mnist":
        split = []
        for prefix in ("train", "t10k"):
            ds = data.MNISTDataset(_find(data_dir, f"{prefix}-images-idx3-ubyte"),
                                   _find(data_dir, f"{prefix}-labels-idx1-ubyte"))
            split += [ds.X.reshape(-1, 1, *ds.image_shape), ds.y.astype(np.float32)]
        return tuple(split)
    if name == "cifar10":
        train, test = (data.CIFAR10Dataset(data_dir, train=t) for t in (True, False))
        return train.X, train.y.astype(np.float32), test.X, test.y.astype(np.float32)
    raise ValueError(f"unknown dataset {name!r}")


def build_classifier(name: str, image_shape: tuple[int, ...], classes: int, device):
    if name == "mlp":
        return models.MLP(int(np.prod(image_shape)), (128,), classes, device=device)
    if name == "small-resnet":
        return models.SmallResNet(image_shape[0], classes, width=16, image_size=image_shape[1],
                                  device=device)
    if name == "resnet9":
        return models.ResNet9(device=device, num_classes=classes)
    if name == "resnet18":  # three stride-2 stages leave ceil(size / 8) pixels a side: pool all
        return models.ResNet18(classes, in_channels=image_shape[0], pool=-(-image_shape[1] // 8),
                               device=device)
    raise ValueError(f"unknown model {name!r} for classification")


def build_optimizer(args, params) -> optim.Optimizer:
    if args.optimizer == "sgd":
        return optim.SGD(params, lr=args.lr, momentum=args.momentum,
                         weight_decay=args.weight_decay)
    return optim.Adam(params, lr=args.lr, weight_decay=args.weight_decay)


def build_schedule(args, optimizer):
    if args.schedule == "step":  # x0.1 from the second third of the epochs, again from the last
        thirds = [-(-args.epochs // 3), -(-2 * args.epochs // 3)]
        return optim.MultiStepLR(optimizer, milestones=thirds, gamma=0.1)
    if args.schedule == "cosine":
        return optim.CosineLR(optimizer, total_steps=args.epochs)
    return None


def write_metrics(history: list[dict[str, float]], path: str) -> None:
    """Per-epoch metrics as JSON (a list of objects) or CSV, chosen by the file's suffix.
    Written beside `path` and renamed over it: an interruption mid-write leaves the previous
    log whole, for a resumed run to read back (a torn one it would refuse)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", newline="") as f:
        if path.endswith(".json"):
            json.dump(history, f, indent=1)
        else:
            writer = csv.DictWriter(f, fieldnames=list(history[0]))
            writer.writeheader()
            writer.writerows(history)
    os.replace(tmp, path)


def read_metrics(path: str, epochs: int) -> list[dict[str, float]]:
    """The rows of epochs 1..epochs in a log an interrupted run wrote (none if there is no
    such file), so that the resumed run appends to them rather than overwriting its log with
    its own epochs only."""
    if not os.path.exists(path):
        return []
    try:
        with open(path, newline="") as f:
            rows = json.load(f) if path.endswith(".json") else list(csv.DictReader(f))
        rows = [{k: int(v) if k == "epoch" else float(v) for k, v in row.items()}
                for row in rows]
        return [row for row in rows if row["epoch"] <= epochs]
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise ValueError(f"--log {path}: not a metrics log to continue ({e!r})") from None


def plot_metrics(history: list[dict[str, float]], path: str) -> None:
    """Loss and accuracy per epoch, train and test, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [row["epoch"] for row in history]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, metric in zip(axes, ("loss", "acc"), strict=True):
        for split in ("train", "test"):
            ax.plot(epochs, [row[f"{split}_{metric}"] for row in history], marker="o", label=split)
        ax.set_xlabel("epoch")
        ax.set_ylabel(metric)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _positive(kind: type):
    """An argparse type for numbers above zero: 0 or fewer epochs, rows or clip bounds would
    train nothing (or, for --clip, flip the gradients) without a word."""
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names it in "invalid int value: 'x'"
    return parse


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, but for the options that are off unless
    given (default None), where "(default: None)" would say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m needle.train", formatter_class=_HelpWithDefaults,
                                description="Train a model on local data. "
                                + __doc__.split("\n\n", 1)[1])
    p.add_argument("--data", choices=["digits", "mnist", "cifar10", "ptb"], default="digits",
                   help="dataset")
    p.add_argument("--data-dir", help="folder with the dataset's files (not needed for digits)")
    p.add_argument("--model", default="mlp", help="model to train",
                   choices=["mlp", "small-resnet", "resnet9", "resnet18", "lstm", "transformer"])
    p.add_argument("--device", choices=list(DEVICES), default="cpu", help="backend to train on")
    p.add_argument("--epochs", type=_positive(int), default=5,
                   help="epochs in all; with --resume the checkpoint's count towards them")
    p.add_argument("--batch-size", type=_positive(int), default=64,
                   help="examples per step (language models: token streams side by side)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="adam", help="optimizer")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum")
    p.add_argument("--weight-decay", type=float, default=0.0, help="L2 penalty on the weights")
    p.add_argument("--schedule", choices=["none", "step", "cosine"], default="none",
                   help="learning rate over the epochs: step (x0.1 after each third of them) "
                   "or cosine")
    p.add_argument("--clip", type=_positive(float), help="clip the gradient norm to this value")
    p.add_argument("--bptt", type=_positive(int), default=20, help="language models: window length")
    p.add_argument("--max-lines", type=_positive(int),
                   help="language models: read at most this many lines")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the shuffling")
    p.add_argument("--log", help="write per-epoch metrics to this .csv or .json file (with "
                   "--resume, after the epochs it holds up to the checkpoint's)")
    p.add_argument("--plot", help="write a PNG of the training curves to this file")
    p.add_argument("--save", help="write a checkpoint (model + optimizer) here after each epoch")
    p.add_argument("--resume", help="go on from a --save checkpoint (model, optimizer with its "
                   "settings, which win over --lr/--momentum/--weight-decay, epochs done): the "
                   "same command with --resume continues an interrupted run")
    args = p.parse_args(argv)
    for flag in ("save", "log", "plot"):  # fail now, not after the training they would record
        path = getattr(args, flag)
        if path and not os.path.isdir(folder := os.path.dirname(os.path.abspath(path))):
            p.error(f"--{flag}: folder {folder} does not exist")
        if path:  # a read-only folder: a file made and removed at once says so
            try:
                tempfile.TemporaryFile(dir=folder).close()
            except OSError as err:
                p.error(f"--{flag}: cannot write in folder {folder}: {err.strerror or err}")
    files = [(flag, getattr(args, flag)) for flag in ("resume", "save", "log", "plot")
             if getattr(args, flag)]
    for (flag, path), (other, other_path) in itertools.combinations(files, 2):
        # each epoch's log or plot would overwrite the checkpoint, or the other way round;
        # --save may be --resume, which a resumed run then keeps up to date
        if (flag, other) != ("resume", "save") and \
                os.path.realpath(path) == os.path.realpath(other_path):
            p.error(f"--{flag} and --{other} name the same file {path}: "
                    "one would overwrite the other")
    return args


def main(argv=None, stream: TextIO | None = None) -> list[dict[str, float]]:
    """Train as the command line says; progress goes to stream (default stderr)."""
    args = parse_args(argv)
    stream = stream or sys.stderr
    np.random.seed(args.seed)
    device = DEVICES[args.device]()
    if not device.enabled():
        raise SystemExit(f"device {args.device} is not available on this machine")
    language = args.data == "ptb"
    if language != (args.model in ("lstm", "transformer")):
        raise SystemExit("use --model lstm or transformer with --data ptb, and only then")
    if args.model == "resnet9" and args.data != "cifar10":
        raise SystemExit("--model resnet9 takes CIFAR-10's 3 x 32 x 32 images (--data cifar10); "
                         "small-resnet and resnet18 take any images")
    if language:
        if args.data_dir is None:
            raise SystemExit("--data ptb needs --data-dir with train.txt and test.txt")
        corpus = data.Corpus(args.data_dir, max_lines=args.max_lines)
        train_rows, test_rows = (
            token_rows(tokens, args.batch_size, os.path.join(args.data_dir, name))
            for tokens, name in ((corpus.train, "train.txt"), (corpus.test, "test.txt")))
        model = models.LanguageModel(64, len(corpus.dictionary), 128, num_layers=1,
                                     seq_model=args.model, seq_len=args.bptt, device=device)

        def epoch(optimizer, desc):
            rows = train_rows if optimizer else test_rows
            return run_lm_epoch(model, rows, args.bptt, optimizer, args.clip, device, desc, stream)
    else:
        X_train, y_train, X_test, y_test = load_classification(args.data, args.data_dir, args.seed)
        classes = int(max(y_train.max(), y_test.max())) + 1
        if args.model == "mlp":
            X_train, X_test = X_train.reshape(len(X_train), -1), X_test.reshape(len(X_test), -1)
        model = build_classifier(args.model, X_train.shape[1:], classes, device)
        loaders = {
            True: data.DataLoader(data.ArrayDataset(X_train, y_train), args.batch_size,
                                  shuffle=True, seed=args.seed, device=device),
            False: data.DataLoader(data.ArrayDataset(X_test, y_test), args.batch_size,
                                   device=device),
        }
        loss_fn = nn.SoftmaxLoss()

        def epoch(optimizer, desc):
            loader = loaders[optimizer is not None]
            return run_epoch(model, loader, loss_fn, optimizer, args.clip, desc, stream)

    optimizer = build_optimizer(args, model.parameters())
    schedule = build_schedule(args, optimizer)  # from --lr, before a checkpoint's lr is loaded
    done = 0
    if args.resume:
        state = checkpoint.load(args.resume, model, optimizer)
        done = int(state.get("epochs", 0))
        if done >= args.epochs:
            print(f"{args.resume} already holds {done} epochs (--epochs {args.epochs}): "
                  f"nothing to train", file=stream)
        if schedule and "base_lr" in state:  # the first run's --lr wins over this one's
            schedule.base_lr = float(state["base_lr"])
        for _ in range(done if schedule else 0):  # the lr the uninterrupted run would have
            schedule.step()
    history = []
    logged = read_metrics(args.log, done) if args.log and done else []
    for n in range(done + 1, args.epochs + 1):
        np.random.seed([args.seed, n])  # each epoch's randomness from (seed, epoch) alone, so
        if not language:                # that a resumed run repeats the uninterrupted one
            loaders[True].reseed([args.seed, n])
        train = epoch(optimizer, f"epoch {n}/{args.epochs} train")
        test = epoch(None, f"epoch {n}/{args.epochs} test ")
        history.append({"epoch": n, "lr": optimizer.lr,
                        **{f"train_{k}": v for k, v in train.items()},
                        **{f"test_{k}": v for k, v in test.items()}})
        if schedule:
            schedule.step()
        # the log before the checkpoint: a run stopped between the two then logged every epoch
        # the checkpoint holds (a resumed run rewrites any later one), not one epoch fewer
        if args.log:
            write_metrics(logged + history, args.log)
        if args.save:
            progress = {"epochs": np.int64(n)}
            if schedule:  # the optimizer's lr is the scheduled one: a resume needs the base
                progress["base_lr"] = np.float64(schedule.base_lr)
            checkpoint.save(args.save, model, optimizer, train=progress)
    if args.plot and history:
        plot_metrics(logged + history, args.plot)
    return history


if __name__ == "__main__":
    try:
        main()
    except (FloatingPointError, ValueError, KeyError, OSError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e  # not its repr
        raise SystemExit(f"\nneedle.train: {message}") from None  # after the progress line
    except KeyboardInterrupt:  # a checkpoint already written is whole (checkpoint.save)
        print("\nneedle.train: interrupted", file=sys.stderr)
        sys.exit(130)
