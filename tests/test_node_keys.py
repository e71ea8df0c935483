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
    with pytest.raises(keys.KeystoreError, match="not a keystore JSON file"):
        keys.load_keystore(path, "right")
    for content, message in (('{"foo": 1}', "not an encrypted keystore"),
                             ("[1, 2]", "JSON object was expected"),
                             ("0x" + "ab" * 32, "not a keystore JSON file")):
        path.write_text(content)
        with pytest.raises(keys.KeystoreError, match=message):
            keys.load_keystore(path, "right")
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(keys.KeystoreError, match="not a keystore JSON file"):
        keys.read_keyfile(path)


def test_a_new_keystore_needs_a_password(tmp_path):
    path = tmp_path / "key.json"
    with pytest.raises(keys.KeystoreError, match="empty password"):
        keys.load_or_create(path, "", iterations=2048)
    assert not path.exists()


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
