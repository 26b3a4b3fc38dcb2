"""Source files: turn each kind of file into a stream of raw records, in file order, never whole.

A source yields :class:`Record` objects: the parsed value with where it came from ("path:LINE"
for line-based files, "path:row N" for Parquet and Hugging Face datasets, N counting from 0 in
that file), or a per-record error (a malformed JSON line). A source that cannot go on (a broken
JSON array, an unreadable Parquet file) raises :class:`SourceError`: rows after that point have
no stable number, so nothing after it may be enqueued.

Kinds: JSON Lines (``.jsonl``, ``.ndjson``); ``.json`` (a JSON array, streamed with the standard
library's C scanner one element at a time so line numbers stay exact, or JSON Lines when the file
does not start with ``[``); Parquet (``pyarrow``, in record batches); a folder: a Hugging Face
dataset saved with ``save_to_disk`` (memory-mapped) or a local dataset folder (``datasets``,
streamed, offline).

It sits in the contract, not in producer/, because two floors read sources: `genq enqueue` numbers
rows from them and `genq verify` counts the same rows the same way, so the two can never disagree
about which jobs a dataset should have.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import orjson

INSTALL_HINT = "pip install 'genq[datasets]'"
JSON_CHUNK = 1 << 20
HF_BATCH = 1000
LINE_SUFFIXES = (".jsonl", ".ndjson")
SUFFIXES = (*LINE_SUFFIXES, ".json", ".parquet")


class SourceError(Exception):
    """A source that cannot be read (further): the message names the file and why."""


@dataclass
class Record:
    where: str  # "path:LINE" or "path:row N"
    data: Any = None
    error: str | None = None  # set when the record itself could not be parsed
    raw: bytes | None = None  # the bytes it was parsed from (JSON Lines, arrays); None for columnar rows


def expand(specs: list[str]) -> list[Path]:
    """FILE arguments to sources, in order: files, folders, and globs (each glob's matches sorted)."""
    out: list[Path] = []
    for spec in specs:
        path = Path(spec)
        if path.exists():
            out.append(path)
            continue
        if glob.has_magic(spec):
            matches = sorted(Path(m) for m in glob.glob(spec, recursive=True))
            if not matches:
                raise SourceError(f"{spec}: the pattern matches no file")
            out.extend(matches)
            continue
        raise SourceError(f"{spec}: no such file or folder")
    for path in out:
        if path.is_file() and path.suffix.lower() not in SUFFIXES:
            raise SourceError(f"{path}: unknown file type {path.suffix!r} (known: {', '.join(SUFFIXES)})")
    return out


def read(path: Path, split: str | None = None) -> Iterator[Record]:
    """Every record of one source, streamed."""
    if path.is_dir():
        return _hf_records(path, split)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_records(path)
    if suffix == ".json" and _first_char(path) == "[":
        return _json_array_records(path)
    return _jsonl_records(path, strict_first=suffix == ".json")


def count(path: Path, split: str | None = None) -> int:
    """How many records ``read`` yields, as cheaply as the kind allows (Parquet and saved
    datasets from their metadata, JSON Lines by counting non-blank lines)."""
    if path.is_dir():
        return _hf_count(path, split)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_file(path).metadata.num_rows
    if suffix == ".json" and _first_char(path) == "[":
        return sum(1 for _ in _json_array_records(path))
    with path.open("rb") as fh:
        return sum(1 for line in fh if line.strip())


# -- JSON Lines -----------------------------------------------------------------------------


def _jsonl_records(path: Path, strict_first: bool = False) -> Iterator[Record]:
    """One record per non-blank line. ``strict_first``: a ``.json`` file whose first line is not
    JSON is neither an array nor JSON Lines; say so once rather than reject every line."""
    with path.open("rb") as fh:
        first = True
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                yield Record(where, orjson.loads(line), raw=line)
            except orjson.JSONDecodeError as exc:
                if first and strict_first:
                    raise SourceError(
                        f"{where}: expected a JSON array or JSON Lines (one object per line): {exc}"
                    ) from exc
                yield Record(where, error=f"malformed JSON: {exc}", raw=line)
            first = False


# -- JSON arrays ----------------------------------------------------------------------------

_WS = re.compile(r"[ \t\n\r]*")


def _first_char(path: Path) -> str:
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        while chunk := fh.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[0]
    return ""


class _Text:
    """A growing window on a text file: the unread part, with the line number of each position."""

    def __init__(self, fh: TextIO):
        self.fh = fh
        self.buf = ""
        self.pos = 0
        self.eof = False
        self._line = 1  # line number at self._counted
        self._counted = 0

    def more(self) -> bool:
        """Read more (at least doubling what is unread, so a huge element costs O(n)); False at EOF."""
        if self.eof:
            return False
        self._line_at(self.pos)
        self.buf, self._counted = self.buf[self.pos :], self._counted - self.pos
        self.pos = 0
        chunk = self.fh.read(max(JSON_CHUNK, len(self.buf)))
        self.eof = not chunk
        self.buf += chunk
        return bool(chunk)

    def skip_ws(self) -> str:
        """The next non-blank character ('' at the end of the file)."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""

    def _line_at(self, pos: int) -> int:
        self._line += self.buf.count("\n", self._counted, pos)
        self._counted = pos
        return self._line

    def line(self) -> int:
        return self._line_at(self.pos)


def _json_array_records(path: Path) -> Iterator[Record]:
    """Elements of a top-level JSON array, one at a time, each with the line it starts on.

    ``json.JSONDecoder.raw_decode`` parses one element from the buffer; an element cut by the
    end of the buffer is retried with more text. A malformed element ends the file (there is no
    telling where the next one starts): it is yielded as an error, then :class:`SourceError`.
    """
    decoder = json.JSONDecoder()
    with path.open("r", encoding="utf-8") as fh:
        text = _Text(fh)
        try:
            if text.skip_ws() != "[":
                raise SourceError(f"{path}: expected a JSON array")
            text.pos += 1
            expect_value = True  # after '[' or ','
            first = True
            while True:
                char = text.skip_ws()
                where = f"{path}:{text.line()}"
                if char == "]" and (first or not expect_value):
                    text.pos += 1
                    break
                if not char:
                    raise SourceError(f"{where}: the file ends inside the JSON array (no closing ']')")
                if not expect_value:
                    if char != ",":
                        raise SourceError(f"{where}: expected ',' or ']' between rows, got {char!r}")
                    text.pos += 1
                    expect_value = True
                    continue
                value, raw, error = _decode_one(decoder, text)
                if error is not None:
                    yield Record(where, error=f"malformed JSON: {error}")
                    raise SourceError(
                        f"{where}: malformed JSON inside the array; rows after it cannot be numbered, so "
                        "none of them (nor later files) are read: fix the file and run again"
                    )
                yield Record(where, value, raw=raw.encode())
                expect_value = first = False
            if text.skip_ws():
                raise SourceError(f"{path}:{text.line()}: unexpected text after the JSON array")
        except UnicodeDecodeError as exc:
            raise SourceError(f"{path}: not UTF-8 text: {exc}") from exc


def _decode_one(decoder: json.JSONDecoder, text: _Text) -> tuple[Any, str, str | None]:
    """One JSON value at ``text.pos``: (value, its text, None), or (None, "", why it is malformed)."""
    while True:
        try:
            value, end = decoder.raw_decode(text.buf, text.pos)
        except json.JSONDecodeError as exc:
            # Cut by the end of the buffer (an open string, or trouble right at the end): read on.
            cut = exc.msg.startswith("Unterminated string") or exc.pos >= len(text.buf) - 16
            if cut and text.more():
                continue
            line = text.line() + text.buf.count("\n", text.pos, exc.pos)
            return None, "", f"{exc.msg} at line {line}"
        if end >= len(text.buf) and text.more():
            continue  # a number or literal may go on in the next chunk
        raw, text.pos = text.buf[text.pos : end], end
        return value, raw, None


# -- Parquet ----------------------------------------------------------------------------------


def _parquet_file(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise SourceError(f"{path}: reading Parquet needs pyarrow: {INSTALL_HINT}") from exc

    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a bad file
        raise SourceError(f"{path}: not a readable Parquet file: {exc}") from exc


def _parquet_records(path: Path) -> Iterator[Record]:
    parquet = _parquet_file(path)
    n = 0
    try:
        for batch in parquet.iter_batches(batch_size=HF_BATCH):
            for data in batch.to_pylist():
                yield Record(f"{path}:row {n}", data)
                n += 1
    except OSError as exc:
        raise SourceError(f"{path}:row {n}: cannot read on: {exc}") from exc


# -- Hugging Face datasets -------------------------------------------------------------------


def _hf_dataset(path: Path, split: str | None) -> Any:
    """A dataset saved with ``save_to_disk`` (memory-mapped), else a local dataset folder, streamed."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError as exc:
        raise SourceError(f"{path}: reading a dataset folder needs datasets: {INSTALL_HINT}") from exc

    saved = (path / "state.json").exists() or (path / "dataset_dict.json").exists()
    try:
        if saved:
            data = datasets.load_from_disk(str(path))
        else:
            data = datasets.load_dataset(str(path), streaming=True)
    except Exception as exc:  # datasets raises many kinds for a folder it cannot read
        raise SourceError(f"{path}: not a Hugging Face dataset folder that loads offline: {exc}") from exc
    if isinstance(data, datasets.DatasetDict | datasets.IterableDatasetDict):
        names = list(data)
        if split is None:
            split = "train" if "train" in names else names[0] if len(names) == 1 else None
        if split not in names:
            raise SourceError(f"{path}: choose a split with --split (it has {', '.join(names)})")
        return data[split]
    if split is not None and str(getattr(data, "split", None) or split) != split:
        raise SourceError(f"{path}: holds split {data.split}, not {split!r}")
    return data


def _hf_records(path: Path, split: str | None) -> Iterator[Record]:
    data = _hf_dataset(path, split)
    n = 0
    for batch in data.iter(batch_size=HF_BATCH):
        columns = list(batch)
        size = len(batch[columns[0]]) if columns else 0
        for i in range(size):
            yield Record(f"{path}:row {n}", {c: batch[c][i] for c in columns})
            n += 1


def _hf_count(path: Path, split: str | None) -> int:
    data = _hf_dataset(path, split)
    try:
        return len(data)
    except TypeError:  # a streamed folder: its size is known only when its metadata says so
        splits = data.info.splits or {}
        known = splits.get(data.split) if data.split else None
        if known is not None and known.num_examples:
            return int(known.num_examples)
        return sum(len(next(iter(b.values()), [])) for b in data.iter(batch_size=HF_BATCH))
