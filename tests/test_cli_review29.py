"""The CLI and the Python client as a new user met them, from a review: a link to nothing
as the output passed the check before the fee and lost the result's name after it; a
keystore with an out-of-range iteration count or key length ended in a traceback; ETH sent
to a precompile's address was spent or lost; Network() at a web server that is not a chain
node raised httpx's error. Real chain node process and HTTP servers on 127.0.0.1."""
import http.server
import json

import numpy as np
import pytest
from helpers import http_server, keystore_options, one_error_line, run_cli

from chain.devnet import dev_account
from chain.launch import NodeProcess
from needle.remote import Network
from node.market import Market

pytestmark = pytest.mark.timeout(120)
SENDER = 14


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with NodeProcess(tmp_path_factory.mktemp("chain"), block_time=0) as running:
        yield running


@pytest.fixture
def observer(node):
    market = Market(node.url, dev_account(0))
    yield market
    market.close()


@pytest.mark.parametrize("command", ["submit", "fetch"])
def test_a_link_to_nothing_as_the_output_is_refused_before_the_fee(node, observer, tmp_path,
                                                                   command):
    np.save(tmp_path / "a.npy", np.ones((2, 3), np.float32))
    np.save(tmp_path / "b.npy", np.ones((3, 2), np.float32))
    output = tmp_path / "c.npy"
    output.symlink_to(tmp_path / "nowhere.npy")
    address = dev_account(SENDER).address
    jobs, balance = observer.job_count(), observer.balance_of(address)
    operands = [tmp_path / "a.npy", tmp_path / "b.npy"] if command == "submit" else [0]
    keys = keystore_options(tmp_path, SENDER) if command == "submit" else []
    line = one_error_line(run_cli(command, *operands, "-o", output, "--rpc-url", node.url,
                                  *keys))
    assert line == f"error: output {output} exists; pass --force to overwrite it"
    assert (observer.job_count(), observer.balance_of(address)) == (jobs, balance)
    assert output.is_symlink() and not (tmp_path / "nowhere.npy").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".part")) == []


@pytest.mark.parametrize("field,value,reason", [
    ("c", 2**31, "pbkdf2 c = 2147483648 is above 10000000, more work than a keystore needs"),
    ("dklen", 10**10, "key derivation parameters are out of range (key length is too great.)")])
def test_a_keystore_with_out_of_range_kdf_parameters_is_one_error_line(node, tmp_path, field,
                                                                       value, reason):
    options = keystore_options(tmp_path, SENDER)
    keystore = tmp_path / f"key{SENDER}.json"
    content = json.loads(keystore.read_text())
    assert content["crypto"]["kdf"] == "pbkdf2"
    content["crypto"]["kdfparams"][field] = value
    keystore.write_text(json.dumps(content))
    line = one_error_line(run_cli("send", dev_account(1).address, "0.01", "-y", "--rpc-url",
                                  node.url, *options))
    assert line == f"error: cannot decrypt keystore {keystore}: its {reason}"


@pytest.mark.parametrize("to", ["0x" + "0" * 38 + "f1", "0x" + "0" * 39 + "1", "0x" + "0" * 40])
def test_a_transfer_to_a_precompile_or_the_zero_address_is_refused_before_sending(
        node, observer, tmp_path, to):
    address = dev_account(SENDER).address
    before = observer.balance_of(address), observer.client.w3.eth.get_transaction_count(address)
    line = one_error_line(run_cli("send", to, "1", "-y", "--rpc-url", node.url,
                                  *keystore_options(tmp_path, SENDER)))
    assert " is no one's account (the zero address and the chain's precompiles lie below " \
           "0x100): ETH sent there is lost, or the transfer fails" in line, line
    after = observer.balance_of(address), observer.client.w3.eth.get_transaction_count(address)
    assert after == before
    # an ordinary address just above the range still takes a transfer
    above = "0x" + "0" * 37 + "100"
    assert run_cli("send", above, "0.5", "-y", "--rpc-url", node.url,
                   *keystore_options(tmp_path, SENDER)).exit_code == 0
    assert observer.balance_of(above) >= 5 * 10**17


class _Answers(http.server.BaseHTTPRequestHandler):
    """A web server that is not a chain node: /info is a web page, or JSON of another kind;
    anything else is 404."""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = {"/page/info": b"<html>hello</html>", "/json/info": b'{"name": "other"}'}
        found = body.get(self.path)
        self.send_response(200 if found else 404)
        self.send_header("Content-Length", str(len(found or b"")))
        self.end_headers()
        self.wfile.write(found or b"")

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("path,answer", [
    ("/missing", "HTTP 404"), ("/page", "no JSON"), ("/json", "without 'chain_id'")])
def test_network_at_a_server_that_is_not_a_chain_node_says_so(path, answer):
    with http_server(_Answers) as server:
        url = f"http://127.0.0.1:{server.server_port}{path}"
        with pytest.raises(ConnectionError) as raised:
            Network(url)
    assert str(raised.value) == f"{url} is not a needle-net chain node: its /info answered {answer}"
