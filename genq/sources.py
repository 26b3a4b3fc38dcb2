"""Source files: turn each kind of file into a stream of raw records, in file order, never whole.

A source yields :class:`Record` objects: the parsed value with where it came from ("path:LINE"
for line-based files, "path:row N" for Parquet and Hugging Face datasets, N counting from 0 in
that file), or a per-record error (a malformed JSON line, a row larger than ``max_row_bytes``,
a value JSON cannot carry on: a lone surrogate, invalid UTF-8, NaN/Infinity, an integer beyond 64
bits). Every text row is decoded by orjson, so JSON Lines and JSON arrays refuse the same values,
and a value a job can hold is exactly one orjson can write again. A source that cannot go on (a broken
JSON array, an unreadable Parquet file) raises :class:`SourceError`: rows after that point have
no stable number, so nothing after it may be enqueued.

Kinds: JSON Lines (``.jsonl``, ``.ndjson``, read a bounded chunk at a time so an enormous line is
skipped, never held); ``.json`` (a JSON array, each element found with the standard library's C
scanner so line numbers stay exact, then decoded by orjson; an element past ``max_row_bytes`` is
skipped by a string- and bracket-aware scan that keeps one chunk; or JSON Lines when the file does
not start with ``[``); Parquet (``pyarrow``, in record batches); a folder: a Hugging Face
dataset saved with ``save_to_disk`` (memory-mapped) or a local dataset folder (``datasets``,
streamed, offline); a Hugging Face dataset id (``owner/name``, with ``--config``/``--split``),
read through ``datasets`` as ``load_dataset`` gives it: from its local cache when offline.

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
from typing import Any, BinaryIO, TextIO

import orjson

INSTALL_HINT = "pip install 'genq[datasets]'"
JSON_CHUNK = 1 << 20
MAX_ROW_BYTES = 64 << 20  # --max-row-bytes: a larger row is rejected, never read whole
RAW_BYTES = 4096  # how much of a rejected row is kept in the rejects file
HF_BATCH = 1000
LINE_SUFFIXES = (".jsonl", ".ndjson")
SUFFIXES = (*LINE_SUFFIXES, ".json", ".parquet")


class SourceError(Exception):
    """A source that cannot be read (further): the message names the file and why."""


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class HubDataset(type(Path())):  # type: ignore[misc]
    """A dataset named by its Hugging Face id: no file, but a source everywhere a path is one (its
    name is the dataset's default name, its string the id), read through ``datasets``."""

    config: str | None = None


@dataclass
class Record:
    where: str  # "path:LINE" or "path:row N"
    data: Any = None
    error: str | None = None  # set when the record itself could not be parsed
    raw: bytes | None = None  # the bytes it was parsed from (JSON Lines, arrays): its print, its reject line


def expand(specs: list[str], config: str | None = None) -> list[Path]:
    """FILE arguments to sources, in order: files, folders, globs (each glob's matches sorted), and
    Hugging Face dataset ids (``owner/name`` that is no path here; ``config``: its configuration)."""
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
        if HUB_ID.fullmatch(spec):
            hub = HubDataset(spec)
            hub.config = config
            out.append(hub)
            continue
        raise SourceError(f"{spec}: no such file or folder (nor a Hugging Face dataset id, owner/name)")
    if config is not None and not any(isinstance(p, HubDataset) for p in out):
        raise SourceError(f"--config {config}: the configuration of a Hugging Face dataset id (owner/name)")
    for path in out:
        if path.is_file() and path.suffix.lower() not in SUFFIXES:
            raise SourceError(f"{path}: unknown file type {path.suffix!r} (known: {', '.join(SUFFIXES)})")
    return out


def read(path: Path, split: str | None = None, max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[Record]:
    """Every record of one source, streamed."""
    if isinstance(path, HubDataset) or path.is_dir():
        return _hf_records(path, split)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_records(path)
    if suffix == ".json" and _first_char(path) == "[":
        return _json_array_records(path, max_row_bytes)
    return _jsonl_records(path, max_row_bytes, strict_first=suffix == ".json")


def count(path: Path, split: str | None = None, max_row_bytes: int = MAX_ROW_BYTES) -> int:
    """How many records ``read`` yields, as cheaply as the kind allows (Parquet and saved
    datasets from their metadata, JSON Lines by counting non-blank lines)."""
    if isinstance(path, HubDataset) or path.is_dir():
        return _hf_count(path, split)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_file(path).metadata.num_rows
    if suffix == ".json" and _first_char(path) == "[":
        return sum(1 for _ in _json_array_records(path, max_row_bytes))
    with path.open("rb") as fh:
        return sum(1 for _, line, _ in _lines(fh, max_row_bytes) if line is None or line.strip())


# -- one row's JSON -------------------------------------------------------------------------

# Where an integer beyond 64 bits may be (orjson reads it as a float): 19 digits in a row, found
# by mapping digits to 1 and the rest to 0 (a C pass, several times faster than a regex here).
_DIGITS = bytes(49 if 48 <= i <= 57 else 48 for i in range(256))
_LONG_RUN = b"1" * 19
_NOT_JSON = re.compile(rb"\b(NaN|Infinity)\b")
INT_RANGE = range(-(1 << 63), 1 << 64)  # what orjson reads and writes as an integer


def decode(raw: bytes) -> Any:
    """One row's value, by orjson's rules; raises ValueError saying what is wrong with it."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        msg = str(exc)
        if "not valid UTF-8" in msg:
            raise ValueError(f"not valid UTF-8 text (fix the file's encoding): {msg}") from exc
        if "surrogate" in msg:
            raise ValueError(f"a lone surrogate in a string (no character to send): {msg}") from exc
        if _NOT_JSON.search(raw):
            raise ValueError(f"NaN or Infinity is not a JSON value (write null or a number): {msg}") from exc
        raise ValueError(f"malformed JSON: {msg}") from exc
    if _LONG_RUN in raw.translate(_DIGITS):  # rare: the standard library, which keeps big ints, looks
        json.loads(raw, parse_int=_int64)
    return value


def _int64(text: str) -> int:
    # parse_int is given the literal, so a huge one is caught before int() refuses it (4300 digits)
    if len(text) > 21 or int(text) not in INT_RANGE:
        raise ValueError(f"the integer {text[:30]}{'...' if len(text) > 30 else ''} is beyond 64 bits")
    return 0


def too_large(size: int, limit: int) -> str:
    return f"the row is larger than --max-row-bytes {limit} ({size} bytes or more): not read"


# -- JSON Lines -----------------------------------------------------------------------------


def _lines(fh: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, line, size) of each line, read at most ``limit`` bytes at a time; a longer
    line comes as None, read on in chunks and dropped, so it is never held whole."""
    line_no = 0
    while line := fh.readline(limit + 1):
        line_no += 1
        if len(line) <= limit or line.endswith(b"\n"):
            yield line_no, line, len(line)
            continue
        size = len(line)
        while chunk := fh.readline(JSON_CHUNK):
            size += len(chunk)
            if chunk.endswith(b"\n"):
                break
        yield line_no, None, size


def _jsonl_records(path: Path, limit: int = MAX_ROW_BYTES, strict_first: bool = False) -> Iterator[Record]:
    """One record per non-blank line. ``strict_first``: a ``.json`` file whose first line is not
    JSON is neither an array nor JSON Lines; say so once rather than reject every line."""
    with path.open("rb") as fh:
        first = True
        for line_no, line, size in _lines(fh, limit):
            where = f"{path}:{line_no}"
            if line is None:
                yield Record(where, error=too_large(size, limit))
                first = False
                continue
            if not line.strip():
                continue
            try:
                yield Record(where, decode(line), raw=line)
            except ValueError as exc:
                if first and strict_first:
                    raise SourceError(
                        f"{where}: expected a JSON array or JSON Lines (one object per line): {exc}"
                    ) from exc
                if first and line.lstrip().startswith(b"["):
                    # A pretty-printed array: every later line would be a row of malformed JSON.
                    raise SourceError(
                        f"{where}: this is a JSON array, not JSON Lines: name the file .json (genq reads "
                        "arrays there), or write one object per line"
                    ) from exc
                yield Record(where, error=str(exc), raw=line)
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


def _json_array_records(path: Path, limit: int = MAX_ROW_BYTES) -> Iterator[Record]:
    """Elements of a top-level JSON array, one at a time, each with the line it starts on.

    ``json.JSONDecoder.raw_decode`` finds where one element ends in the buffer (an element cut by
    the end of the buffer is retried with more text), then orjson decodes that text, as it does a
    JSON line. Invalid UTF-8 is read as surrogate escapes, so it is that element's fault alone. An
    element past ``limit`` is skipped by :func:`_skip_element`, one chunk at a time. A malformed
    element ends the file (there is no telling where the next one starts): it is yielded as an
    error, then :class:`SourceError`.
    """
    # The scanner's values are thrown away: these keep it from converting (or refusing) numbers.
    decoder = json.JSONDecoder(parse_int=len, parse_float=len, parse_constant=len)
    with path.open("r", encoding="utf-8", errors="surrogateescape") as fh:
        text = _Text(fh)
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
            element, error = _find_element(decoder, text, limit)
            if element is None:
                if error is None:
                    yield Record(where, error=too_large(_skip_element(text, where), limit))
                else:
                    yield Record(where, error=f"malformed JSON: {error}")
                    raise SourceError(
                        f"{where}: malformed JSON inside the array; rows after it cannot be numbered, so "
                        "none of them (nor later files) are read: fix the file and run again"
                    )
            else:
                raw = element.encode("utf-8", "surrogateescape")
                if len(raw) > limit:
                    yield Record(where, error=too_large(len(raw), limit))
                else:
                    try:
                        yield Record(where, decode(raw), raw=raw)
                    except ValueError as exc:
                        yield Record(where, error=str(exc), raw=raw)
            expect_value = first = False
        if text.skip_ws():
            raise SourceError(f"{path}:{text.line()}: unexpected text after the JSON array")


def _find_element(decoder: json.JSONDecoder, text: _Text, limit: int) -> tuple[str | None, str | None]:
    """The text of the JSON value at ``text.pos`` (moving past it): (text, None); (None, why it
    is malformed); or (None, None) when more than ``limit`` characters hold no end of it."""
    while True:
        try:
            end = decoder.raw_decode(text.buf, text.pos)[1]
        except json.JSONDecodeError as exc:
            # Cut by the end of the buffer (an open string, or trouble right at the end): read on.
            cut = exc.msg.startswith("Unterminated string") or exc.pos >= len(text.buf) - 16
            if cut and len(text.buf) - text.pos > limit:
                return None, None
            if cut and text.more():
                continue
            line = text.line() + text.buf.count("\n", text.pos, exc.pos)
            return None, f"{exc.msg} at line {line}"
        if end >= len(text.buf) and text.more():
            continue  # a number or literal may go on in the next chunk
        element, text.pos = text.buf[text.pos : end], end
        return element, None


_IN_STRING = re.compile(r'["\\]')
_OUTSIDE = re.compile(r'["\[\]{},]')


def _skip_element(text: _Text, where: str) -> int:
    """Move past the element at ``text.pos`` without keeping it: strings and brackets are
    followed a chunk at a time, the text behind dropped. Returns its size in characters."""
    size, depth, in_string, pos = 0, 0, False, text.pos
    while True:
        found = (_IN_STRING if in_string else _OUTSIDE).search(text.buf, pos)
        if found is None or (in_string and found.group() == "\\" and found.end() >= len(text.buf)):
            pos = len(text.buf) if found is None else found.start()
            size, text.pos = size + pos - text.pos, pos
            if not text.more():
                raise SourceError(f"{where}: the file ends inside a row of the JSON array")
            pos = text.pos
            continue
        char, pos = found.group(), found.end()
        if in_string:
            if char == "\\":
                pos += 1  # the escaped character
                continue
            in_string = False
        elif char == '"':
            in_string = True
            continue
        elif char in "[{":
            depth += 1
            continue
        elif char in "]}":
            depth -= 1
        if depth < 0 or char == "," and depth == 0:
            pos = found.start()  # the array's own ',' or ']': not the element's
        elif depth > 0:
            continue
        size, text.pos = size + pos - text.pos, pos
        return size


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
    """A dataset saved with ``save_to_disk`` (memory-mapped), else a local dataset folder, streamed;
    or a dataset id as ``load_dataset`` gives it (its prepared cache, memory-mapped)."""
    hub = isinstance(path, HubDataset)
    if not hub:  # a folder is read here, never fetched (an id is the user's own ask to)
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError as exc:
        raise SourceError(f"{path}: reading a Hugging Face dataset needs datasets: {INSTALL_HINT}") from exc

    saved = not hub and ((path / "state.json").exists() or (path / "dataset_dict.json").exists())
    try:
        if hub:
            data = datasets.load_dataset(str(path), path.config)  # type: ignore[attr-defined]
        elif saved:
            data = datasets.load_from_disk(str(path))
        else:
            data = datasets.load_dataset(str(path), streaming=True)
    except Exception as exc:  # datasets raises many kinds for a folder it cannot read
        if hub:
            raise SourceError(
                f"{path}: no such file or folder, and not a Hugging Face dataset datasets can load here "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); offline, it loads "
                "only once cached: load it once online (or give its files)"
            ) from exc
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
