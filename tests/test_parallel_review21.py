"""needle.parallel review 21: object collectives and the barrier give up on a peer that left,
a parameter that no rank used keeps grad None, and local_fraction must sum to 1 over the ranks.

The MPI cases launch tests/parallel_scripts/review21.py under `mpiexec` (bounded by
mpi_run.TIMEOUT_S, the process group killed on expiry); the one-rank cases run in this process,
on the CPU with `Communicator` and on a GPU with `NcclCommunicator`.
"""
import json
import pickle

import numpy as np
import pytest
from parallel_scripts.mpi_run import LAUNCHER, SCRIPTS, launch, run_mpi
from parallel_scripts.review21 import IN, SYNC_MODES, Branchy, batches, object_of, square_loss

import needle as ndl
from needle.parallel import Communicator, DataParallel, NcclCommunicator, nccl_available

NEEDS_MPI = pytest.mark.skipif(LAUNCHER is None, reason="no MPI launcher or no mpi4py")
ONE_GPU_NCCL = pytest.mark.skipif(
    not (ndl.cuda().enabled() and nccl_available()), reason="needs a CUDA GPU and CuPy with NCCL"
)
NEVER, BODY, BRANCH = (0, 1), (2, 3), (4, 5)  # (weight, bias) indices into parameters()


# ---------------------------------------------------------------- object collectives, barrier


@pytest.fixture(scope="module")
def objects_run(tmp_path_factory):
    """3 ranks: object allgather and broadcasts from every root; then rank 0 exits."""
    if LAUNCHER is None:
        pytest.skip("no MPI launcher or no mpi4py")
    out = tmp_path_factory.mktemp("objects")
    _, output = launch(SCRIPTS / "review21.py", "objects", out, nprocs=3, cwd=SCRIPTS)
    return out, output


def test_object_collectives_give_every_rank_what_mpi4py_gives(objects_run):
    out, output = objects_run
    expected = [object_of(r) for r in range(3)]
    for r in range(3):
        path = out / f"objects{r}.pkl"
        assert path.exists(), output
        got = pickle.loads(path.read_bytes())
        for key in ("gathered", "broadcast", "mpi4py_gathered", "mpi4py_broadcast"):
            assert [type(o) for o in got[key]] == [type(o) for o in expected], key
            np.testing.assert_equal(got[key], expected, err_msg=f"rank {r}: {key}")


def test_object_collectives_and_barrier_give_up_on_a_peer_that_left(objects_run):
    out, output = objects_run
    for r in (1, 2):
        path = out / f"left{r}.json"
        assert path.exists(), output
        errors = json.loads(path.read_text())
        for name, what in [("allgather", "the object allgather (sizes)"),
                           ("broadcast", "the object broadcast from rank 0 (size)"),
                           ("barrier", "the barrier")]:
            assert errors[name] == (
                f"rank {r} of 3: {what} did not finish within 1.0 s; "
                "a peer rank has exited, died or is stuck"
            ), name


# ---------------------------------------------------------------- parameters without gradients


def _numpy_gradients(start: list[np.ndarray], x: np.ndarray) -> dict[int, np.ndarray]:
    """The global-batch gradient, by hand: rank 0's shard (3 rows) goes through body and
    branch, rank 1's (2 rows) through body alone; each shard's mean loss weighted by its
    share of the batch. Rank 1 has no gradient for the branch: it counts as zero."""
    w_body, b_body, w_branch, b_branch = (start[i].astype(np.float64) for i in (*BODY, *BRANCH))
    grads = {i: 0.0 for i in (*BODY, *BRANCH)}
    for rank, shard in enumerate(np.array_split(x.astype(np.float64), 2)):
        weight = len(shard) / len(x)
        uses_branch = rank == 0
        out = shard @ w_body + b_body + (shard @ w_branch + b_branch if uses_branch else 0)
        d_out = weight * 2 * out / len(shard)
        for w, b in [BODY, BRANCH] if uses_branch else [BODY]:
            grads[w] = grads[w] + shard.T @ d_out
            grads[b] = grads[b] + d_out.sum(0, keepdims=True)
    return grads


def _sgd_two_steps(start: list[np.ndarray], xs: list[np.ndarray]) -> list[np.ndarray]:
    """needle's SGD(lr=0.1, momentum=0.9, weight_decay=0.1) for parameters with gradients."""
    weights = [w.astype(np.float64) for w in start]
    velocity: dict[int, np.ndarray] = {}
    for x in xs:
        for i, g in _numpy_gradients(weights, x).items():
            g = g + 0.1 * weights[i]
            velocity[i] = 0.1 * g if i not in velocity else 0.9 * velocity[i] + 0.1 * g
            weights[i] = weights[i] - 0.1 * velocity[i]
    return weights


