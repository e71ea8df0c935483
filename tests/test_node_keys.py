"""Worker keystores: encrypted round trip, wrong passwords, password sources."""

import stat

import pytest
from eth_account import Account

from node import keys


def test_keystore_round_trip_and_signing(tmp_path):
    path = tmp_path / "w" / "key.json"
    created = keys.load_or_create(path, "correct horse", iterations=2048)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert created.key.hex() not in path.read_text()  # the private key is not stored in clear
    loaded = keys.load_or_create(path, "correct horse")
    assert loaded.address == created.address
    message_hash = b"\x11" * 32
    signature = loaded.unsafe_sign_hash(message_hash)
    assert Account._recover_hash(message_hash, signature=signature.signature) == created.address


def test_wrong_password_and_corrupt_file_are_clear_errors(tmp_path):
    path = tmp_path / "key.json"
    keys.load_or_create(path, "right", iterations=2048)
    with pytest.raises(keys.KeystoreError, match="wrong password"):
        keys.load_keystore(path, "wrong")
    path.write_text("{not json")
    with pytest.raises(keys.KeystoreError, match="cannot read keystore"):
        keys.load_keystore(path, "right")


def test_password_from_file_then_env(tmp_path, monkeypatch):
    monkeypatch.delenv(keys.PASSWORD_ENV, raising=False)
    with pytest.raises(keys.KeystoreError, match="no keystore password"):
        keys.read_password(None)
    monkeypatch.setenv(keys.PASSWORD_ENV, "from-env")
    assert keys.read_password(None) == "from-env"
    pw = tmp_path / "pw"
    pw.write_text("from-file\n")
    assert keys.read_password(pw) == "from-file"
    with pytest.raises(keys.KeystoreError, match="cannot read password file"):
        keys.read_password(tmp_path / "missing")
