"""The training CLI's learning-rate schedules and model checks, and Tensor.reshape's
arguments, from a review: the step schedule cut the lr every epoch at 4 and 5 epochs (its
help says after each third), a resumed run's schedule restarted from the new --lr (its
help says the checkpoint's settings win), and resnet9 on 1-channel data failed only at the
first batch."""
import io

import numpy as np
import pytest

import needle as ndl
from needle import optim
from needle.train import build_schedule, main, parse_args


@pytest.mark.parametrize("epochs", range(1, 10))
def test_the_step_schedule_cuts_the_lr_tenfold_after_each_third_of_the_epochs(epochs):
    optimizer = optim.SGD([], lr=1.0)
    schedule = build_schedule(parse_args(["--schedule", "step", "--epochs", str(epochs)]),
                              optimizer)
    seen = []
    for _ in range(epochs):
        seen.append(optimizer.lr)
        schedule.step()
    # epoch e (from 0) lies in third 3 e // epochs: that many cuts of x0.1 before it
    assert seen == pytest.approx([0.1 ** (3 * e // epochs) for e in range(epochs)], rel=1e-12)


def test_multistep_lr_counts_the_milestones_reached():
    optimizer = optim.SGD([], lr=2.0)
    schedule = optim.MultiStepLR(optimizer, milestones=[3, 1], gamma=0.5)
    seen = []
    for _ in range(4):
        schedule.step()
        seen.append(optimizer.lr)
    assert seen == [1.0, 1.0, 0.5, 0.5]
    with pytest.raises(ValueError, match="a milestone must be at least 1"):
        optim.MultiStepLR(optimizer, milestones=[0])


@pytest.mark.parametrize("schedule", ["cosine", "step"])
def test_a_resumed_run_keeps_the_first_runs_learning_rate_whatever_its_lr(tmp_path, schedule):
    common = ["--data", "digits", "--model", "mlp", "--schedule", schedule, "--seed", "1"]
    checkpoint = str(tmp_path / "run.npz")
    whole = main(common + ["--lr", "0.01", "--epochs", "3"], stream=io.StringIO())
    main(common + ["--lr", "0.01", "--epochs", "2", "--save", checkpoint], stream=io.StringIO())
    resumed = main(common + ["--lr", "0.5", "--epochs", "3", "--resume", checkpoint],
                   stream=io.StringIO())
    assert [row["lr"] for row in resumed] == [whole[2]["lr"]]
    assert resumed[0]["lr"] < 0.01  # decayed from 0.01, not from 0.5


def test_resnet9_on_images_other_than_cifars_is_refused_before_any_work():
    with pytest.raises(SystemExit, match=r"resnet9 takes CIFAR-10's 3 x 32 x 32 images"):
        main(["--data", "digits", "--model", "resnet9"], stream=io.StringIO())


def test_reshape_takes_a_numpy_integer_as_numpy_does():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = ndl.Tensor(a)
    for shape in (np.prod(a.shape), np.int32(6), 6, (6,), [3, np.int64(2)]):
        np.testing.assert_array_equal(t.reshape(shape).numpy(), a.reshape(shape))
