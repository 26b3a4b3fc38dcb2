"""Sources known by content: per source file, a hash of the rows enqueued from it, checked next time.

Rows are known by position (job ids are ``<dataset>-<row>``), so another file under a known file's
name would have its rows skipped where the old file's were enqueued and the rest of it enqueued:
two files mixed in one dataset. So each source file (by its position among the dataset's files)
records how many of its rows were enqueued and a running blake2b of them (each row's bytes as
read: the line of a JSON Lines file, the element's text of a JSON array; a Parquet or Hugging
Face row's canonical JSON), in the ``sources`` hash of the dataset, in the MULTI of every push
and once more when the enqueue has read the whole file. A later enqueue hashes the same rows in
the same one pass it reads them in, and refuses the file when the hash differs at the recorded
count, or when the file is shorter; rows appended to the last file are new rows. Until the
recorded count is reached, the rows of the file that would be queued are held back (only rows
refused last time can be: the others are queued or done), so a differing file queues nothing.
A dataset enqueued before fingerprints existed has none: its files' are recorded then.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path

import orjson
import redis
from redis.client import Pipeline

from genq.sources import Record, SourceError

_CANONICAL = orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


@dataclass(frozen=True)
class Print:
    """The first ``rows`` rows of a source file hash to ``blake2b``."""

    file: str
    rows: int
    blake2b: str


@dataclass(frozen=True)
class Mark:
    """Where a row is: its file's position among the sources, and how many rows of it are read."""

    source: int
    rows: int


def row_bytes(record: Record) -> bytes:
    """What a row's hash is taken of: the bytes read, or a columnar row's canonical JSON."""
    if record.raw is not None:
        return record.raw.strip()
    return orjson.dumps(record.data, option=_CANONICAL, default=_plain)


def _plain(value: object) -> str:
    """A value JSON has no type for, as the same text every time it is read: bytes as hex, a
    Decimal as its digits, anything else (an image, ...) by its type alone (a repr may hold an
    address that changes from one process to the next)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, Decimal):
        return str(value)
    return type(value).__name__


class SourceMismatch(SourceError):
    """A source file is not the one whose rows the dataset already enqueued."""


class Fingerprints:
    """The recorded prints of a dataset's files, the running ones of this enqueue, and saving them."""

    def __init__(
        self, key: str, dataset: str, replace: bool = False, report: Callable[[str], None] = lambda line: None
    ):
        self.key, self.dataset, self.replace, self.report = key, dataset, replace, report
        self.recorded: dict[int, Print] = {}
        self.saved: dict[int, int] = {}  # file -> rows its recorded print covers
        self.ended: dict[int, Print] = {}  # files read to their end: their whole print
        self.reading: FileHash | None = None  # the file being read

    def load(self, conn: redis.Redis) -> None:
        """The prints recorded (Redis content is untrusted: a field genq did not write is refused)."""
        for field, value in conn.hgetall(self.key).items():
            try:
                found = Print(**orjson.loads(value))
                if not (isinstance(found.rows, int) and isinstance(found.blake2b, str)):
                    raise TypeError("rows must be an integer, blake2b a string")
                self.recorded[int(field)] = found
            except (TypeError, ValueError) as exc:
                raise SourceError(
                    f"{self.key} field {field!r}: not a source print genq wrote ({exc}); delete the field "
                    "and enqueue again to record it afresh"
                ) from exc
        self.saved = {index: found.rows for index, found in self.recorded.items()}

    def file(self, index: int, path: Path) -> FileHash:
        self.reading = FileHash(self, index, path)
        return self.reading

    def abandon(self) -> None:
        """The file being read stopped the enqueue (unreadable further, or refused): its print
        stays as recorded, so fixing the file and running again is checked against that."""
        self.reading = None

    def held(self, mark: Mark) -> bool:
        """Whether a row lies in its file's recorded rows, not all read yet: not to be queued yet."""
        old = self.recorded.get(mark.source)
        return old is not None and mark.rows < old.rows

    def save(self, pipe: Pipeline) -> dict[int, int]:
        """Queue the prints that cover more rows than recorded: each file read to its end, and the
        one being read up to where it is. Returns what to pass to :meth:`saved_as` once the MULTI
        is applied. The reading runs a little ahead of the pushes (a render batch, a push batch),
        so a print may cover rows still on their way: were the enqueue killed, the next one holds
        them back until it has checked them, then queues them."""
        latest = dict(self.ended)
        if self.reading is not None and self.reading.index not in latest:
            latest[self.reading.index] = self.reading.print()
        written = {}
        for index, found in sorted(latest.items()):
            if found.rows > self.saved.get(index, -1):
                pipe.hset(self.key, str(index), orjson.dumps(asdict(found)))
                written[index] = found.rows
        return written

    def saved_as(self, written: dict[int, int]) -> None:
        self.saved.update(written)


class FileHash:
    """One source file's running print, checked against the recorded one as its rows are read."""

    def __init__(self, owner: Fingerprints, index: int, path: Path):
        self.owner, self.index, self.path = owner, index, path
        self.hash = hashlib.blake2b(digest_size=16)
        self.rows = 0
        self.old = owner.recorded.get(index)
        self.followed = any(later > index for later in owner.recorded)  # later files' rows numbered after

    def add(self, record: Record) -> Mark:
        data = row_bytes(record)
        self.hash.update(len(data).to_bytes(8, "little"))
        self.hash.update(data)
        self.rows += 1
        old = self.old
        if old is not None and self.rows == old.rows and self.hash.hexdigest() != old.blake2b:
            self._differs(
                f"{record.where}: the first {old.rows} rows of this file are not the {old.rows} rows "
                f"enqueued from {old.file} as dataset {self.owner.dataset!r} (they differ at or before "
                f"row {old.rows} of the file)"
            )
        if old is not None and self.rows == old.rows + 1 and self.followed:
            raise SourceMismatch(
                f"{record.where}: this file has more rows than the {old.rows} enqueued from it before, and "
                f"the rows of the files after it in dataset {self.owner.dataset!r} are numbered after "
                "those: rows may be added only to the last file. Put new rows in a new file given after "
                "the others"
            )
        return Mark(self.index, self.rows)

    def print(self) -> Print:
        return Print(self.path.name, self.rows, self.hash.hexdigest())

    def end(self) -> None:
        old = self.old
        if old is not None and self.rows < old.rows:
            self._differs(
                f"{self.path}: the file has {self.rows} rows, {old.rows} were enqueued from {old.file} as "
                f"dataset {self.owner.dataset!r}"
            )
        self.owner.ended[self.index] = self.print()

    def _differs(self, what: str) -> None:
        """Refuse the file, or with --replace-settings take it as it is from now on."""
        if not self.owner.replace:
            raise SourceMismatch(
                f"{what}: it is another file under the same name, and rows are known by position. "
                "Enqueue it as another --dataset; or give --replace-settings to take this file as the "
                "dataset's from now on: the rows already enqueued or done keep the other file's prompts "
                "and results, only rows past them come from this one"
            )
        self.owner.report(f"{what}: --replace-settings: this file's rows are the dataset's from now on")
        self.owner.saved[self.index] = 0
        self.owner.recorded.pop(self.index, None)
        self.old = None
