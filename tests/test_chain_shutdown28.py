"""A SIGTERMed chain node stops at once although a client long-polls a transaction that
cannot be mined yet (behind a nonce gap): uvicorn waits for every request in progress, and
such a poll held the node up to its 60 s (a soak test's restart timed out at 30, and
`docker stop` kills after 10). The poll is answered, the node exits through its graceful
path, and the transaction is still there after the restart."""
import signal
import threading

import httpx
import pytest

from chain.devnet import dev_account
from chain.launch import NodeProcess
from chain.params import CHAIN_ID

pytestmark = pytest.mark.timeout(120)
POLL_SECONDS = 60  # the longest long poll the node grants (chain.rpc.MAX_WAIT_S)
STOP_SECONDS = 20  # far below it: the node did not wait for the poll


def _rpc(url: str, method: str, *params):
    reply = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": method,
                                  "params": list(params)}, timeout=10).json()
    assert "error" not in reply, reply
    return reply["result"]


def test_a_sigterm_answers_long_polls_and_stops_without_waiting_for_them(tmp_path):
    account = dev_account(3)
    node = NodeProcess(tmp_path / "chain", block_time=0.25).start()
    try:
        nonce = int(_rpc(node.url, "eth_getTransactionCount", account.address, "pending"), 16)
        gap = account.sign_transaction({
            "to": account.address, "value": 1, "gas": 21_000, "maxFeePerGas": 10**11,
            "maxPriorityFeePerGas": 1, "nonce": nonce + 3, "chainId": CHAIN_ID, "type": 2})
        tx_hash = _rpc(node.url, "eth_sendRawTransaction", "0x" + gap.raw_transaction.hex())
        answers: list = []

        def long_poll() -> None:
            try:
                answers.append(httpx.get(f"{node.url}/wait", timeout=POLL_SECONDS + 30,
                                         params={"tx": tx_hash, "timeout": POLL_SECONDS}))
            except httpx.HTTPError as err:
                answers.append(err)

        poller = threading.Thread(target=long_poll)
        poller.start()
        # the poll is waiting once the node has sealed a block after it came in
        head = int(_rpc(node.url, "eth_blockNumber"), 16)
        httpx.get(f"{node.url}/wait", params={"block": head + 2, "timeout": 10}, timeout=20)
        assert poller.is_alive() and not answers

        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(STOP_SECONDS) == 128 + signal.SIGTERM
        poller.join(STOP_SECONDS)
        (answer,) = answers
        assert isinstance(answer, httpx.Response) and answer.status_code == 200, answer
        assert answer.json()["receipts"] == [None]  # still pending: the client asks again

        node.start()  # the journal kept the transaction its hash was answered for
        found = _rpc(node.url, "eth_getTransactionByHash", tx_hash)
        assert found is not None and int(found["nonce"], 16) == nonce + 3
        assert found["blockNumber"] is None
    finally:
        node.stop()
