"""Session 32's review of the CLI and keys: a keystore whose address field is not its key's,
one asking for unbounded key-derivation work, node URLs with a port past 65535 or a query,
an output that is a device or pipe, and Ctrl-C while the command's modules load."""
import json
import os
import subprocess
import sys

import pytest
from helpers import one_error_line, run_cli

from chain.devnet import dev_account
from node import keys

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def keystore(tmp_path):
    path = tmp_path / "key.json"
    keys.save_keystore(dev_account(3), path, "pw", iterations=2048)
    return path


def _edited(keystore, edit) -> str:
    """The KeystoreError's message for `keystore` once `edit` changed its JSON."""
    keyfile = json.loads(keystore.read_text())
    edit(keyfile)
    keystore.write_text(json.dumps(keyfile))
    with pytest.raises(keys.KeystoreError) as raised:
        keys.load_keystore(keystore, "pw")
    return str(raised.value)


def test_a_keystore_naming_another_address_is_refused(keystore):
    """Its address field edited to another account's: `balance --keystore` would show that
    account while every transaction is signed by the key's own."""
    assert keys.load_keystore(keystore, "pw").address == dev_account(3).address
    other = dev_account(0).address[2:].lower()
    assert _edited(keystore, lambda keyfile: keyfile.update(address=other)) == (
        f"keystore {keystore} names address {other}, but its key is "
        f"{dev_account(3).address}'s: the file was edited or mixed up")
    keyfile = json.loads(keystore.read_text())
    del keyfile["address"]  # no address to check against: the key is the account
    keystore.write_text(json.dumps(keyfile))
    assert keys.load_keystore(keystore, "pw").address == dev_account(3).address


@pytest.mark.parametrize("kdf, name, work", [("pbkdf2", "c", 2**31 - 1),
                                             ("scrypt", "n", 1 << 30)])
def test_a_keystore_asking_for_unbounded_key_derivation_is_refused_at_once(keystore, kdf,
                                                                           name, work):
    """pbkdf2 with 2^31 - 1 iterations ran for minutes and ignored Ctrl-C (hashlib's loop)."""
    def ask_for_work(keyfile):
        keyfile["crypto"]["kdf"] = kdf
        keyfile["crypto"]["kdfparams"][name] = work
    assert _edited(keystore, ask_for_work) == (
        f"cannot decrypt keystore {keystore}: its {kdf} {name} = {work} is above "
        f"{keys.MAX_KDF_WORK[kdf][1]}, more work than a keystore needs")


@pytest.mark.parametrize("url, reason", [
    ("http://127.0.0.1:112756", "Port out of range 0-65535"),
    ("http://127.0.0.1:8545?key=1", "a query or fragment cannot precede the node's paths "
                                    "(/info, /rpc, /blobs)"),
    ("http://127.0.0.1:8545/#top", "a query or fragment cannot precede the node's paths "
                                   "(/info, /rpc, /blobs)"),
])
@pytest.mark.parametrize("command", [["jobs"], ["balance", "0x" + "12" * 20]])
def test_node_urls_that_cannot_name_a_node_are_refused_before_any_request(url, reason,
                                                                          command):
    """httpx wrapped port 112756 around to 47220 (another node was asked) and a later layer
    raised a traceback; /info was appended after a query string."""
    line = one_error_line(run_cli(*command, "--rpc-url", url))
    shown = url.replace("?key=1", "?***").replace("#top", "#***")  # a query may hold a key
    assert line == f"error: not a chain node URL: {shown}: {reason}"


def test_client_error_lines_leave_url_credentials_out():
    """`worker up` redacted its URL, but client commands printed user:password@ and query
    keys in their error lines; the path stays, since it tells which URL answered."""
    url = "http://user:secretpw@127.0.0.1:9/base"
    line = one_error_line(run_cli("jobs", "--rpc-url", url))
    assert "secretpw" not in line and "user" not in line
    assert line.startswith("error: cannot reach the chain node at http://***@127.0.0.1:9/base/info")


