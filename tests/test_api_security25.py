"""The worker's HTTP API as an attacker sees it, with real HTTP to a real server on
127.0.0.1 and a real browser: a web page whose domain was rebound to 127.0.0.1 (DNS
rebinding) must not read the API or try admin tokens on it; an admin token with non-ASCII
characters must open the admin routes; no answer may be framed by another site or
sniffed as another type."""
import socket
import time

import httpx
import pytest
import test_dashboard
from test_blob_review import FakeNode, asgi_server
from test_dashboard import CHROMIUM, Page

from node.api import create_app

pytestmark = pytest.mark.timeout(120)
TOKEN = "s3cret-token"
REBOUND = "evil.test"  # an attacker's domain, resolved to 127.0.0.1 after the page loaded


def test_a_host_name_that_is_not_this_machine_is_refused_on_loopback():
    """Before, any Host was served: a page on a rebound domain read /status and /jobs and
    could try admin tokens as its own site. Now such a request is 403 and reaches no route;
    this machine's names (addresses, localhost, its host name, names without a dot, which
    no public DNS serves) are served as before."""
    node = FakeNode()
    with asgi_server(create_app(node, TOKEN)) as port:
        url = f"http://127.0.0.1:{port}"
        admin = {"Authorization": f"Bearer {TOKEN}"}
        for host in (f"{REBOUND}:{port}", REBOUND, f"EVIL.test.:{port}", f"a.b.c:{port}"):
            for path in ("/status", "/jobs", "/"):
                response = httpx.get(url + path, headers={"Host": host})
                assert response.status_code == 403 and "rebinding" in response.text, (host, path)
            response = httpx.post(url + "/admin/stop", headers={"Host": host, **admin})
            assert response.status_code == 403, host
        assert not node.stopped
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}",
                     f"LocalHost.:{port}", f"dash.localhost:{port}",
                     f"{socket.gethostname()}:{port}", "x"):
            response = httpx.get(url + "/status", headers={"Host": host})
            assert response.status_code == 200 and response.json() == node.status(), host
        assert httpx.post(url + "/admin/stop", headers=admin).json() == {"stopping": True}


def _awaited(page: Page, expression: str):
    """The value of the promise `expression` in `page`."""
    result = page.call("Runtime.evaluate", expression=expression, awaitPromise=True,
                       returnByValue=True)
    return result["result"]["value"]


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium")
def test_a_rebound_page_in_a_browser_reads_nothing(tmp_path, monkeypatch):
    """DNS rebinding in a real browser: a page of http://evil.test:<port>, its name now
    resolving to 127.0.0.1, fetches /status and tries an admin token as its own site.
    Before, it read the worker's status and its guess reached the token check."""
    node = FakeNode()
    browser = tmp_path / "chromium"
    browser.write_text(f'#!/bin/sh\nexec {CHROMIUM} "--host-resolver-rules=MAP {REBOUND} '
                       f'127.0.0.1" "$@"\n')
    browser.chmod(0o755)
    monkeypatch.setattr(test_dashboard, "CHROMIUM", str(browser))
    profile = tmp_path / "profile"
    profile.mkdir()
    with asgi_server(create_app(node, TOKEN)) as port:
        page = Page(profile)
        try:
            page.call("Page.enable")
            page.call("Page.navigate", url=f"http://{REBOUND}:{port}/health")
            deadline = time.monotonic() + 30
            while page.evaluate("location.host") != f"{REBOUND}:{port}":
                assert time.monotonic() < deadline, "the page did not load"
                time.sleep(0.1)
            read = _awaited(page, "fetch('/status').then(async r => r.status + ' ' + "
                                  "await r.text())")
            stop = _awaited(page, f"fetch('/admin/stop', {{method: 'POST', headers: "
                                  f"{{Authorization: 'Bearer {TOKEN}'}}}}).then(r => r.status)")
        finally:
            page.close()
    assert read.startswith("403 ") and node.status()["address"] not in read, read
    assert stop == 403 and not node.stopped


def test_an_admin_token_with_non_ascii_characters_opens_the_admin_routes():
    """The token file is UTF-8 text and curl sends what was typed as UTF-8; the header
    arrives decoded as Latin-1, and before, its re-encoding to UTF-8 never matched: the
    right token was refused. Wrong tokens still are."""
    token = "pässwört-ключ"
    node = FakeNode()
    with asgi_server(create_app(node, token)) as port:
        url = f"http://127.0.0.1:{port}/admin/stop"
        for wrong in ("passwort-ключ", "pässwört-ключ2", "pässwört", token.upper()):
            response = httpx.post(url, headers={"Authorization": f"Bearer {wrong}".encode()})
            assert response.status_code == 403, wrong
        assert not node.stopped
        response = httpx.post(url, headers={"Authorization": f"Bearer {token}".encode()})
        assert response.status_code == 200 and node.stopped


def test_no_answer_may_be_framed_or_sniffed():
    """Every answer (the dashboard, JSON, metrics, errors echoing the request, refusals)
    forbids framing by other sites and MIME sniffing; before, none did."""
    with asgi_server(create_app(FakeNode(), TOKEN)) as port:
        url = f"http://127.0.0.1:{port}"
        answers = [httpx.get(url + path) for path in
                   ("/", "/status", "/metrics", "/openapi.json", "/nothing",
                    "/blocks?count=<b>x</b>")]
        answers.append(httpx.post(url + "/admin/stop"))
        answers.append(httpx.get(url + "/status", headers={"Host": REBOUND}))
    assert [a.status_code for a in answers] == [200, 200, 200, 200, 404, 422, 403, 403]
    for answer in answers:
        assert answer.headers["x-content-type-options"] == "nosniff", answer.url
        assert answer.headers["x-frame-options"] == "DENY", answer.url
