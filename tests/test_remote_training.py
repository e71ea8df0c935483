"""Training with matmuls offloaded to a real devnet (chain + worker processes): the MLP on the
bundled digits reaches the same accuracy as local training, and the big matmuls (forward and
backward) really ran as verified, paid network jobs."""

import pytest

from chain.devnet import dev_account
from needle.remote import Network
from node.devnet import Devnet
from node.market import Market
from node.training import train_digits

pytestmark = pytest.mark.timeout(240)
STEPS = 10


def test_offloaded_training_matches_local(tmp_path):
    local = train_digits(steps=STEPS)
    with Devnet(tmp_path, block_time=0.5) as net:
        net.start(workers=1)
        network = Network(net.rpc_url, dev_account(5).key, timeout=60)
        remote = train_digits(network, steps=STEPS)
        network.close()
        observer = Market(net.rpc_url, dev_account(7))
        verified = observer.contract.events.JobVerified.get_logs(from_block=0)
        observer.close()
    # Per step: layer 1's forward x @ W1 and its weight gradient x^T @ dy (no dx: x is data);
    # layer 2's matmuls are below min_flops and stay local.
    assert remote.offloaded_matmuls == 2 * STEPS
    assert len(verified) == remote.offloaded_matmuls
    assert abs(remote.test_accuracy - local.test_accuracy) <= 0.01
    assert local.test_accuracy > 0.8  # it did learn
    assert remote.final_loss == pytest.approx(local.final_loss, rel=1e-3)
