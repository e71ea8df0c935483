"""Review of the training loops, checkpoints and model zoo against independent references:
CMU needle's ResNet9 test, numpy recomputations, and zip files damaged by hand."""
import io
import os
import stat
import zipfile

import numpy as np
import pytest

import needle as ndl
from needle import checkpoint, data, models, nn, optim
from needle.train import build_classifier, main, run_epoch, run_lm_epoch

CPU = ndl.cpu()


def tensor(a):
    return ndl.Tensor(np.asarray(a, dtype=np.float32), device=CPU)


# ---------------------------------------------------------------- model zoo


def test_resnet9_is_the_cmu_course_network():
    """The course's hw4 test: 431,946 parameters and, from seed 0, these logits (our ConvBN
    dropped the conv bias: 431,386 parameters and other outputs)."""
    np.random.seed(0)
    model = models.ResNet9(device=CPU)
    assert sum(int(np.prod(p.shape)) for p in model.parameters()) == 431_946
    logits = model(tensor(np.random.randn(2, 3, 32, 32))).numpy()
    expected = np.array([
        [-1.8912625, 0.64833605, 1.9400386, 1.1435282, 1.89777,
         2.9039745, -0.10433993, 0.35458302, -0.5684191, 2.6178317],
        [-0.2905612, -0.4147861, 0.90268034, 0.46530387, 1.3335679,
         1.8534894, -0.1867125, -2.4298222, -0.5344223, 4.362149]])
    assert np.linalg.norm(logits - expected) < 1e-2


def test_resnet18_on_28x28_images_pools_its_whole_final_feature_map():
    """MNIST's 28 pixels leave 4 x 4 after three stride-2 stages; a pool of 28 // 8 = 3 averaged
    the top-left 3 x 3 and dropped the rest."""
    np.random.seed(0)
    model = build_classifier("resnet18", (1, 28, 28), 10, CPU).eval()
    *features, pool, _, _ = model.net.modules
    feature_map = nn.Sequential(*features)(tensor(np.random.rand(1, 1, 28, 28)))
    np.testing.assert_allclose(pool(feature_map).numpy()[:, :, 0, 0],
                               feature_map.numpy().mean(axis=(2, 3)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("build, message", [
    (lambda: models.MLP(64, 128, 10), "hidden_sizes must be a sequence"),
    (lambda: models.MLP(0, (8,), 10), "MLP: in_features must be a positive int, got 0"),
    (lambda: models.MLP(4, (8, 0), 3), r"hidden_sizes\[1\] must be a positive int"),
    (lambda: models.ResNet9(num_classes=0), "ResNet9: num_classes"),
    (lambda: models.ResNet18(10, width=0), "ResNet18: width"),
    (lambda: models.SmallResNet(1, 10, width=0), "SmallResNet: width"),
    (lambda: models.LanguageModel(4, 0, 8), "LanguageModel: output_size"),
    (lambda: models.LanguageModel(4, 10, 8, num_layers=0), "num_layers must be a positive"),
    (lambda: models.LanguageModel(4, 10, 8, seq_model="transformer", num_head=0), "num_head"),
    (lambda: models.LanguageModel(4, 10, 8, seq_model="lstm", dropout=0.5),
     "dropout applies to the transformer only"),
])
def test_bad_model_sizes_are_refused_by_name(build, message):
    """The error names the model and its argument. Before, sizes of 0 failed inside a layer
    (ZeroDivisionError at HEAD; "fan_out must lie in (0.0, inf)" or "Conv: in_channels ..."
    with the layer checks being added alongside), an int hidden_sizes as "'int' object is not
    iterable", and a recurrent model's dropout was ignored without a word."""
    with pytest.raises((ValueError, TypeError), match=message):
        build()


# ---------------------------------------------------------------- training loops


def frozen_bn_model():
    """Dropout in training mode, a BatchNorm frozen in eval mode (as when fine-tuning)."""
    model = nn.Sequential(nn.Linear(6, 8, device=CPU), nn.BatchNorm1d(8, device=CPU),
                          nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3, device=CPU))
    model.train()
    model.modules[1].eval()
    return model


def modes(model):
    return [m.training for m in (model, *model.children())]


def test_epochs_leave_every_module_in_the_mode_it_had():
    """An evaluation epoch left the whole model in eval mode (dropout off for the caller's own
    training that follows), a training epoch unfroze a frozen BatchNorm; the metrics are the
    numpy ones over all 23 examples, the last partial batch of 3 included."""
    np.random.seed(0)
    X = np.random.rand(23, 6).astype(np.float32)
    y = np.random.randint(0, 3, 23).astype(np.float32)
    model = frozen_bn_model()
    before = modes(model)
    loader = data.DataLoader(data.ArrayDataset(X, y), 5, device=CPU)

    result = run_epoch(model, loader, nn.SoftmaxLoss())
    assert modes(model) == before
    logits = model.eval()(tensor(X)).numpy().astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    losses = np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(23), y.astype(int)]
    assert result["loss"] == pytest.approx(losses.mean(), rel=1e-5)
    assert result["acc"] == pytest.approx((logits.argmax(axis=1) == y).mean())

    model = frozen_bn_model()
    run_epoch(model, loader, nn.SoftmaxLoss(), optim.SGD(model.parameters(), lr=0.1))
    assert modes(model) == before

    lm = models.LanguageModel(4, 10, 6, seq_model="transformer", seq_len=4, dropout=0.2,
                              device=CPU)
    lm_before = modes(lm)
    run_lm_epoch(lm, np.random.randint(0, 10, (9, 2)), 4, device=CPU)
    assert modes(lm) == lm_before


