"""A dataset's rows: its sources read in order, each row parsed by its format, numbered across files.

Yields :class:`Row` objects (a parsed prompt) and :class:`Rejected` objects (a row that cannot be
used, with the reason) in file order. A row's number counts every record of the dataset's sources
from 0, valid or not, so row numbers (and job ids) never depend on what is wrong with a row. File
kinds plug in through :mod:`genq.sources`, row shapes through :mod:`producer.formats`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from genq import sources
from genq.producer.fingerprints import FileHash, Fingerprints, Mark
from genq.producer.formats import Prompt, RowError, Shape, ShapeError
from genq.sources import SourceError


@dataclass
class Row:
    """One usable source row. ``row`` counts records across the dataset's sources, from 0."""

    where: str  # "path:LINE" or "path:row N"
    row: int
    prompt: Prompt
    max_new_tokens: int | None = None  # clipped to fit the context (--clip-max-new-tokens)
    raw: bytes | None = None  # the row as written (its start), should a later check reject it
    mark: Mark | None = None  # its file, where in it, its term of the file's print (enqueue's)


@dataclass
class Rejected:
    where: str
    row: int
    reason: str
    raw: bytes | None = None  # the row as written (its first bytes), when it came from text
    mark: Mark | None = None

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


def read_dataset(
    paths: list[Path],
    shape: Shape,
    split: str | None = None,
    report: Callable[[str], None] = lambda line: None,
    max_row_bytes: int = sources.MAX_ROW_BYTES,
    prints: Fingerprints | None = None,
) -> Iterator[Row | Rejected]:
    """All rows of a dataset's sources in order. With ``--format auto``, ``report`` hears each
    file's format (and any other format met further on in the same file). With ``prints``, each
    row carries its file's print up to it, checked against the recorded one as it is read."""
    row = 0
    for index, path in enumerate(paths):
        hashed = prints.file(index, path) if prints is not None else None
        try:
            for item in _file_rows(path, row, shape, split, report, hashed, max_row_bytes):
                yield item
                row += 1
            if hashed is not None:
                hashed.end()
        except SourceError:
            if prints is not None:
                prints.abandon()  # a file that cannot be read on, or is refused: no print of it is saved
            raise


def _file_rows(
    path: Path,
    first: int,
    shape: Shape,
    split: str | None,
    report: Callable[[str], None],
    hashed: FileHash | None,
    max_row_bytes: int,
) -> Iterator[Row | Rejected]:
    """One file's rows, numbered from ``first``."""
    seen: set[str] = set()
    for row, record in enumerate(sources.read(path, split, max_row_bytes), start=first):
        mark = hashed.add(record, row) if hashed is not None else None
        raw = record.raw[: sources.RAW_BYTES] if record.raw is not None else None
        if record.error is not None:
            yield Rejected(record.where, row, record.error, raw, mark)
            continue
        try:
            fmt, prompt = shape.parse(record.data)
        except RowError as exc:
            yield Rejected(record.where, row, str(exc), raw or _as_json(record.data), mark)
        except ShapeError as exc:
            raise SourceError(f"{record.where}: {exc}") from exc
        else:
            if shape.format == "auto" and fmt not in seen:
                report(f"{path}: format {fmt}" if not seen else f"{record.where}: also format {fmt}")
                seen.add(fmt)
            yield Row(record.where, row, prompt, raw=raw, mark=mark)


def first_row(
    paths: list[Path], shape: Shape, split: str | None = None, max_row_bytes: int = sources.MAX_ROW_BYTES
) -> Row | None:
    """The dataset's first usable row: its own sampling (an OpenAI Batch request line's) becomes the
    dataset's settings, and what it is (ids, text, a conversation) tells what the settings can do."""
    for item in read_dataset(paths, shape, split, max_row_bytes=max_row_bytes):
        if isinstance(item, Row):
            return item
    return None


def _as_json(data: object) -> bytes | None:
    """A row that was not text (Parquet, a dataset folder), as JSON for the rejects file."""
    try:
        return orjson.dumps(data, default=str, option=orjson.OPT_SERIALIZE_NUMPY)[: sources.RAW_BYTES]
    except TypeError:
        return None
