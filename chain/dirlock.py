"""One process per directory: an exclusive flock on a file inside it that records the
holder's pid (the kernel drops the lock when the process dies, so a crash leaves none). And
the directory fsync that makes a rename or a new name in it durable."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import TextIO


class DirLocked(Exception):
    """Another process holds the directory's lock; `holder` is its pid as it recorded it."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"locked by pid {holder}")
        self.holder = holder


def lock_dir(directory: Path, lock_name: str) -> TextIO:
    """Lock `directory` for this process until the returned file is closed; DirLocked at
    once if another process holds it."""
    lock = open(directory / lock_name, "a+")  # noqa: SIM115 - held until the caller closes it
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise DirLocked(holder) from None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


class DirUnusable(Exception):
    """A data dir another process holds, or one that cannot be created or locked."""


def claim_data_dir(data_dir: Path, lock_name: str, user: str) -> TextIO:
    """Create `data_dir` if needed and lock it (`lock_dir`); DirUnusable naming the other
    `user` (a chain node, a worker, a devnet) and its pid, or why the dir cannot be used."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        return lock_dir(data_dir, lock_name)
    except DirLocked as exc:
        raise DirUnusable(f"data dir {data_dir} is in use by another {user} (pid "
                          f"{exc.holder}); stop it or pick another data dir") from None
    except OSError as exc:
        raise DirUnusable(f"cannot use data dir {data_dir}: {exc.strerror}") from exc


def sync_directory(directory: str | os.PathLike) -> None:
    """Make the names created or renamed in `directory` survive a power loss (an fsync of the
    file alone does not persist its directory entry)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
