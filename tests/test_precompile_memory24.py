"""A node with too little memory for a Freivalds check reaches no verdict. The precompile
turned every exception into FAIL, MemoryError included: a small node slashed an honest
worker (half its stake) and reopened the job, where any larger node passed the same result.
The node here is real, in a child process whose address space is cut (RLIMIT_AS) just
before the finalize is sealed, and restored after."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS")]

SCRIPT = r"""
import json, resource, sys
from pathlib import Path

import numpy as np

sys.path.insert(0, sys.argv[2])
from test_market_review import ETHER, FEE, Market

from chain.blobs import encode_array
from node.market import finalize_gas_for


def address_space() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


market = Market(Path(sys.argv[1]))
submitter, worker, anyone = market.accounts[:3]
n = 2048
rng = np.random.default_rng(0)
a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
c = (a.astype(np.float64) @ b).astype(np.float32)
a_id, b_id, c_id = (market.node.blobs.put(encode_array(x)) for x in (a, b, c))
market.mine(worker.raw("register", value=ETHER),
            submitter.raw("submitJob", a_id, b_id, 1, n, n, n, 1, 10, value=FEE))
market.send(worker, "commitJobs", [0], [c_id])
market.mine()  # finalize waits a block after the commit
stake = market.view("workerStake", worker.address)
gas = finalize_gas_for(1, n, n, n, exact=False)
finalize = anyone.raw("finalize", 0, gas=gas)
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (address_space() + (256 << 20), hard))
ballast = []  # the address space left and the allocator's free space, in 1 MiB pieces
try:
    while True:
        ballast.append(bytearray(1 << 20))
except MemoryError:
    pass
del ballast[-8:]  # 8 MiB for the sealing's own allocations
try:  # the check's operands alone are 48 MiB
    market.node.admit(finalize)
    starved = market.node.seal()
finally:
    ballast.clear()
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
report = {"included": len(starved.transactions), "status": market.job(0)["status"],
          "stake_kept": market.view("workerStake", worker.address) == stake}
anyone.nonce -= 1  # the dropped finalize's nonce is free again
[receipt] = market.mine(anyone.raw("finalize", 0, gas=gas))
report["then"] = [name for name, _ in receipt["events"]]
market.close()
print(json.dumps(report))
"""


def test_a_check_this_node_cannot_run_for_memory_is_no_verdict(tmp_path):
    tests = Path(__file__).parent
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "chain"), str(tests)],
                         capture_output=True, text=True, timeout=240, cwd=tests.parent)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout.splitlines()[-1])
    # the starved node dropped the finalize: the job stays committed, the stake whole
    assert report == {"included": 0, "status": 3, "stake_kept": True,
                      "then": ["JobVerified"]}, run.stderr[-3000:]
