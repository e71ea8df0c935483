"""needle.parallel review 24: a job started by needle's launcher listens on the loopback
interface only, so no other machine can reach the ranks' transports (UCX, libfabric), which
carry every gradient unauthenticated; the batches of needle's own DataLoader (Tensors) can be
sharded by DataParallel and split by Pipeline, and train as one process does.

The ranks are a real MPI job (`python -m needle.parallel.launch -n 2`), bounded by
mpi_run.TIMEOUT_S; the references are the same models trained in this process."""
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from parallel_scripts.common import CLASSES, IN, make_model, make_stages
from parallel_scripts.mpi_run import LAUNCHER, launch

import needle as ndl
from needle import data, nn
from needle.parallel import Pipeline, launch_env

NEEDS_MPI = pytest.mark.skipif(LAUNCHER is None, reason="no MPI launcher or no mpi4py")
CPU = ndl.cpu()

# Each rank: the addresses of the listening TCP sockets it holds and its parent (the launcher's
# proxy) does not. Hydra's own control socket is opened by mpiexec, on every interface, and
# inherited by the ranks: it is not theirs and no setting moves it (see docs/parallel.md).
RANK_SCRIPT = textwrap.dedent("""
    import json, os, socket, sys
    import numpy as np
    from needle.parallel import Communicator

    def socket_inodes(pid):
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        return inodes

    def address(hex_address, family):
        host, port = hex_address.split(":")
        raw = bytes.fromhex(host)
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
        return f"{socket.inet_ntop(family, raw)}:{int(port, 16)}"

    def listening():
        found = {}
        for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
            with open(f"/proc/net/{name}") as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A":  # TCP_LISTEN
                        found[fields[9]] = address(fields[1], family)
        return found

    comm = Communicator(timeout_s=60)
    buf = np.ones(4, np.float32)
    comm.wait_all([comm.iallreduce_sum_(buf)])  # the transports are up and connected
    probe = socket.create_server(("127.0.0.1", 0))  # one the probe must see
    own = socket_inodes(os.getpid()) - socket_inodes(os.getppid())
    addresses = sorted(a for inode, a in listening().items() if inode in own)
    with open(os.path.join(sys.argv[1], f"rank{comm.rank}.json"), "w") as f:
        json.dump({"sum": buf.tolist(), "listening": addresses,
                   "probe": "127.0.0.1:%d" % probe.getsockname()[1]}, f)
    comm.barrier()
""")


@NEEDS_MPI
def test_a_launched_job_listens_on_loopback_only(tmp_path):
    script = tmp_path / "listening.py"
    script.write_text(RANK_SCRIPT)
    code, output = launch(script, tmp_path, nprocs=2)
    assert code == 0, output
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["sum"] == [2.0] * 4
        assert report["probe"] in report["listening"], f"rank {rank}: the probe is blind"
        outside = [a for a in report["listening"]
                   if not a.startswith(("127.0.0.1:", "::1:"))]
        assert outside == [], f"rank {rank} listens beyond loopback: {outside}"


def test_launch_env_confines_the_transports_and_keeps_a_users_choice():
    env = launch_env({})
    assert (env["UCX_NET_DEVICES"], env["FI_TCP_IFACE"], env["FI_SOCKETS_IFACE"],
            env["OMPI_MCA_btl"]) == ("lo", "lo", "lo", "self,vader")
    assert launch_env({"UCX_NET_DEVICES": "mlx5_0:1"})["UCX_NET_DEVICES"] == "mlx5_0:1"


# ---------------------------------------------------------------- DataLoader batches

ROWS, BATCH, EPOCHS = 11, 4, 2  # batches of 4, 4 and 3 rows: the last one splits 2 and 1


def dataset() -> data.ArrayDataset:
    rng = np.random.default_rng(3)
    return data.ArrayDataset(rng.standard_normal((ROWS, IN)).astype(np.float32),
                             rng.integers(0, CLASSES, ROWS))


def train_one_process() -> list[np.ndarray]:
    """Plain training on the whole of every batch: what the ranks must reproduce."""
    model = make_model(seed=0)
    opt = ndl.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = data.DataLoader(dataset(), BATCH, shuffle=True, seed=5, device=CPU)
    for _ in range(EPOCHS):
        for x, y in loader:
            opt.reset_grad()
            nn.SoftmaxLoss()(model(x), y).backward()
            opt.step()
    return [p.numpy() for p in model.parameters()]


DP_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])  # the tests folder
    import numpy as np
    import needle as ndl
    from needle import nn
    from needle.parallel import Communicator, DataParallel
    from test_parallel_review24 import BATCH, EPOCHS, CPU, data, dataset
    from parallel_scripts.common import make_model

    model = DataParallel(make_model(seed=0), comm=Communicator(timeout_s=60))
    opt = ndl.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = data.DataLoader(dataset(), BATCH, shuffle=True, seed=5, device=CPU)
    for _ in range(EPOCHS):
        for x, y in loader:  # needle Tensors, the same on every rank (same seed)
            xl, yl = model.shard(x), model.shard(y)
            opt.reset_grad()
            loss = nn.SoftmaxLoss()(model(ndl.Tensor(xl, device=CPU)), ndl.Tensor(yl, device=CPU))
            model.backward(loss, model.local_fraction(len(x)))
            opt.step()
    np.savez(f"{sys.argv[1]}/rank{model.comm.rank}.npz", *[p.numpy() for p in model.parameters()])
""")


@NEEDS_MPI
def test_data_parallel_shards_dataloader_batches_and_matches_one_process(tmp_path):
    """DataLoader batches are Tensors; numpy turns a Tensor into an array of Tensor objects,
    which `shard` handed on until Tensor() refused dtype object."""
    script = tmp_path / "dp_loader.py"
    script.write_text(DP_SCRIPT)
    code, output = launch(script, tmp_path, Path(__file__).parent, nprocs=2)
    assert code == 0, output
    expected = train_one_process()
    for rank in range(2):
        weights = np.load(tmp_path / f"rank{rank}.npz")
        got = [weights[f"arr_{i}"] for i in range(len(weights.files))]
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")


def test_pipeline_splits_dataloader_batches_as_the_unsplit_model_trains():
    stages = make_stages(seed=0)
    pipe = Pipeline(stages, [CPU, CPU], micro_batches=2)
    opt = ndl.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    loader = data.DataLoader(dataset(), BATCH, shuffle=True, seed=5, device=CPU)
    for _ in range(EPOCHS):
        for x, y in loader:
            opt.reset_grad()
            pipe.forward_backward(x, y, nn.SoftmaxLoss())
            opt.step()
    got = [p.numpy() for stage in stages for p in stage.parameters()]
    for g, e in zip(got, train_one_process(), strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
