"""Review 25 of data parallelism, the training CLI and checkpoints: what a checkpoint of a
DataParallel model holds, a 2-rank run resumed from one, and the metrics log of a CLI run
interrupted at the moments a Ctrl-C can arrive (after the checkpoint's rename, amid the log's
write) and then resumed.

References: the wrapped model's own state, and the same run without interruption. The ranks
are a real MPI job, bounded by mpi_run.TIMEOUT_S."""
import io
import json
import os
import stat
import textwrap

import numpy as np
import pytest
from parallel_scripts.mpi_run import LAUNCHER, launch

import needle as ndl
from needle import checkpoint, nn, train
from needle.parallel import Communicator, DataParallel

CPU = ndl.cpu()


# ---------------------------------------------------------------- DataParallel's checkpoint


def test_a_data_parallel_checkpoint_holds_each_tensor_of_the_model_once(tmp_path):
    """The BatchNorm layers used to be written twice: as `module.…` and again as `_norms.…`,
    names the bare model lacks (DataParallel kept them in a list attribute, which Module's
    walk over attributes collects)."""
    np.random.seed(0)
    bare = nn.Sequential(nn.Linear(4, 6, device=CPU), nn.BatchNorm1d(6, device=CPU),
                         nn.ReLU(), nn.Linear(6, 3, device=CPU))
    expected = {f"module.{name}": value for name, value in bare.state_dict().items()}
    model = DataParallel(bare, Communicator(timeout_s=60))
    path = str(tmp_path / "dp.npz")
    checkpoint.save(path, model)
    with np.load(path) as saved:
        assert sorted(saved.files) == sorted(f"model/{name}" for name in expected)
        for name, value in expected.items():
            np.testing.assert_array_equal(saved[f"model/{name}"], value, err_msg=name)


# Every rank saves the checkpoint to the same path and loads it: Adam's moments and step count,
# BatchNorm's statistics, overlap's hooks. Phases: "whole" 4 steps; "first" 2 steps then save;
# "second" load then steps 3 and 4.
RESUME_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import needle as ndl
    from needle import checkpoint, nn
    from needle.parallel import Communicator, DataParallel

    CPU, out, phase = ndl.cpu(), sys.argv[1], sys.argv[2]
    comm = Communicator(timeout_s=60)
    np.random.seed(comm.rank)  # rank 1's own weights, which the broadcast replaces
    body = nn.Sequential(nn.Linear(4, 6, device=CPU), nn.BatchNorm1d(6, device=CPU), nn.ReLU(),
                         nn.Linear(6, 3, device=CPU))
    model = DataParallel(body, comm, bucket_mb=1e-6, overlap=True)
    opt = ndl.optim.Adam(model.parameters(), lr=0.05)
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((7, 4)).astype(np.float32),
             rng.integers(0, 3, 7).astype(np.float32)) for _ in range(4)]
    steps = {"whole": range(4), "first": range(2), "second": range(2, 4)}[phase]
    if phase == "second":
        checkpoint.load(f"{out}/ck.npz", model, opt)
    for x, y in (data[i] for i in steps):
        opt.reset_grad()
        logits = model(ndl.Tensor(model.shard(x), device=CPU))
        loss = nn.SoftmaxLoss()(logits, ndl.Tensor(model.shard(y), device=CPU))
        model.backward(loss, model.local_fraction(len(x)))
        opt.step()
    if phase == "first":
        checkpoint.save(f"{out}/ck.npz", model, opt)
    np.savez(f"{out}/{phase}{comm.rank}.npz", **body.state_dict())
""")


@pytest.mark.skipif(LAUNCHER is None, reason="no MPI launcher or no mpi4py")
def test_two_ranks_resumed_from_a_checkpoint_repeat_the_uninterrupted_run(tmp_path):
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    for phase in ("whole", "first", "second"):
        code, output = launch(script, tmp_path, phase, nprocs=2)
        assert code == 0, output
    whole = [np.load(tmp_path / f"whole{rank}.npz") for rank in range(2)]
    for rank in range(2):
        resumed = np.load(tmp_path / f"second{rank}.npz")
        assert sorted(resumed.files) == sorted(whole[0].files)
        for name in whole[0].files:  # running_mean/var among them
            np.testing.assert_array_equal(resumed[name], whole[0][name], err_msg=name)
            np.testing.assert_array_equal(whole[rank][name], whole[0][name], err_msg=name)


# ---------------------------------------------------------------- a pipeline with a tied weight

# Stage 0's first layer and stage 1's last share their weight (tied embeddings, say). Each
# rank writes what Pipeline made of it: refused (the message) or the tied weight's gradient.
TIED_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import needle as ndl
    from needle import nn
    from needle.parallel import Communicator, Pipeline

    CPU = ndl.cpu()
    comm = Communicator(timeout_s=60)
    np.random.seed(0)
    first, last = nn.Linear(4, 4, device=CPU), nn.Linear(4, 4, device=CPU)
    last.weight = first.weight
    x = np.random.default_rng(5).standard_normal((6, 4)).astype(np.float32)
    y = np.array([0, 1, 2, 3, 0, 1], np.float32)
    try:
        pipe = Pipeline([first, nn.Sequential(nn.Tanh(), last)], [CPU, CPU], micro_batches=3,
                        comm=comm)
        pipe.forward_backward(x, y, nn.SoftmaxLoss())
        seen = {"grad": first.weight.grad.numpy().tolist()}
    except ValueError as e:
        seen = {"refused": str(e)}
    with open(f"{sys.argv[1]}/rank{comm.rank}.json", "w") as f:
        json.dump(seen, f)
""")


