"""A worker restarted while the claims of its last run expire one after another: its
top-up of the stake reverted "stake below minStake" each time a slash was mined first, and
after three tries the worker exited (the soak test's restarted worker, with eight claims
expiring a block apart). Real chain node process on 127.0.0.1; the slashes are real
reopenExpired transactions, one mined before each of the worker's register transactions."""
import numpy as np
import pytest

from chain.devnet import dev_account
from chain.launch import NodeProcess
from node.market import Market
from node.worker import TxReverted, Worker, WorkerConfig

pytestmark = pytest.mark.timeout(120)
ETHER = 10**18
CLAIMS = 6  # more than the three tries the worker used to make


def _claims_past_their_deadline(holder: Market, submitter: Market, count: int) -> list[int]:
    """count jobs (no fee, 1-block deadlines) claimed by the holder's key, deadlines passed."""
    ids = submitter.put_array(np.ones((2, 2), np.float32))
    first = submitter.job_count()
    for _ in range(count):
        submitter.send("submitJob", ids, ids, 1, 2, 2, 2, 1, 1)
    for job_id in range(first, first + count):
        holder.send("claimJob", job_id)
    submitter.send("register", value=ETHER)  # one block more: the last deadline passed
    return list(range(first, first + count))


def test_a_top_up_outlasts_a_slash_mined_before_each_of_its_tries(tmp_path):
    account = dev_account(19)
    with NodeProcess(tmp_path / "chain", block_time=0) as chain:
        holder, submitter = Market(chain.url, account), Market(chain.url, dev_account(18))
        worker = Worker(WorkerConfig(rpc_url=chain.url, data_dir=tmp_path / "worker",
                                     stake_wei=ETHER, poll_interval=0.2), account)
        try:
            holder.send("register", value=ETHER)
            expired = _claims_past_their_deadline(holder, submitter, CLAIMS)
            submitter.send("reopenExpired", expired.pop())  # a slash: the worker tops up
            sends, registers = worker.chain.send_signed, []

            def slash_first(signed, *args, **kwargs):
                """Mine the next expired claim's slash, then the worker's transaction."""
                registers.append(holder.stake_of(account.address))
                if expired:
                    submitter.send("reopenExpired", expired.pop())
                return sends(signed, *args, **kwargs)

            worker.chain.send_signed = slash_first
            worker._ensure_registered()

            assert len(registers) == CLAIMS  # five reverted, the last one landed
            assert holder.stake_of(account.address) == ETHER
            assert worker.status()["stake_wei"] == ETHER
            assert holder.worker_info(account.address)[2] == 0  # no claim left in flight
        finally:
            worker.close()
            holder.close()
            submitter.close()


def test_a_register_that_reverts_without_a_slash_is_an_error(tmp_path):
    """The loop above ends: a revert the stake did not fall before is raised at once."""
    account = dev_account(17)
    with NodeProcess(tmp_path / "chain", block_time=0) as chain:
        holder = Market(chain.url, account)
        worker = Worker(WorkerConfig(rpc_url=chain.url, data_dir=tmp_path / "worker",
                                     stake_wei=ETHER, poll_interval=0.2), account)
        worker.config.stake_wei = ETHER // 2  # below the minimum (refused at start, else)
        sends, tries = worker.chain.send_signed, []
        worker.chain.send_signed = lambda *a, **k: tries.append(1) or sends(*a, **k)
        try:
            with pytest.raises(TxReverted, match=r"register reverted in tx 0x[0-9a-f]+: "
                                                 r"execution reverted: stake below minStake$"):
                worker._ensure_registered()
            assert len(tries) == 1
            assert holder.stake_of(account.address) == 0
        finally:
            worker.close()
            holder.close()
