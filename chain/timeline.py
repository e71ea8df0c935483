"""Timestamps along a job's path through several processes, for latency work.

With ``NEEDLE_NET_TIMELINE=<file>`` in the environment (or after ``start(file)``), every
``mark(label)`` appends ``<CLOCK_MONOTONIC ns> <pid> <label>`` to that file; processes on
one machine share the clock, so the lines of the client, the chain node and the workers
merge into one timeline (``bench/remote_matmul.py --timeline``). Otherwise ``mark`` only
tests one global.
"""
from __future__ import annotations

import os
import time

_file = None


def start(path: str) -> None:
    """Append this process's marks to `path` (line-buffered: marks of a crash survive)."""
    global _file
    _file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life


def mark(label: str) -> None:
    if _file is not None:
        _file.write(f"{time.monotonic_ns()} {os.getpid()} {label}\n")


def read(path: str) -> list[tuple[int, int, str]]:
    """(ns, pid, label) of every mark in `path`, in time order."""
    with open(path) as f:
        rows = [line.split(" ", 2) for line in f if line.strip()]
    return sorted((int(ns), int(pid), label.strip()) for ns, pid, label in rows)


if os.environ.get("NEEDLE_NET_TIMELINE"):
    start(os.environ["NEEDLE_NET_TIMELINE"])