@NEEDS_MPI
def test_a_parameter_no_rank_used_keeps_grad_none_and_does_not_move(tmp_path):
    run_mpi("review21.py", "unused", tmp_path)
    xs = batches()
    for mode, bucket_mb in SYNC_MODES:
        ranks = [np.load(tmp_path / f"unused_{mode}_{bucket_mb}_{r}.npz") for r in range(2)]
        for name in ranks[0].files:  # the replicas agree to the bit
            np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=name)
        saved = ranks[0]
        start = [saved[f"start{i}"] for i in range(6)]
        label = f"{mode}, bucket_mb={bucket_mb}"
        # no rank used `never`: no gradient, and weight decay and momentum left it alone
        assert not any(f"grad{i}" in saved for i in NEVER), label
        for i in NEVER:
            np.testing.assert_array_equal(saved[f"end{i}"], start[i], err_msg=label)
        # only rank 0 used `branch`: its weighted gradient, rank 1's missing one counted as 0
        for i, expected in _numpy_gradients(start, xs[0]).items():
            np.testing.assert_allclose(saved[f"grad{i}"], expected, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{label}: parameter {i}")
        for i, expected in enumerate(_sgd_two_steps(start, xs)):
            np.testing.assert_allclose(saved[f"end{i}"], expected, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{label}: parameter {i}")


# ---------------------------------------------------------------- local_fraction


@NEEDS_MPI
def test_fractions_that_do_not_sum_to_one_are_refused_on_every_rank(tmp_path):
    run_mpi("review21.py", "fraction", tmp_path)
    reports = [json.loads((tmp_path / f"fraction{r}.json").read_text()) for r in range(2)]
    for overlap in (False, True):
        for r, report in enumerate(reports):
            assert report[f"sum 0.9 {overlap}"] == (
                "ValueError: local_fraction summed over the 2 ranks is 0.9, not 1; pass each "
                "rank its share of the global batch (model.local_fraction(batch size)); "
                "no gradient was synchronised"
            )
            other = ("ValueError: local_fraction lies outside [0, 1] on another of the 2 ranks; "
                     "no gradient was synchronised")
            own = "ValueError: local_fraction must lie in [0, 1], got "
            assert report[f"out of range {overlap}"] == (own + "1.5" if r == 0 else other)
            assert report[f"nan {overlap}"] == (own + "nan" if r == 0 else other)
        # no rank was left behind: the next step synchronises as usual, identically
        good = [report[f"good {overlap}"] for report in reports]
        assert isinstance(good[0], list), good[0]
        assert good[0] == good[1]


# ---------------------------------------------------------------- one rank, CPU and GPU

ONE_RANK = [
    pytest.param("cpu", id="cpu-mpi"),
    pytest.param("cuda", id="cuda-nccl", marks=ONE_GPU_NCCL),
]


def _one_rank(where: str):
    """(communicator, device) for a world of one rank: this process."""
    if where == "cuda":
        return NcclCommunicator(Communicator(timeout_s=60)), ndl.cuda()
    return Communicator(timeout_s=60), ndl.cpu()


@pytest.mark.parametrize("where", ONE_RANK)
@pytest.mark.parametrize("overlap", [False, True])
def test_one_rank_keeps_grad_none_where_no_gradient_and_matches_plain_backward(where, overlap):
    comm, device = _one_rank(where)
    x = batches(1)[0]
    plain = Branchy(seed=0, device=device)
    square_loss(plain(ndl.Tensor(x, device=device), False)).backward()
    model = DataParallel(Branchy(seed=0, device=device), comm, bucket_mb=1e-6, overlap=overlap)
    for _ in range(2):  # the second step starts from buckets the first one filled
        for p in model.parameters():
            p.grad = None
        model.backward(square_loss(model(ndl.Tensor(x, device=device), False)))
        for i, (p, q) in enumerate(zip(model.parameters(), plain.parameters(), strict=True)):
            assert (p.grad is None) == (q.grad is None) == (i not in BODY), i
            if p.grad is not None:
                np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("where", ONE_RANK)
def test_one_rank_refuses_a_fraction_other_than_one(where):
    comm, device = _one_rank(where)
    model = DataParallel(ndl.nn.Linear(IN, 2, device=device), comm)
    loss = square_loss(model(ndl.Tensor(batches(1)[0], device=device)))
    with pytest.raises(ValueError, match=r"summed over the 1 ranks is 0\.5, not 1"):
        model.backward(loss, 0.5)
    loss = square_loss(model(ndl.Tensor(batches(1)[0], device=device)))
    model.backward(loss, 1.0)  # and the next step goes through
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("where", ONE_RANK)
def test_one_rank_object_collectives_and_barrier(where):
    comm, _ = _one_rank(where)
    for obj in (None, b"", object_of(2)):
        np.testing.assert_equal(comm.allgather_objects(obj), [obj])
        np.testing.assert_equal(comm.broadcast_object(obj), obj)
    comm.barrier()

