"""The output files of one dataset: append-only JSONL, fsynced before anything is acknowledged.

Their names (RAW, ERRORS) are in genq/schema.py, since export and verify read the same files.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import orjson


def cut_torn_tail(path: Path) -> int:
    """Drop a last line that a crash left without its newline; return the bytes dropped."""
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with path.open("rb+") as fh:
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return 0
        # Walk back to the previous newline in blocks.
        pos = size
        keep = 0
        while pos > 0:
            start = max(0, pos - 65536)
            fh.seek(start)
            block = fh.read(pos - start)
            nl = block.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        fh.truncate(keep)
        fh.flush()
        os.fsync(fh.fileno())
    return size - keep


def scan(path: Path, offset: int = 0) -> Iterator[tuple[int, dict]]:
    """Parsed lines from byte ``offset`` on, with the offset just past each line."""
    if not path.exists():
        return
    with path.open("rb") as fh:
        fh.seek(offset)
        pos = offset
        for line in fh:
            pos += len(line)
            if line.strip():
                yield pos, orjson.loads(line)


class Appender:
    """An open output file. ``append`` buffers; ``sync`` makes it durable."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        self.path = path
        self._fh: BinaryIO = path.open("ab")
        if new:
            _fsync_dir(path.parent)
        self.dirty = False
        self.synced_size = self.opened_size = self._fh.tell()

    def append(self, obj: dict) -> None:
        self.append_bytes(orjson.dumps(obj) + b"\n")

    def append_bytes(self, data: bytes) -> None:
        self._fh.write(data)
        self.dirty = True

    def sync(self) -> int:
        """Flush and fsync; return the file's size (the offset now safe to checkpoint)."""
        if self.dirty:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self.dirty = False
            self.synced_size = self._fh.tell()
        return self.synced_size

    def roll_back(self, size: int | None = None) -> None:
        """After a failed write: drop what was not synced (or everything past ``size``), so no half
        line, and no frame of a record that is not on disk, stays behind."""
        with contextlib.suppress(OSError):  # the buffered bytes fail again: they are what we drop
            self._fh.close()
        self.synced_size = self.synced_size if size is None else min(size, self.synced_size)
        with self.path.open("rb+") as fh:
            fh.truncate(self.synced_size)
        self._fh = self.path.open("ab")
        self.dirty = False

    def close(self) -> None:
        self._fh.close()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
