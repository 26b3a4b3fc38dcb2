"""Sources known by content: per source file, a print of the rows enqueued from it, checked next time.

Rows are known by position (job ids are ``<dataset>-<row>``), so another file under a known file's
name would have its rows skipped where the old file's were enqueued and the rest of it enqueued:
two files mixed in one dataset. So each source file (by its position among the dataset's files)
records how many of its rows were read and a print of them, in the ``sources`` hash of the
dataset. The print is a sum (mod 2**128) of one blake2b term per row taken into the dataset —
the row's position in its file and its bytes as read (the line of a JSON Lines file, the
element's text of a JSON array; a Parquet or Hugging Face row's canonical JSON) — and nothing for
a row enqueue refused: a refused row fixed in place is a row taken in, not another file. A later
enqueue sums the same rows in the same one pass it reads them in (a row refused last time, as the
``rejected`` bitmap says, adds nothing), and refuses the file when the print differs at the
recorded count, or when the file is shorter; rows appended to the last file are new rows.

The print is saved in the MULTI of every push, with the bits it depends on: a row refused last
time and queued now has its ``rejected`` bits cleared and its term added in the same MULTI, a row
refused now its bits set and its term taken out, so the saved print always matches the bitmap.
Until the recorded count is reached, the rows of the file that would be queued are held back
(only rows refused last time can be: the others are queued or done), so a differing file queues
nothing. A dataset enqueued before these prints existed has none (or an older kind): its files'
are recorded then.
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

from genq.bitmaps import is_set
from genq.schema import bit_index
from genq.sources import Record, SourceError

_CANONICAL = orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


MODULUS = 1 << 128


@dataclass(frozen=True)
class Print:
    """The first ``rows`` rows of a source file, those taken in, sum to ``terms`` (hex)."""

    file: str
    rows: int
    terms: str


@dataclass(frozen=True)
class Mark:
    """Where a row is (its file's position among the sources, and how many rows of it are read) and
    its term of the file's print."""

    source: int
    rows: int
    term: int


def row_bytes(record: Record) -> bytes:
    """What a row's term is taken of: the bytes read, or a columnar row's canonical JSON."""
    if record.raw is not None:
        return record.raw.strip()
    return orjson.dumps(record.data, option=_CANONICAL, default=_plain)


def row_term(position: int, data: bytes) -> int:
    """A row's term of its file's print: where it is in the file, and what it holds."""
    digest = hashlib.blake2b(position.to_bytes(8, "little"), digest_size=16)
    digest.update(data)
    return int.from_bytes(digest.digest(), "little")


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


# A change to the print's term of one file, in the MULTI that changes the row's ``rejected`` bits.
Change = tuple[int, int]  # (file's position, term added: negative to take it out)


class Fingerprints:
    """The recorded prints of a dataset's files, the running ones of this enqueue, and saving them."""

    def __init__(
        self,
        key: str,
        rejected_key: str,
        dataset: str,
        samples: int,
        replace: bool = False,
        report: Callable[[str], None] = lambda line: None,
    ):
        self.key, self.rejected_key, self.dataset, self.samples = key, rejected_key, dataset, samples
        self.replace, self.report = replace, report
        self.recorded: dict[int, Print] = {}
        self.refused_before = b""  # the rejected bitmap as this enqueue found it
        self.saved: dict[int, tuple[int, int]] = {}  # file -> (rows, terms) its saved print holds
        self.changed: dict[int, int] = {}  # file -> the terms its rows' verdicts changed, saved
        self.ended: dict[int, FileHash] = {}  # files read to their end
        self.reading: FileHash | None = None  # the file being read

    def load(self, conn: redis.Redis) -> None:
        """The prints recorded and the rows refused (Redis content is untrusted: a field genq did not
        write is refused)."""
        self.refused_before = conn.get(self.rejected_key) or b""
        older = []
        for field, value in conn.hgetall(self.key).items():
            try:
                fields = orjson.loads(value)
                if isinstance(fields, dict) and "blake2b" in fields and "terms" not in fields:
                    older.append(int(field))
                    continue
                found = Print(**fields)
                if not (isinstance(found.rows, int) and isinstance(found.terms, str)):
                    raise TypeError("rows must be an integer, terms a string")
                self.recorded[int(field)] = found
                self.saved[int(field)] = (found.rows, int(found.terms, 16))
            except (TypeError, ValueError) as exc:
                raise SourceError(
                    f"{self.key} field {field!r}: not a source print genq wrote ({exc}); delete the field "
                    "and enqueue again to record it afresh"
                ) from exc
        if older:
            files = ", ".join(map(str, sorted(older)))
            self.report(
                f"{self.dataset}: source prints of an older genq (files {files}): not checked this once, "
                "recorded afresh"
            )

    def refused(self, row: int) -> bool:
        """Whether enqueue refused ``row`` before this one began (its first sample's bit says)."""
        return is_set(self.refused_before, bit_index(row, 0, self.samples))

    def taken_in(self, row: int, mark: Mark | None) -> Change | None:
        """A row queued now: were it refused before, its term joins the print (with its bits)."""
        return (mark.source, mark.term) if mark is not None and self.refused(row) else None

    def turned_down(self, row: int, mark: Mark | None) -> Change | None:
        """A row refused now: were it not refused before, its term leaves the print (with its bits)."""
        return (mark.source, -mark.term) if mark is not None and not self.refused(row) else None

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

    def save(self, pipe: Pipeline, changes: list[Change]) -> dict[int, tuple[int, int]]:
        """Queue the prints that say more than the ones saved: each file read to its end, and the
        one being read up to where it is, with ``changes`` (the verdicts this MULTI records) and
        the ones saved before. Returns what to pass to :meth:`saved_as` once the MULTI is applied.
        The reading runs a little ahead of the pushes, so a print may cover rows still on their
        way, counted as the bitmap has them now: were the enqueue killed, the next one reads them
        the same, holds them back until it has checked them, then queues them."""
        latest = dict(self.ended)
        if self.reading is not None and self.reading.index not in latest:
            latest[self.reading.index] = self.reading
        pending: dict[int, int] = {}
        for index, term in changes:
            pending[index] = pending.get(index, 0) + term
        written = {}
        for index, hashed in sorted(latest.items()):
            terms = (hashed.terms + self.changed.get(index, 0) + pending.get(index, 0)) % MODULUS
            before = self.saved.get(index)
            if before is None or hashed.rows > before[0] or (hashed.rows == before[0] and terms != before[1]):
                found = Print(hashed.path.name, hashed.rows, f"{terms:032x}")
                pipe.hset(self.key, str(index), orjson.dumps(asdict(found)))
                written[index] = (hashed.rows, terms)
        return written

    def saved_as(self, written: dict[int, tuple[int, int]], changes: list[Change]) -> None:
        """The MULTI of :meth:`save` was applied."""
        self.saved.update(written)
        for index, term in changes:
            self.changed[index] = self.changed.get(index, 0) + term


class FileHash:
    """One source file's running print, checked against the recorded one as its rows are read."""

    def __init__(self, owner: Fingerprints, index: int, path: Path):
        self.owner, self.index, self.path = owner, index, path
        self.terms = 0  # the rows' terms, refused rows left out as the bitmap had them
        self.rows = 0
        self.old = owner.recorded.get(index)
        self.followed = any(later > index for later in owner.recorded)  # later files' rows numbered after

    def add(self, record: Record, row: int) -> Mark:
        """Row ``row`` of the dataset, the next of this file."""
        term = row_term(self.rows, row_bytes(record))
        if not self.owner.refused(row):
            self.terms = (self.terms + term) % MODULUS
        self.rows += 1
        old = self.old
        if old is not None and self.rows == old.rows and f"{self.terms:032x}" != old.terms:
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
        return Mark(self.index, self.rows, term)

    def end(self) -> None:
        old = self.old
        if old is not None and self.rows < old.rows:
            self._differs(
                f"{self.path}: the file has {self.rows} rows, {old.rows} were enqueued from {old.file} as "
                f"dataset {self.owner.dataset!r}"
            )
        self.owner.ended[self.index] = self

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
        self.owner.saved.pop(self.index, None)
        self.owner.recorded.pop(self.index, None)
        self.old = None
