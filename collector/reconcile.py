"""Reconciling a dataset's files with Redis, when a collector takes the dataset over.

Lines past the last checkpoint may be on disk with their ids unmarked (a crash between the fsync
and the commit, or a Redis that lost writes). This module owns re-reading them: torn tails cut,
ids marked and token counts added a chunk at a time with the checkpoint move, and logprobs frames
cut from the first one whose record is not on disk.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import redis

from collector.checkpoint import Checkpoints, Commands, Stale, mark
from collector.files import cut_torn_tail, scan
from collector.leases import Leases
from genq import token_counts
from genq.bitmaps import is_set
from genq.keys import Keys
from genq.logprobs import FILE as LOGPROBS
from genq.logprobs import frames as logprobs_frames
from genq.schema import ERRORS, KIND_ERROR, KIND_RECORD, RAW, bit_index, parse_record_id

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

    def dataset(self, name: str) -> None:
        # Reconciling writes too (torn tails cut, checkpoints, done bits, token counts): a collector
        # that was cut off must know it still holds the folder before it touches any of it.
        self.leases.fence([name])
        for tries in range(RECONCILE_TRIES):
            try:
                for kind, filename in ((KIND_ERROR, ERRORS), (KIND_RECORD, RAW)):
                    path = self.out / name / filename
                    cut = cut_torn_tail(path)
                    if cut:
                        log.warning(
                            "%s: cut a torn last line (%d bytes) left by a crash",
                            path,
                            cut,
                            extra={"dataset": name},
                        )
                    self._file(name, kind, path)
                self._logprobs(name)
                return
            except Stale:
                if tries + 1 == RECONCILE_TRIES:
                    raise
                log.warning("Redis lost writes while %s was re-read: reading it again", name)

    def _logprobs(self, name: str) -> None:
        """Keep the frames past the checkpoint whose record is on disk (marked done just above);
        cut the file from the first one whose record is not: its batch never reached the records
        file, and its entries will be written again when replayed."""
        path = self.out / name / LOGPROBS
        if not path.exists():
            return
        field = str(path)
        (stored,) = self.checkpoints.read([field])
        size = path.stat().st_size
        offset = 0 if stored > size else stored
        done = self.conn.get(self.keys.done(name)) or b""
        samples = self.samples(name)
        keep = offset
        for start, end, record_id, _ in logprobs_frames(path, offset):
            parsed = parse_record_id(record_id, name, samples)
            if parsed is None or not is_set(done, bit_index(*parsed, samples)):
                keep = start
                break
            keep = end
        if keep < size:
            self.close_file(name, LOGPROBS)
            with path.open("rb+") as fh:
                fh.truncate(keep)
                os.fsync(fh.fileno())
            log.warning(
                "%s: cut %d bytes of frames whose records are not on disk (they are replayed)",
                path,
                size - keep,
                extra={"dataset": name},
            )
        self.checkpoints.commit({field: (stored, keep)})

    def _file(self, name: str, kind: bytes, path: Path) -> None:
        """Mark the ids of the lines past the checkpoint, moving it a chunk at a time: each chunk's
        marks and token counts land with its checkpoint move, or (Stale) not at all."""
        field = str(path)
        size = path.stat().st_size if path.exists() else 0
        (stored,) = self.checkpoints.read([field])
        offset = stored
        if offset > size:
            log.warning("%s is shorter than its checkpoint: re-reading all of it", path)
            offset = 0
        samples = self.samples(name)
        # Records whose done bit is still 0 get their tokens counted, with the chunk that sets the
        # bit: a crash between chunks leaves each chunk counted once or not at all.
        done = (self.conn.get(self.keys.done(name)) or b"") if kind == KIND_RECORD else None
        live = self.conn.hexists(self.keys.tokens(name), "first_at")
        uncounted: list[dict] = []
        seen: set[int] = set()
        marked = 0
        indexes: list[int] = []

        def body(commands: Commands) -> None:
            mark(commands, self.keys, name, kind, indexes)
            token_counts.add(commands, self.keys, name, uncounted, None, live)

        for end, obj in scan(path, offset):
            index = bit_index(obj["row"], obj["sample"], samples)
            indexes.append(index)
            if done is not None and not is_set(done, index) and index not in seen:
                seen.add(index)
                uncounted.append(obj)
            marked += 1
            if len(indexes) >= RECONCILE_CHUNK:
                self.checkpoints.commit({field: (stored, end)}, body)
                stored, indexes, uncounted = end, [], []
        self.checkpoints.commit({field: (stored, size)}, body)
        if marked:
            log.info(
                "%s: marked %d ids found on disk past the checkpoint", path, marked, extra={"dataset": name}
            )
