"""The rejects file: each row enqueue refused, one JSON object a line, so rejects outlive stderr.

A line holds ``file``, ``line`` (JSON Lines and JSON arrays: the line the row starts on) or
``row`` (Parquet and dataset folders: the row in that file, from 0), ``dataset_row`` (the row's
number across the dataset's sources, as in its job ids), ``field`` (when the reason names one:
``messages[2].content``),
``reason``, and ``raw``: the row as written, its first ``sources.RAW_BYTES`` bytes (invalid UTF-8
replaced; a Parquet or dataset row as JSON), or null when it was too large to read. The file is
written anew by each enqueue: every run reads every row, so it lists the rejects of the latest one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson

from genq.producer.readers import Rejected

# "field 'messages'[2].content: ..." -> messages[2].content
_FIELD = re.compile(r"field '([^']*)'((?:\[\d+\])*(?:\.[\w.]+)?)")
_ROW = re.compile(r"^(?P<file>.*):(?:row (?P<row>\d+)|(?P<line>\d+))$")


def entry(item: Rejected) -> dict[str, Any]:
    """One line of the rejects file."""
    found = _ROW.match(item.where)
    place: dict[str, Any] = {"file": item.where}
    if found is not None:
        key = "row" if found["row"] is not None else "line"
        place = {"file": found["file"], key: int(found[key])}
    field = _FIELD.match(item.reason)
    raw = item.raw.rstrip(b"\r\n").decode("utf-8", "replace") if item.raw is not None else None
    return {
        **place,
        "dataset_row": item.row,
        "field": field[1] + field[2] if field else None,
        "reason": item.reason,
        "raw": raw,
    }


class RejectsFile:
    """Written line by line (flushed), so a killed enqueue leaves the rejects it met."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fh = path.open("wb")

    def write(self, item: Rejected) -> None:
        self.fh.write(orjson.dumps(entry(item)) + b"\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()
