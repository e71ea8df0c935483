"""needle.parallel, checkpoint and optimiser misuse found in review: a rank that dies under a
plain `mpiexec` or leaves early, checkpoints that do not match the model, a fractional Adam
step count."""
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from parallel_scripts.mpi_run import launch as launch_ranks

import needle as ndl
from needle import checkpoint, nn, optim
from needle.parallel import find_launcher, launch_env

CPU = ndl.cpu()
BOUND_S = 90  # a hang fails the test after this long instead of blocking the run
NEEDS_MPI = pytest.mark.skipif(find_launcher() is None or importlib.util.find_spec("mpi4py")
                               is None, reason="no MPI launcher or no mpi4py")


# ---------------------------------------------------------------- a rank that dies


@NEEDS_MPI
def test_a_rank_that_raises_under_plain_mpiexec_aborts_the_job(tmp_path):
    """The docs offer `mpiexec -n N python train.py` (no `-m mpi4py`): once a Communicator
    exists, an exception on one rank must end the job, not leave rank 0 in its allreduce."""
    script = tmp_path / "dies.py"
    script.write_text(textwrap.dedent("""
        import sys
        import numpy as np
        from needle.parallel import Communicator

        def report(kind, value, traceback):  # the script's own hook: still called first
            with open(sys.argv[1] + f"/rank{comm.rank}.txt", "w") as f:
                f.write(str(value))

        sys.excepthook = report
        comm = Communicator()
        if comm.rank == 1:
            raise RuntimeError("rank 1 gives up")
        comm.iallreduce_sum_(np.ones(3, np.float32)).Wait()  # waits for a rank that is gone
    """))
    cmd = [find_launcher(), "-n", "2", sys.executable, str(script), str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=launch_env(), start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"rank 0 still waited after {BOUND_S} s") from None
    assert proc.returncode != 0, output
    assert (tmp_path / "rank1.txt").read_text() == "rank 1 gives up"
    assert not (tmp_path / "rank0.txt").exists()


# ---------------------------------------------------------------- a model for the state tests


def _data(steps: int = 3, rows: int = 5):
    rng = np.random.default_rng(4)
    return [(rng.standard_normal((rows, 4)).astype(np.float32),
             rng.integers(0, 3, rows).astype(np.float32)) for _ in range(steps)]


class WithUnused(nn.Module):
    """An MLP and a layer forward never calls (say a head for another task)."""

    def __init__(self, seed: int):
        super().__init__()
        np.random.seed(seed)
        self.unused = nn.Linear(3, 2, device=CPU)
        self.body = nn.Sequential(nn.Linear(4, 6, device=CPU), nn.Tanh(),
                                  nn.Linear(6, 3, device=CPU))

    def forward(self, x):
        return self.body(x)


# ---------------------------------------------------------------- checkpoints


def test_a_checkpoint_that_does_not_fit_the_model_names_the_file(tmp_path):
    path = str(tmp_path / "mlp.npz")
    model = WithUnused(seed=0)
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _data(1):
        nn.SoftmaxLoss()(model(ndl.Tensor(x, device=CPU)), ndl.Tensor(y, device=CPU)).backward()
        opt.step()
    checkpoint.save(path, model, opt)
    other = nn.Sequential(nn.Linear(4, 3, device=CPU))
    with pytest.raises(KeyError, match=f"{path}: state_dict does not match"):
        checkpoint.load(path, other)
    wider = WithUnused(seed=1)
    wider.body = nn.Sequential(nn.Linear(4, 7, device=CPU), nn.Tanh(),
                               nn.Linear(7, 3, device=CPU))
    with pytest.raises(ValueError, match=f"{path}: .*has shape"):
        checkpoint.load(path, wider)
    target = WithUnused(seed=1)
    before = target.state_dict()
    adam = optim.Adam(target.parameters(), lr=0.01)
    with pytest.raises(KeyError, match=f"{path}: Adam state has no entry"):
        checkpoint.load(path, target, adam)
    for key, value in before.items():  # the model did not move to the checkpoint
        np.testing.assert_array_equal(target.state_dict()[key], value)


# ---------------------------------------------------------------- a rank that leaves early

LEAVES_EARLY = """
import sys
import numpy as np
import needle as ndl
from needle import nn
from needle.parallel import Communicator, DataParallel, Pipeline

CPU, where, out = ndl.cpu(), sys.argv[1], sys.argv[2]
comm = Communicator(timeout_s=3)
x, y = np.ones((4, 4), np.float32), np.zeros(4, np.float32)
if where == "data-parallel":
    model = DataParallel(nn.Linear(4, 3, device=CPU), comm)
    if comm.rank == 1:
        sys.exit(0)  # say, an early stop decided on this rank alone
    loss = nn.SoftmaxLoss()(model(ndl.Tensor(x, device=CPU)), ndl.Tensor(y, device=CPU))
    step = lambda: model.backward(loss)
else:
    stages = [nn.Linear(4, 5, device=CPU), nn.Linear(5, 3, device=CPU)]
    pipe = Pipeline(stages, [CPU, CPU], micro_batches=2, comm=comm)
    if comm.rank == 0:
        sys.exit(0)  # stage 0 never sends its activations
    step = lambda: pipe.forward_backward(x, y, nn.SoftmaxLoss())
try:
    step()
except TimeoutError as e:  # kept in a file too: an aborting job may lose its last output
    with open(f"{out}/rank{comm.rank}.txt", "w") as f:
        f.write(str(e))
    raise
print("rank", comm.rank, "went on")
"""


@NEEDS_MPI
@pytest.mark.parametrize("where, waits_for", [
    ("data-parallel", "rank 0 of 2: the gradient allreduce did not finish within 3 s"),
    ("pipeline", "rank 1 of 2: a message from rank 0 did not finish within 3 s"),
])
def test_a_rank_that_exits_early_makes_its_peer_fail_not_wait_forever(tmp_path, where,
                                                                      waits_for):
    script = tmp_path / "leaves.py"
    script.write_text(LEAVES_EARLY)
    code, output = launch_ranks(script, where, tmp_path)
    assert code != 0, output
    assert "went on" not in output
    waiting = int(waits_for.split()[1])
    assert (tmp_path / f"rank{waiting}.txt").read_text().startswith(waits_for)


def test_timeout_must_be_positive_or_none():
    from needle.parallel import Communicator

    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout_s must be positive or None"):
            Communicator(timeout_s=bad)
    assert Communicator(timeout_s=None).timeout_s is None


def test_a_fractional_adam_step_count_is_refused_and_changes_nothing():
    model = WithUnused(seed=0)
    adam = optim.Adam(model.parameters(), lr=0.01)
    state = {**adam.state_dict(), "t": np.array(2.5), "lr": np.array(0.5)}
    with pytest.raises(ValueError, match="t must be a whole number of steps, got 2.5"):
        adam.load_state_dict(state)
    assert adam.t == 0 and adam.lr == 0.01
    adam.load_state_dict({**state, "t": np.array(3.0)})  # a whole number stored as a float
    assert adam.t == 3