@pytest.mark.skipif(LAUNCHER is None, reason="no MPI launcher or no mpi4py")
def test_a_weight_tied_between_stages_on_two_ranks_is_refused_on_both(tmp_path):
    """Each rank used to train its own copy of the tied weight from its own stage's gradient,
    half of the one-process gradient each, so the copies drifted apart without a word."""
    script = tmp_path / "tied.py"
    script.write_text(TIED_SCRIPT)
    code, output = launch(script, tmp_path, nprocs=2)
    assert code == 0, output
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen.get("refused", "").startswith(
            "stages 0 and 1 share a parameter (a tied weight)"), (rank, seen)


# ---------------------------------------------------------------- an interrupted CLI run

COMMON = ["--data", "digits", "--model", "mlp", "--epochs", "3", "--optimizer", "sgd",
          "--lr", "3e-3", "--momentum", "0.9", "--schedule", "step", "--seed", "5"]


def _numbers(rows):
    """Every metric but the throughput, which differs from run to run."""
    return [{k: v for k, v in row.items() if not k.endswith("_per_s")} for row in rows]


def _uninterrupted_log(tmp_path):
    path = str(tmp_path / "straight.json")
    train.main(COMMON + ["--log", path], stream=io.StringIO())
    with open(path) as f:
        return _numbers(json.load(f))


def _resume(log, ckpt):
    """The same command again, with --resume: what a user runs after the interruption."""
    train.main(COMMON + ["--log", log, "--save", ckpt, "--resume", ckpt], stream=io.StringIO())
    with open(log) as f:
        return _numbers(json.load(f))


def test_a_run_stopped_right_after_a_checkpoint_keeps_that_epoch_in_its_log(tmp_path,
                                                                             monkeypatch):
    """A Ctrl-C during the folder sync that follows the checkpoint's rename (its last step) used
    to stop the run before that epoch's log row was written: the checkpoint counted 2 epochs,
    the log 1, and the resumed run's log went 1, 3."""
    log, ckpt = str(tmp_path / "m.json"), str(tmp_path / "ck.npz")
    folder_syncs = []
    real_fsync = os.fsync

    def interrupted_fsync(fd):
        real_fsync(fd)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            folder_syncs.append(fd)
            if len(folder_syncs) == 2:  # the checkpoint of epoch 2 is in place
                raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.os, "fsync", interrupted_fsync)
    with pytest.raises(KeyboardInterrupt):
        train.main(COMMON + ["--log", log, "--save", ckpt], stream=io.StringIO())
    monkeypatch.undo()
    assert int(np.load(ckpt)["train/epochs"]) == 2
    assert _resume(log, ckpt) == _uninterrupted_log(tmp_path)


def test_a_run_stopped_amid_writing_its_log_can_be_resumed(tmp_path, monkeypatch):
    """A Ctrl-C while the log was rewritten in place left it torn: the resumed run refused it
    ("not a metrics log to continue") and could go on only without its log."""
    log, ckpt = str(tmp_path / "m.json"), str(tmp_path / "ck.npz")
    real_dump = json.dump
    dumps = []

    def interrupted_dump(obj, f, **kwargs):
        dumps.append(obj)
        if len(dumps) < 2:
            return real_dump(obj, f, **kwargs)
        text = json.dumps(obj, **kwargs)
        f.write(text[: len(text) // 2])  # epoch 2's log half written
        raise KeyboardInterrupt

    monkeypatch.setattr(train.json, "dump", interrupted_dump)
    with pytest.raises(KeyboardInterrupt):
        train.main(COMMON + ["--log", log, "--save", ckpt], stream=io.StringIO())
    monkeypatch.undo()
    assert _resume(log, ckpt) == _uninterrupted_log(tmp_path)
