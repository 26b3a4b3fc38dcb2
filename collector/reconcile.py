"""Reconciling a dataset's files with Redis, when a collector takes the dataset over.

Lines past the last checkpoint may be on disk with their ids unmarked (a crash between the fsync
and the commit, or a Redis that lost writes), or be another writer's late copies (an old lease
holder that resumed after a takeover). This module owns re-reading them, once per reason: torn
tails cut, copies of ids already on disk dropped, ids marked and token counts added a chunk at a
time with the checkpoint move, and only the frames of the records just marked kept, one each. A
file missing or shorter than its checkpoint is re-read from its start (a missing logprobs.bin is
started afresh); one whose lines are not results of the dataset is Unreadable.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import redis

from genq import token_counts
from genq.bitmaps import is_set, set_bits
from genq.collector.checkpoint import Checkpoints, Commands, Stale, mark
from genq.collector.files import Unreadable, cut_torn_tail, rewrite_tail, scan
from genq.collector.leases import Leases
from genq.keys import Keys
from genq.logprobs import FILE as LOGPROBS
from genq.logprobs import frames as logprobs_frames
from genq.schema import (
    ERRORS,
    KIND_ERROR,
    KIND_RECORD,
    RAW,
    REJECTED_SAMPLES,
    bit_index,
    extends,
    parse_record_id,
    rejudged,
)

log = logging.getLogger("genq.collector")

RECONCILE_CHUNK = 3000  # lines marked per checkpoint move when files are re-read
RECONCILE_TRIES = 5  # re-reads of a dataset restarted because Redis lost writes meanwhile


class Reconciler:
    """Re-reads the files of one dataset past their checkpoints into Redis.

    It writes too (torn tails, checkpoints, bits), so it fences first with the collector's
    ``leases``; ``samples`` and ``close_file`` are the Collector's (dataset settings, open files).
    """

    def __init__(
        self,
        conn: redis.Redis,
        keys: Keys,
        out: Path,
        checkpoints: Checkpoints,
        leases: Leases,
        samples: Callable[[str], int],
        close_file: Callable[[str, str], None],
    ) -> None:
        self.conn = conn
        self.keys = keys
        self.out = out
        self.checkpoints = checkpoints
        self.leases = leases
        self.samples = samples
        self.close_file = close_file

    def dataset(self, name: str) -> dict[str, int]:
        """Reconcile the files of ``name`` with Redis, once: the checkpoint of each file after
        (what this collector verified). A file missing, or shorter than its checkpoint, is
        re-read from its start; one that cannot be read as lines of this dataset is Unreadable
        (the caller sets the dataset aside)."""
        # Reconciling writes too (torn tails cut, duplicates dropped, checkpoints, done bits, token
        # counts): a collector that was cut off must know it still holds the folder before it
        # touches any of it (the caller asked Redis too: leases.confirm).
        self.leases.fence([name])
        for tries in range(RECONCILE_TRIES):
            try:
                sizes: dict[str, int] = {}
                marked: set[int] = set()
                for kind, filename in (
                    (KIND_ERROR, ERRORS),
                    (KIND_RECORD, RAW),
                    (KIND_RECORD, REJECTED_SAMPLES),
                ):
                    path = self.out / name / filename
                    cut = cut_torn_tail(path)
                    if cut:
                        log.warning(
                            "%s: cut a torn last line (%d bytes) left by a crash",
                            path,
                            cut,
                            extra={"dataset": name},
                        )
                    sizes[str(path)], in_file = self._file(name, kind, path)
                    if kind == KIND_RECORD:  # records and rejected samples: both have frames
                        marked |= in_file
                sizes[str(self.out / name / LOGPROBS)] = self._logprobs(name, marked)
                return sizes
            except Stale:
                if tries + 1 == RECONCILE_TRIES:
                    raise
                log.warning("Redis lost writes while %s was re-read: reading it again", name)
        raise AssertionError("unreachable")

    def _logprobs(self, name: str, marked: set[int]) -> int:
        """Keep the frames past the checkpoint whose record the lines past it hold (marked just
        above), one per record; drop the others: their batch never reached the records file (they
        are replayed), or another writer's copy of one. A missing file is started afresh."""
        path = self.out / name / LOGPROBS
        field = str(path)
        (stored,) = self.checkpoints.read([field])
        if not path.exists():
            if stored:
                log.warning(
                    "%s is missing while its checkpoint is at %d bytes: the frames of the records "
                    "written before it went are lost; later frames go to a new file",
                    path,
                    stored,
                    extra={"dataset": name},
                )
                self.checkpoints.commit({field: (stored, 0)}, fenced=[name])
            return 0
        size = path.stat().st_size
        tail = stored <= size
        offset = stored if tail else 0
        if not tail:
            log.warning(
                "%s is shorter than its checkpoint: re-checking all of it", path, extra={"dataset": name}
            )
        done = self.conn.get(self.keys.done(name)) or b""
        samples = self.samples(name)
        keep: list[tuple[int, int]] = []
        seen: set[int] = set()
        for start, end, record_id, _ in logprobs_frames(path, offset):
            parsed = parse_record_id(record_id, name, samples)
            index = bit_index(*parsed, samples) if parsed is not None else None
            if index is not None and index not in seen and (index in marked if tail else is_set(done, index)):
                seen.add(index)
                keep.append((start, end))
        new = self._cut(name, path, offset, keep, size)
        if new < size:
            log.warning(
                "%s: dropped %d bytes of frames whose records are not on disk past the checkpoint "
                "(they are replayed), or are there twice",
                path,
                size - new,
                extra={"dataset": name},
            )
        self.checkpoints.commit({field: (stored, new)}, fenced=[name])
        return new

    def _cut(self, name: str, path: Path, offset: int, keep: list[tuple[int, int]], size: int) -> int:
        """Leave the file its bytes up to ``offset`` and then ``keep``: a truncation when they
        follow on from ``offset``, else a rewrite (collector/files.py); the new size."""
        contiguous = all(a[1] == b[0] for a, b in zip(keep, keep[1:], strict=False))
        if (not keep or (keep[0][0] == offset and contiguous)) and (keep[-1][1] if keep else offset) == size:
            return size
        self.close_file(name, path.name)
        if not keep or (keep[0][0] == offset and contiguous):
            new = keep[-1][1] if keep else offset
            with path.open("rb+") as fh:
                fh.truncate(new)
                os.fsync(fh.fileno())
            return new
        return rewrite_tail(path, offset, keep)

    def _file(self, name: str, kind: bytes, path: Path) -> tuple[int, set[int]]:
        """Mark the ids of the lines past the checkpoint, moving it a chunk at a time: each chunk's
        marks and token counts land with its checkpoint move, or (Stale) not at all. Lines past
        the checkpoint whose id is on disk already (before it, or earlier past it) are dropped
        first: another writer's late copies. The checkpoint after, and the ids marked."""
        field = str(path)
        size = path.stat().st_size if path.exists() else 0
        (stored,) = self.checkpoints.read([field])
        offset = stored
        tail = offset <= size
        if not tail:
            log.warning(
                "%s is shorter than its checkpoint: re-reading all of it", path, extra={"dataset": name}
            )
            offset = 0
        samples = self.samples(name)
        # Records whose done bit is still 0 get their tokens counted, with the chunk that sets the
        # bit: a crash between chunks leaves each chunk counted once or not at all.
        done = self.conn.get(self.keys.done(name)) or b""
        if tail:
            size = self._drop_copies(name, kind, path, offset, size, done)
        live = self.conn.hexists(self.keys.tokens(name), "first_at")
        # Extensions (genq retry --truncated) whose extending bit is still set: counted, and cleared.
        extending = self.conn.get(self.keys.extending(name)) or b""
        uncounted: list[dict] = []
        counted: set[int] = set()
        seen: set[int] = set()
        indexes: list[int] = []
        extended: list[int] = []

        def body(commands: Commands) -> None:
            mark(commands, self.keys, name, kind, indexes)
            set_bits(commands, self.keys.extending(name), extended, 0)
            token_counts.add(commands, self.keys, name, uncounted, None, live)

        for start, end, obj in scan(path, offset):
            index = _index(path, start, obj, name, samples)
            indexes.append(index)
            if kind == KIND_RECORD and extends(obj) is not None:
                if index in counted or is_set(extending, index):
                    uncounted.append(obj)
                    extended.append(index)
            elif kind == KIND_RECORD and rejudged(obj) is not None:  # its tokens were counted before
                if is_set(extending, index):
                    extended.append(index)
            elif kind == KIND_RECORD and not is_set(done, index) and index not in seen:
                uncounted.append(obj)
                counted.add(index)
            seen.add(index)
            if len(indexes) >= RECONCILE_CHUNK:
                self.checkpoints.commit({field: (stored, end)}, body, fenced=[name])
                stored, indexes, uncounted, extended = end, [], [], []
        self.checkpoints.commit({field: (stored, size)}, body, fenced=[name])
        if seen:
            log.info(
                "%s: marked %d ids found on disk past the checkpoint",
                path,
                len(seen),
                extra={"dataset": name},
            )
        return size, seen

    def _drop_copies(self, name: str, kind: bytes, path: Path, offset: int, size: int, done: bytes) -> int:
        """Drop the lines past the checkpoint that are byte for byte a line before them: the
        writer never appends an id already on disk (decision 4), so such a copy is another
        process's (an old lease holder that resumed late with the same batch). Only lines whose id
        is marked, or repeats past the checkpoint, are looked for, so the common case reads
        nothing more; a lost checkpoint (every line past it) drops nothing that is not a copy.
        The file's new size."""
        if offset >= size:
            return size
        failed = (self.conn.get(self.keys.failed(name)) or b"") if kind == KIND_ERROR else b""
        samples = self.samples(name)
        digests = {start: line for start, _, line in _lines(path, offset, size)}
        tail: list[tuple[int, int, bytes]] = []
        suspects: set[bytes] = set()
        seen: set[int] = set()
        for start, end, obj in scan(path, offset):
            index = _index(path, start, obj, name, samples)
            line = digests[start]
            if index in seen or is_set(done, index) or is_set(failed, index):
                suspects.add(line)
            seen.add(index)
            tail.append((start, end, line))
        if not suspects:
            return size
        earlier = {line for start, end, line in _lines(path, 0, offset) if line in suspects}
        keep = []
        for start, end, line in tail:
            if line not in earlier:
                keep.append((start, end))
                earlier.add(line)
        new = self._cut(name, path, offset, keep, size)
        if new != size:
            log.warning(
                "%s: dropped %d bytes of lines past the checkpoint that were on disk already "
                "(written late by a collector that had lost its lease?)",
                path,
                size - new,
                extra={"dataset": name},
            )
        return new


def _lines(path: Path, start: int, end: int) -> Iterator[tuple[int, int, bytes]]:
    """(start, end, digest) of each line between two offsets."""
    with path.open("rb") as fh:
        fh.seek(start)
        pos = start
        while pos < end:
            line = fh.readline()
            if not line:
                return
            yield pos, pos + len(line), hashlib.blake2b(line, digest_size=16).digest()
            pos += len(line)


def _index(path: Path, start: int, obj: dict, name: str, samples: int) -> int:
    """The bit index of a line of dataset ``name``; Unreadable if it is not one."""
    row, sample = obj.get("row"), obj.get("sample")
    if obj.get("dataset") != name or not isinstance(row, int) or not isinstance(sample, int):
        raise Unreadable(f"{path}: the line at byte {start} is not a result of dataset {name}")
    return bit_index(row, sample, samples)
