"""A URL that answers, but not as a needle-net chain node (a 404, a web page, another
service's JSON): every entry point says so in the same words, from one place
(chain.client.node_info). The CLI's balance, jobs and send ended in a traceback for a web
page or another service's JSON; `chain info` and the worker worded it their own ways.
Plain HTTP servers on 127.0.0.1."""
import http.server

import httpx
import pytest
from helpers import http_server, one_error_line, run_cli

from chain.client import NotAChainNode, node_info

pytestmark = pytest.mark.timeout(60)
ANSWERS = [("/missing", "HTTP 404"), ("/page", "no JSON"), ("/json", "without 'chain_id'"),
           ("/list", "without 'chain_id'"), ("/partial", "without 'abi'")]


class _NotANode(http.server.BaseHTTPRequestHandler):
    """/info as a web page, as JSON of another kind, or 404."""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = {"/page/info": b"<html>hello</html>", "/json/info": b'{"name": "other"}',
                "/list/info": b"[1, 2]",
                "/partial/info": b'{"chain_id": 1, "contract": "0x' + b"11" * 20 + b'"}'}
        found = body.get(self.path)
        self.send_response(200 if found else 404)
        self.send_header("Content-Length", str(len(found or b"")))
        self.end_headers()
        self.wfile.write(found or b"")

    def do_POST(self):  # noqa: N802
        self.do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    with http_server(_NotANode) as running:
        yield f"http://127.0.0.1:{running.server_port}"


def _expected(url: str, answer: str) -> str:
    return f"{url} is not a needle-net chain node: its /info answered {answer}"


@pytest.mark.parametrize("path,answer", ANSWERS)
def test_node_info_names_what_answered(server, path, answer):
    with httpx.Client() as http, pytest.raises(NotAChainNode) as raised:
        node_info(http, server + path)
    assert str(raised.value) == _expected(server + path, answer)


@pytest.mark.parametrize("path,answer", ANSWERS)
@pytest.mark.parametrize("command", [["balance", "0x" + "12" * 20], ["jobs"]])
def test_the_cli_answers_one_line(server, path, answer, command):
    url = server + path
    line = one_error_line(run_cli(*command, "--rpc-url", url))
    assert line == "error: " + _expected(url, answer)


@pytest.mark.parametrize("path,answer", ANSWERS[:3])
def test_chain_info_answers_the_same_line(server, path, answer):
    from typer.testing import CliRunner

    from chain.cli import app

    result = CliRunner().invoke(app, ["info", "--url", server + path], terminal_width=400)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.output.strip() == "error: " + _expected(server + path, answer)


@pytest.mark.parametrize("path", ["/rpc", "/rpc/"])
def test_the_json_rpc_path_given_as_the_url_is_named(server, path):
    """The docs call POST /rpc the JSON-RPC endpoint; a URL ending in it gets a 404 for its
    /info, and the message says which URL to give instead (the CLI took it as a dead end)."""
    with httpx.Client() as http, pytest.raises(NotAChainNode) as raised:
        node_info(http, server + path)
    assert str(raised.value) == (_expected(server + path, "HTTP 404")
                                 + f"; give the node's own URL, {server}")
    line = one_error_line(run_cli("jobs", "--rpc-url", server + path))
    hint = f"; give the node's own URL, {server}"
    assert line == "error: " + _expected(server + "/rpc", "HTTP 404") + hint  # no final /
