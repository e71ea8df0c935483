"""Worker and client keys: an encrypted eth-account keystore (Web3 secret storage v3).

The password comes from a file (`--password-file`) or the environment
(`NEEDLE_NET_PASSWORD`); it is never taken on the command line, where it would
land in shell history and process listings.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eth_account import Account
from eth_account.signers.local import LocalAccount

from chain.dirlock import sync_directory

PASSWORD_ENV = "NEEDLE_NET_PASSWORD"
# key derivation work a keystore may ask for: a crafted file must not hang the command (Ctrl-C
# cannot stop hashlib's loop); eth-account writes 2^18 pbkdf2 iterations or scrypt n = 2^18
MAX_KDF_WORK = {"pbkdf2": ("c", 10**7), "scrypt": ("n", 1 << 20)}


class KeystoreError(Exception):
    """A keystore that cannot be read, decrypted or written."""


def read_password(password_file: Path | None = None) -> str:
    """The keystore password: from `password_file` if given, else `$NEEDLE_NET_PASSWORD`.
    The file is read as UTF-8 whatever the locale, so one password file opens the same
    keystore on every machine."""
    if password_file is not None:
        try:
            return Path(password_file).read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as err:
            raise KeystoreError(f"cannot read password file {password_file}: {err}") from err
        except UnicodeDecodeError as err:
            raise KeystoreError(f"password file {password_file} is not UTF-8 text ({err.reason} "
                                f"at byte {err.start}): save the password as UTF-8") from err
    password = os.environ.get(PASSWORD_ENV)
    if password is None:
        raise KeystoreError(f"no keystore password: pass --password-file or set ${PASSWORD_ENV}")
    return password


def save_keystore(
    account: LocalAccount, path: Path, password: str, iterations: int | None = None
) -> None:
    """Encrypt `account` to `path`, replacing any file there: mode 0600, written atomically
    and durably (KeystoreError naming the file if it cannot be written)."""
    path = Path(path)
    with _writing(path):
        tmp = _private_temp(path, _encrypted(account, password, iterations))
        try:
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        sync_directory(path.parent)


def _create_keystore(
    account: LocalAccount, path: Path, password: str, iterations: int | None
) -> bool:
    """Encrypt `account` to `path` unless a file is there already (False): the complete file
    appears under its name at once, and of two processes creating the same keystore only
    one succeeds (else one would run, and stake, with a key the other's file replaced)."""
    with _writing(path):
        tmp = _private_temp(path, _encrypted(account, password, iterations))
        try:
            os.link(tmp, path)  # unlike a rename, fails if path exists
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        sync_directory(path.parent)
        return True


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as err:
        raise KeystoreError(f"cannot write keystore {path}: {err.strerror or err}") from err


def _encrypted(account: LocalAccount, password: str, iterations: int | None) -> bytes:
    keyfile = Account.encrypt(account.key, password, kdf="pbkdf2", iterations=iterations)
    return json.dumps(keyfile).encode()


def _private_temp(path: Path, data: bytes) -> str:
    """A new file beside `path` holding `data`, on disk: mode 0600 from its creation whatever
    the umask (mkstemp), under a fresh name (a file left there before, perhaps readable by
    others, is never written into)."""
    for folder in (path.parent, *path.parent.parents):  # mkdir would say "File exists"
        if folder.exists():
            if not folder.is_dir():
                raise KeystoreError(f"cannot write keystore {path}: {folder} is not a directory")
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # else a power loss soon after could leave an empty key file
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


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
    crypto = keyfile.get("crypto", keyfile.get("Crypto"))
    if isinstance(crypto, dict) and isinstance(crypto.get("kdfparams"), dict):
        name, most = MAX_KDF_WORK.get(crypto.get("kdf"), (None, 0))
        work = crypto["kdfparams"].get(name)
        if isinstance(work, int) and work > most:
            raise KeystoreError(f"cannot decrypt keystore {path}: its {crypto['kdf']} {name} = "
                                f"{work} is above {most}, more work than a keystore needs")
    try:
        account = Account.from_key(Account.decrypt(keyfile, password))
    except NotImplementedError as err:  # eth-keyfile's answer to versions 1 and 2
        raise KeystoreError(f"{path} is a keystore of version {keyfile.get('version')!r}, "
                            "not Web3 secret storage v3") from err
    except (KeyError, TypeError) as err:
        raise KeystoreError(f"{path} is not an encrypted keystore (Web3 secret storage v3): "
                            f"missing or malformed {err}") from err
    except OverflowError as err:  # hashlib's answer to an iteration count or key length
        raise KeystoreError(f"cannot decrypt keystore {path}: its key derivation parameters "
                            f"are out of range ({err})") from err
    except ValueError as err:
        raise KeystoreError(
            f"cannot decrypt keystore {path}: wrong password or corrupt file"
        ) from err
    stated = keyfile.get("address")
    if stated is not None and str(stated).lower().removeprefix("0x") != account.address[2:].lower():
        raise KeystoreError(f"keystore {path} names address {stated}, but its key is "
                            f"{account.address}'s: the file was edited or mixed up")
    return account


def load_or_create(path: Path, password: str, iterations: int | None = None) -> LocalAccount:
    """The account in `path`, creating a fresh random one there on first start. A file that
    is there (even a broken link, or one another process created meanwhile) is only ever
    opened, never replaced: it may hold a staked account's key."""
    path = Path(path)
    if os.path.lexists(path):
        return load_keystore(path, password)
    if not password:
        raise KeystoreError(f"refusing to create keystore {path} with an empty password")
    account = Account.create()
    if _create_keystore(account, path, password, iterations):
        return account
    return load_keystore(path, password)
