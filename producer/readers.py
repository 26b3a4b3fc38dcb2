"""Source readers: turn files into numbered rows, or into errors that name file, line and field.

A reader yields :class:`Row` objects (a parsed prompt) and :class:`Rejected` objects (a row
that cannot be used, with the reason) in file order, so row numbers stay stable whatever is
wrong with a line. New formats plug in through :data:`READERS` (by suffix) and
:func:`parse_prompt` (by row shape).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson


@dataclass
class Prompt:
    input_ids: list[int] | None = None
    text: str | None = None
    source_id: str | None = None


@dataclass
class Row:
    """One usable source row. ``row`` counts records across the dataset's files, from 0."""

    path: str
    line: int
    row: int
    prompt: Prompt


@dataclass
class Rejected:
    path: str
    line: int
    row: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


class RowError(ValueError):
    """A row that cannot become a job; the message names the field and what was expected."""


def parse_prompt(data: Any) -> Prompt:
    """A row with ``input_ids`` (pre-tokenized) or ``prompt`` (text, sent as ``text``)."""
    if not isinstance(data, dict):
        raise RowError(f"expected a JSON object, got {type(data).__name__}")
    source_id = data.get("id")
    if source_id is not None and not isinstance(source_id, str | int):
        raise RowError(f"field 'id': expected a string or integer, got {type(source_id).__name__}")
    source_id = None if source_id is None else str(source_id)
    if "input_ids" in data:
        ids = data["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise RowError("field 'input_ids': expected a non-empty list of integers")
        for i, tok in enumerate(ids):
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise RowError(f"field 'input_ids'[{i}]: expected a non-negative integer, got {tok!r}")
        return Prompt(input_ids=ids, source_id=source_id)
    if "prompt" in data:
        text = data["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise RowError("field 'prompt': expected a non-empty string")
        return Prompt(text=text, source_id=source_id)
    fields = ", ".join(sorted(map(str, data))) or "none"
    raise RowError(f"no prompt: expected field 'input_ids' or 'prompt' (fields present: {fields})")


def read_jsonl(path: Path, first_row: int) -> Iterator[Row | Rejected]:
    """JSON Lines, streamed: one record per non-blank line."""
    row = first_row
    with path.open("rb") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                data = orjson.loads(line)
                yield Row(str(path), line_no, row, parse_prompt(data))
            except orjson.JSONDecodeError as exc:
                yield Rejected(str(path), line_no, row, f"malformed JSON: {exc}")
            except RowError as exc:
                yield Rejected(str(path), line_no, row, str(exc))
            row += 1


READERS: dict[str, Callable[[Path, int], Iterator[Row | Rejected]]] = {
    ".jsonl": read_jsonl,
    ".ndjson": read_jsonl,
}


def read_files(paths: list[Path]) -> Iterator[Row | Rejected]:
    """All rows of a dataset's files in order, numbered across files."""
    row = 0
    for path in paths:
        reader = READERS.get(path.suffix.lower())
        if reader is None:
            known = ", ".join(sorted(READERS))
            raise click_error(f"{path}: unknown file type {path.suffix!r} (known: {known})")
        for item in reader(path, row):
            row = item.row + 1
            yield item


def click_error(message: str) -> Exception:
    import click

    return click.ClickException(message)
