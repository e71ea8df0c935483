"""The needle-net CLI: every command has help text with an example, and the test-only
worker flags are refused without the opt-in environment variable."""

import pytest
from typer.testing import CliRunner

from node.cli import app

COMMANDS = [
    ["devnet", "up"], ["worker", "up"], ["submit"], ["jobs"], ["balance"], ["keys", "new"],
    ["stake"], ["withdraw"], ["demo"], ["send"], ["keys", "show"], ["cancel"], ["fetch"],
]
runner = CliRunner()


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help_with_an_example(command):
    result = runner.invoke(app, [*command, "--help"], terminal_width=120)
    assert result.exit_code == 0, result.output
    assert "Example" in result.output and "needle-net " + command[0] in result.output


def test_chain_app_is_mounted():
    result = runner.invoke(app, ["chain", "--help"])
    assert result.exit_code == 0 and "up" in result.output and "accounts" in result.output


def test_keys_new_creates_a_keystore_and_refuses_to_overwrite(tmp_path):
    path = tmp_path / "k.json"
    pw = tmp_path / "pw"
    pw.write_text("secret")
    first = runner.invoke(app, ["keys", "new", str(path), "--password-file", str(pw)])
    assert first.exit_code == 0 and path.exists()
    again = runner.invoke(app, ["keys", "new", str(path), "--password-file", str(pw)])
    assert again.exit_code == 1 and "refusing to overwrite" in again.output


def test_cheating_flags_need_the_opt_in(tmp_path, monkeypatch):
    monkeypatch.delenv("NEEDLE_NET_ALLOW_CHEAT", raising=False)
    monkeypatch.setenv("NEEDLE_NET_PASSWORD", "pw")
    for flag in (["--corrupt-results"], ["--stall-after-claim", "5"]):
        result = runner.invoke(app, ["worker", "up", "--data-dir", str(tmp_path), *flag,
                                     "--rpc-url", "http://127.0.0.1:9"])
        assert result.exit_code == 1 and "NEEDLE_NET_ALLOW_CHEAT=1" in result.output
