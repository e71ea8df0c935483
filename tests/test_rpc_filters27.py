"""eth_newFilter's block range against geth's rule, on a real node process: a range whose
numeric fromBlock is after its numeric toBlock is refused ("invalid block range" in geth) as
eth_getLogs refuses it, whether or not fromBlock is ahead of the head; a filter that follows
the head ("latest", or no fromBlock) with a numeric end is installed. Fails on the node before
its fix, which installed the empty range when fromBlock was at or below the head."""
import pytest
from test_rpc_methods26 import reply_of
from test_rpc_review25 import mined, nonce_of, send_batch, signed

from chain.devnet import dev_accounts

pytestmark = pytest.mark.timeout(120)


def test_a_log_filter_whose_start_is_after_its_end_is_refused(node):
    account = dev_accounts(3)[2]
    nonce = nonce_of(node, account)
    for i in range(3):  # a block each
        mined(node, *send_batch(node, [signed(account, nonce + i, 2)]))
    head = int(reply_of(node.url, "eth_blockNumber")["result"], 16)
    assert head >= 2
    for start, end in [(head, head - 1), (2, 1), (head + 5, head + 2)]:
        criteria = {"fromBlock": hex(start), "toBlock": hex(end)}
        logs = reply_of(node.url, "eth_getLogs", criteria)
        if start <= head:  # the reference: eth_getLogs over the same range
            assert logs["error"]["code"] == -32602, logs
        installed = reply_of(node.url, "eth_newFilter", criteria)
        assert installed.get("error", {}).get("code") == -32602, (criteria, installed)
        assert "after toBlock" in installed["error"]["message"]
    for criteria in [{"fromBlock": "latest", "toBlock": hex(head)}, {"toBlock": hex(head)},
                     {"fromBlock": hex(head - 1), "toBlock": hex(head)}]:
        installed = reply_of(node.url, "eth_newFilter", criteria)
        assert "result" in installed, (criteria, installed)
        assert reply_of(node.url, "eth_uninstallFilter", installed["result"])["result"] is True
