"""Worker and client keys: an encrypted eth-account keystore (Web3 secret storage v3).

The password comes from a file (`--password-file`) or the environment
(`NEEDLE_NET_PASSWORD`); it is never taken on the command line, where it would
land in shell history and process listings.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eth_account import Account
from eth_account.signers.local import LocalAccount

PASSWORD_ENV = "NEEDLE_NET_PASSWORD"


class KeystoreError(Exception):
    """A keystore that cannot be read, decrypted or written."""


def read_password(password_file: Path | None = None) -> str:
    """The keystore password: from `password_file` if given, else `$NEEDLE_NET_PASSWORD`."""
    if password_file is not None:
        try:
            return Path(password_file).read_text().rstrip("\r\n")
        except OSError as err:
            raise KeystoreError(f"cannot read password file {password_file}: {err}") from err
    password = os.environ.get(PASSWORD_ENV)
    if password is None:
        raise KeystoreError(f"no keystore password: pass --password-file or set ${PASSWORD_ENV}")
    return password


def save_keystore(
    account: LocalAccount, path: Path, password: str, iterations: int | None = None
) -> None:
    """Encrypt `account` to `path` (mode 0600, written atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keyfile = Account.encrypt(account.key, password, kdf="pbkdf2", iterations=iterations)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(keyfile, f)
    os.replace(tmp, path)


def read_keyfile(path: Path) -> dict:
    """A keystore file's JSON object (not decrypted); KeystoreError naming what is wrong."""
    try:
        keyfile = json.loads(Path(path).read_bytes())
    except OSError as err:
        raise KeystoreError(f"cannot read keystore {path}: {err.strerror or err}") from err
    except ValueError as err:  # also a binary file: UnicodeDecodeError
        raise KeystoreError(f"{path} is not a keystore JSON file") from err
    if not isinstance(keyfile, dict):
        raise KeystoreError(f"{path} is not a keystore: a JSON object was expected, found "
                            f"{type(keyfile).__name__}")
    return keyfile


def load_keystore(path: Path, password: str) -> LocalAccount:
    """The account in an encrypted keystore; KeystoreError if it cannot be read or opened."""
    keyfile = read_keyfile(path)
    try:
        return Account.from_key(Account.decrypt(keyfile, password))
    except (KeyError, TypeError) as err:
        raise KeystoreError(f"{path} is not an encrypted keystore (Web3 secret storage v3): "
                            f"missing or malformed {err}") from err
    except ValueError as err:
        raise KeystoreError(
            f"cannot decrypt keystore {path}: wrong password or corrupt file"
        ) from err


def load_or_create(path: Path, password: str, iterations: int | None = None) -> LocalAccount:
    """The account in `path`, creating a fresh random one there on first start."""
    if Path(path).exists():
        return load_keystore(path, password)
    if not password:
        raise KeystoreError(f"refusing to create keystore {path} with an empty password")
    account = Account.create()
    save_keystore(account, path, password, iterations)
    return account
