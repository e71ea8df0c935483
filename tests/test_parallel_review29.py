"""needle.parallel, from a review (2 MPI ranks through needle's launcher): a rank that failed
before its first Communicator left its peer waiting in MPI's start-up forever, whatever the
timeout; replicas built with different DataParallel options passed the set-up check, and
their mismatched allreduces ended steps later in a false "local_fraction" error or a
timeout."""
import importlib.util
import json

import pytest
from parallel_scripts.mpi_run import SCRIPTS, launch

from needle.parallel import find_launcher

pytestmark = [
    pytest.mark.skipif(find_launcher() is None or importlib.util.find_spec("mpi4py") is None,
                       reason="needs mpi4py and an MPI launcher"),
    pytest.mark.timeout(240),
]


def test_a_rank_that_fails_before_its_first_communicator_ends_the_job(tmp_path):
    code, output = launch(SCRIPTS / "review29.py", "early", tmp_path, cwd=SCRIPTS)
    assert code != 0, output
    assert "FileNotFoundError: rank 1: data shard missing" in output
    assert "rank 0 passed a barrier" not in output


def test_replicas_with_different_options_are_refused_on_every_rank(tmp_path):
    code, output = launch(SCRIPTS / "review29.py", "options", tmp_path, cwd=SCRIPTS)
    assert code == 0, output
    for rank in range(2):
        refusals = json.loads((tmp_path / f"refusals{rank}.json").read_text())
        assert refusals["bucket_mb"] == (
            "rank 1 has bucket bytes 2 but rank 0 has 4194304; every rank must build the same "
            "model with the same DataParallel options"), refusals
        assert refusals["overlap"].startswith("rank 1 has overlap True but rank 0 has False")
        assert refusals["norm"].startswith("rank 1 has BatchNorm channels [] but rank 0 has [8]")