def test_cli_refuses_a_log_or_plot_over_the_checkpoint(tmp_path, capsys):
    """Each epoch's metrics overwrote the checkpoint (or the one being resumed from); --save
    and --resume may still name one file."""
    ckpt = str(tmp_path / "run.npz")
    base = ["--data", "digits", "--epochs", "1"]
    for argv in (["--save", ckpt, "--log", ckpt], ["--resume", ckpt, "--plot", ckpt],
                 ["--log", ckpt, "--plot", str(tmp_path / "." / "run.npz")]):
        with pytest.raises(SystemExit):
            main(base + argv)
        assert "name the same file" in capsys.readouterr().err
    assert not os.path.exists(ckpt)


# ---------------------------------------------------------------- checkpoints


def small_model(seed):
    np.random.seed(seed)
    return models.MLP(4, (5,), 3, device=CPU)


def assert_state(model, state):
    for key, value in state.items():
        np.testing.assert_array_equal(model.state_dict()[key], value, err_msg=key)


def zip_of(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, payload in members.items():
            z.writestr(name, payload)
    return buffer.getvalue()


def npy(array) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_damaged_archives_are_refused_naming_the_file(tmp_path):
    """zlib.error (damaged compressed data), AttributeError (a member that is not .npy: NpzFile
    hands over bytes) and NotImplementedError (a damaged compression-method field) escaped
    bare, without the file; each is now the ValueError of any other unreadable checkpoint."""
    model = small_model(0)
    state = model.state_dict()
    entries = {f"model/{k}": v for k, v in state.items()}

    compressed = tmp_path / "compressed.npz"
    np.savez_compressed(compressed, **entries)
    damaged = bytearray(compressed.read_bytes())
    first = damaged.index(b".npy") + 4  # the first member's compressed data starts here
    damaged[first:first + 40] = bytes(b ^ 0xFF for b in damaged[first:first + 40])
    compressed.write_bytes(bytes(damaged))

    not_npy = tmp_path / "not_npy.npz"
    not_npy.write_bytes(zip_of({f"{k}.npy": npy(v) for k, v in entries.items()}
                               | {"model/notes": b"free text"}))

    method = tmp_path / "method.npz"
    archive = bytearray(zip_of({f"{k}.npy": npy(v) for k, v in entries.items()}))
    for signature, offset in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):  # local, central
        at = archive.index(signature) + offset
        archive[at:at + 2] = (99).to_bytes(2, "little")
    method.write_bytes(bytes(archive))

    for path, why in ((compressed, "not a readable needle checkpoint"),
                      (not_npy, "'model/notes' holds bytes, not numbers"),
                      (method, "not a readable needle checkpoint")):
        with pytest.raises(ValueError, match=why) as raised:
            checkpoint.load(str(path), small_model(1))
        assert str(path) in str(raised.value)
    target = small_model(1)
    before = target.state_dict()
    with pytest.raises(ValueError):
        checkpoint.load(str(not_npy), target)
    assert_state(target, before)


@pytest.mark.parametrize("train", [{"note": "best run"}, {"best": None}])
def test_save_refuses_what_load_would_refuse_and_keeps_the_old_checkpoint(tmp_path, train):
    """A text or None `train` entry was written (None pickled), replacing a good checkpoint
    with one that load() can never read."""
    path = str(tmp_path / "run.npz")
    model = small_model(0)
    checkpoint.save(path, model, train={"epochs": np.int64(3)})
    with pytest.raises(ValueError, match=f"cannot save {path}: entry 'train/"):
        checkpoint.save(path, small_model(1), train=train)
    restored = small_model(2)
    assert int(checkpoint.load(path, restored)["epochs"]) == 3
    assert_state(restored, model.state_dict())
    assert os.listdir(tmp_path) == ["run.npz"]


def test_save_makes_the_rename_durable_by_syncing_the_folder(tmp_path, monkeypatch):
    """fsync of the file alone leaves its new name in the folder's unsynced metadata: a power
    cut after save() returned could bring back the previous checkpoint."""
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real_fsync(fd)
    monkeypatch.setattr(checkpoint.os, "fsync", recording_fsync)
    checkpoint.save(str(tmp_path / "run.npz"), small_model(0))
    assert synced == [False, True]  # the file's bytes, then the folder's entry for it


def test_resume_with_adam_and_batchnorm_continues_the_uninterrupted_run(tmp_path):
    """Parameters, BatchNorm running statistics, Adam's moments and step counts, and the epoch
    count: two steps, save, load into a fresh model, two more equal four steps straight."""
    def batch(step):
        rng = np.random.default_rng(step)
        return tensor(rng.random((6, 1, 8, 8))), tensor(rng.integers(0, 10, 6))

    def step(model, opt, i):
        X, y = batch(i)
        opt.reset_grad()
        nn.SoftmaxLoss()(model(X), y).backward()
        opt.step()

    def fresh(seed):
        np.random.seed(seed)
        model = models.SmallResNet(1, 10, width=4, device=CPU)
        return model, optim.Adam(model.parameters(), lr=0.01)

    straight, straight_opt = fresh(0)
    for i in range(4):
        step(straight, straight_opt, i)

    first, first_opt = fresh(0)
    for i in range(2):
        step(first, first_opt, i)
    path = str(tmp_path / "half.npz")
    checkpoint.save(path, first, first_opt, train={"steps": np.int64(2)})
    resumed, resumed_opt = fresh(7)
    done = int(checkpoint.load(path, resumed, resumed_opt)["steps"])
    for i in range(done, 4):
        step(resumed, resumed_opt, i)
    assert resumed_opt.t == straight_opt.t == 4
    for key, value in straight.state_dict().items():  # running_mean/var among them
        np.testing.assert_allclose(resumed.state_dict()[key], value, rtol=1e-6, atol=1e-7,
                                   err_msg=key)