@pytest.mark.parametrize("force", [False, True])
def test_an_output_that_is_a_pipe_is_not_replaced(tmp_path, force):
    """`fetch -o FIFO --force` put a regular file in the pipe's place (as root, -o /dev/null
    would replace the device)."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    line = one_error_line(run_cli("fetch", "0", "-o", fifo, *(["--force"] if force else []),
                                  "--rpc-url", "http://127.0.0.1:9"))
    assert line == f"error: output {fifo} is not a regular file (a device, pipe or socket); " \
                   "not replaced"
    assert fifo.is_fifo()


def test_ctrl_c_while_the_command_loads_exits_130_without_a_traceback():
    """A Ctrl-C in the first second or two (while node.cli's imports load) printed a
    traceback; here the interrupt arrives exactly at that import."""
    code = ("import sys\n"
            "class Interrupt:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'node.cli':\n"
            "            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "from node.__main__ import main\n"
            "main()\n")
    proc = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 130 and proc.stderr == "" and proc.stdout == ""
    help_text = subprocess.run([sys.executable, "-m", "node", "--help"], capture_output=True,
                               text=True, timeout=60)
    assert help_text.returncode == 0 and "Usage: needle-net" in help_text.stdout


def test_keys_new_names_a_file_in_the_path_and_a_link_to_nothing(tmp_path, monkeypatch):
    """`keys new a.npy/k.json` (a.npy a file) said "File exists"; over a link to nothing it
    said "cannot read keystore", on a command that creates one."""
    monkeypatch.setenv(keys.PASSWORD_ENV, "pw")
    (tmp_path / "a.npy").write_bytes(b"x")
    inside_a_file = tmp_path / "a.npy" / "k.json"
    line = one_error_line(run_cli("keys", "new", inside_a_file))
    assert line == f"error: cannot write keystore {inside_a_file}: {tmp_path / 'a.npy'} is " \
                   "not a directory"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere")
    line = one_error_line(run_cli("keys", "new", dangling))
    assert line == f"error: {dangling} exists (a link to nothing); refusing to overwrite a key"
    assert not (tmp_path / "nowhere").exists()
    made = run_cli("keys", "new", tmp_path / "new" / "k.json")
    assert made.exit_code == 0 and keys.load_keystore(tmp_path / "new" / "k.json", "pw")


@pytest.mark.parametrize("flag", ["--log", "--save", "--plot"])
def test_train_refuses_an_output_folder_it_cannot_write_before_training(flag, capsys):
    """A read-only folder for --log, --save or --plot was found only after the first epoch
    (proc, where no file can be made, stands in for a read-only mount)."""
    from needle import train

    with pytest.raises(SystemExit) as raised:
        train.parse_args([flag, "/proc/needle-train-output"])
    assert raised.value.code == 2
    assert f"error: {flag}: cannot write in folder /proc: " in capsys.readouterr().err


def _free_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (checked by binding both)."""
    import socket

    from chain.launch import free_port

    for _ in range(50):
        port = free_port()
        if port >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two adjacent free ports")


def test_devnet_workers_take_the_api_ports_asked_for(tmp_path):
    """`devnet up` gave its workers random API ports (an operator could not publish or
    bookmark them); `--worker-api-port P` gives worker i port P + i, checked free first."""
    import httpx

    from node.devnet import Devnet

    base = _free_pair()
    with Devnet(tmp_path / "net", port=0, block_time=0.2, worker_api_port=base) as net:
        net.start(2)
        assert [w.api_url for w in net.workers] == [f"http://127.0.0.1:{base}",
                                                  f"http://127.0.0.1:{base + 1}"]
        for worker in net.workers:
            status = httpx.get(f"{worker.api_url}/status", timeout=5).json()
            assert status["address"] == worker.address


def test_devnet_names_a_taken_worker_api_port_before_starting_anything(tmp_path):
    import socket

    from node.devnet import Devnet, DevnetError

    base = _free_pair()
    with socket.socket() as held:
        held.bind(("127.0.0.1", base + 1))
        held.listen()
        with Devnet(tmp_path / "net", port=0, worker_api_port=base) as net:
            with pytest.raises(DevnetError) as raised:
                net.start(2)
            assert net.chain is None and net.workers == []  # nothing started
    assert str(raised.value).startswith(f"worker 1 API port {base + 1} is in use")
    with Devnet(tmp_path / "net2", port=0, blob_port=base + 1, worker_api_port=base) as net:
        with pytest.raises(DevnetError) as raised:
            net.start(2)
    assert str(raised.value) == (f"worker 1's API port {base + 1} (the worker API port {base} "
                                 "+ 1) is one of the chain's ports")
    assert "--worker-api-port" in run_cli("devnet", "up", "--help").output
