"""The pending transactions' journal: every admitted transaction is appended before its hash
is answered, so one acknowledged and not yet sealed survives a crash of the node (a sealed one
is in ``chain.sqlite``). At the next start they are admitted again; those mined meanwhile are
refused there as nonce too low. Compacted to the pool's contents when it outgrows them.

A record is a 4-byte big-endian length and the raw transaction. The appends are plain
writes, not synced: they survive the process's death (SIGKILL, OOM), not the machine's, as
geth's journal of local transactions. A torn last record (the process killed in the write)
is skipped.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

JOURNAL_FILE = "pending.journal"
LENGTH_BYTES = 4
COMPACT_SLACK = 1 << 20  # bytes of sealed transactions the file may hold beyond the pool's


def append_whole(fd: int, data: bytes, size: int) -> None:
    """Append all of data to the file open for appending at fd, `size` bytes long before, or
    none of it: a write the disk cuts short is cut back off, so that no torn record is left
    to hide what is appended after it, or to be written twice by a retry."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        try:
            os.ftruncate(fd, size)
        except OSError as err:
            log.error("cannot cut a torn append off file descriptor %d (%s)", fd, err)
        raise


class PendingJournal:
    """Append-only file of admitted raw transactions, in the order of admission."""

    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / JOURNAL_FILE
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.size = os.fstat(self._fd).st_size

    def read(self) -> list[bytes]:
        """The raw transactions in the file, in order; a torn last record is dropped."""
        data = self.path.read_bytes()
        raws, at = [], 0
        while at + LENGTH_BYTES <= len(data):
            end = at + LENGTH_BYTES + int.from_bytes(data[at:at + LENGTH_BYTES], "big")
            if end > len(data):
                break
            raws.append(data[at + LENGTH_BYTES:end])
            at = end
        if at != len(data):
            log.warning("%s: ignored a torn last record (%d bytes; the node stopped while "
                        "writing it, before answering its hash)", self.path, len(data) - at)
        return raws

    def append(self, raw: bytes) -> None:
        """One record in one write, before the transaction's hash is answered. A write the
        disk cuts short is cut back off: left there, the torn record would swallow every
        record appended after it at the next start, hashes answered included."""
        record = len(raw).to_bytes(LENGTH_BYTES, "big") + raw
        append_whole(self._fd, record, self.size)
        self.size += len(record)

    def outgrew(self, pending_bytes: int) -> bool:
        """Whether the file holds over twice what a compaction would keep (the pool's
        `pending_bytes`) and the slack: rewrites cost the appends at most twice over."""
        return self.size > 2 * pending_bytes + COMPACT_SLACK

    def rewrite(self, raws: list[bytes]) -> None:
        """Replace the file by one holding `raws` (the pool's pending transactions): written
        beside it and renamed over it, so a crash of the process leaves the old file or the
        new one whole (not synced, as the appends)."""
        temporary = self.path.with_name(self.path.name + ".tmp")
        try:
            temporary.write_bytes(b"".join(len(raw).to_bytes(LENGTH_BYTES, "big") + raw
                                           for raw in raws))
            os.replace(temporary, self.path)
        except OSError:
            temporary.unlink(missing_ok=True)
            raise
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        os.close(self._fd)
        self._fd, self.size = fd, os.fstat(fd).st_size

    def close(self) -> None:
        os.close(self._fd)
