"""The output files of one dataset: append-only JSONL, fsynced before anything is acknowledged.

Their names (RAW, ERRORS) are in genq/schema.py, since export and verify read the same files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

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


class Unreadable(Exception):
    """A file that does not hold what its checkpoint says: a line past it that is not one."""


class Foreign(OSError):
    """A file that is not as this collector left it: removed, replaced, or grown by another
    writer (a collector that lost its lease and appended late)."""

    def __init__(self, path: Path, why: str):
        super().__init__(why)
        self.path = path


def scan(path: Path, offset: int = 0) -> Iterator[tuple[int, int, dict]]:
    """Parsed lines from byte ``offset`` on: (start, end, object) of each; Unreadable at a line
    that is not a JSON object (``offset`` not at a line's start, or bytes another wrote)."""
    if not path.exists():
        return
    with path.open("rb") as fh:
        fh.seek(offset)
        pos = offset
        for line in fh:
            start, pos = pos, pos + len(line)
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise Unreadable(f"{path}: byte {start} does not start a JSON line ({exc})") from None
            if not isinstance(obj, dict):
                raise Unreadable(f"{path}: the line at byte {start} is not a JSON object")
            yield start, pos, obj


def rewrite_tail(path: Path, offset: int, keep: list[tuple[int, int]]) -> int:
    """Make the file its bytes up to ``offset`` followed by the ranges ``keep`` (each past
    ``offset``, in order), in a copy renamed over it: a crash leaves the old file or the new one,
    never half of each. Returns the new size."""
    tmp = path.with_name(path.name + ".rewrite")
    with path.open("rb") as src, tmp.open("wb") as dst:
        left = offset
        while left:
            block = src.read(min(left, 1 << 20))
            if not block:
                break
            dst.write(block)
            left -= len(block)
        for start, end in keep:
            src.seek(start)
            dst.write(src.read(end - start))
        dst.flush()
        os.fsync(dst.fileno())
        size = dst.tell()
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return size


class Appender:
    """An open output file, written only by the holder of its dataset's lease. ``append`` buffers;
    ``sync`` writes the buffer in one write, fsyncs and reads it back.

    The size it answers is never ``tell()`` of a file another process may append to (an old lease
    holder that resumes late, or another NFS client): it is the checkpoint it opened at plus the
    bytes it wrote and read back where it wrote them. A file that is not that size, or no longer
    the file at its path, is ``Foreign``: its dataset is reconciled before anything is committed.
    """

    def __init__(self, path: Path, size: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        if new:
            _fsync_dir(path.parent)
        self._buf = bytearray()
        self.synced_size = size
        why = self.changed()
        if why is not None:
            os.close(self._fd)
            raise Foreign(path, why)

    def append(self, obj: dict) -> None:
        self.append_bytes(orjson.dumps(obj) + b"\n")

    def append_bytes(self, data: bytes) -> None:
        self._buf += data

    def changed(self) -> str | None:
        """Why the file is not as this collector left it (removed, replaced, grown or shrunk by
        someone else), or None."""
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            return f"{self.path} was removed while open"
        mine = os.fstat(self._fd)
        if (at_path.st_dev, at_path.st_ino) != (mine.st_dev, mine.st_ino):
            return f"{self.path} was replaced while open"
        if mine.st_size != self.synced_size:
            return f"{self.path} is {mine.st_size} bytes, not the {self.synced_size} this collector verified"
        return None

    def sync(self) -> int:
        """Write, fsync and read back; return the verified size (the offset safe to checkpoint).
        Bytes of another writer before, among or after this batch's raise ``Foreign``."""
        if self._buf:
            data, start = bytes(self._buf), self.synced_size
            view = memoryview(data)
            while view:  # one write on a local disk; a short write goes on where it stopped
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
            self._buf.clear()
            size = os.fstat(self._fd).st_size
            if size != start + len(data) or os.pread(self._fd, len(data), start) != data:
                raise Foreign(
                    self.path, f"{self.path}: another process wrote to it while this batch was written"
                )
            self.synced_size = size
        return self.synced_size

    def roll_back(self, size: int | None = None) -> None:
        """After a failed write: drop what was not synced (or everything past ``size``), so no half
        line, and no frame of a record that is not on disk, stays behind."""
        self._buf.clear()
        self.synced_size = self.synced_size if size is None else min(size, self.synced_size)
        os.truncate(self.path, self.synced_size)

    def close(self) -> None:
        os.close(self._fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
