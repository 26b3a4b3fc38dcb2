"""Rows given in memory, made a file: what an enqueue reads is a file, whoever calls it.

genq knows a dataset's rows by their position in its source files and guards each file with a
print of the rows enqueued from it (producer/fingerprints.py). Rows handed over in Python (a list
of dicts, a ``datasets.Dataset``, a pandas ``DataFrame``) are written to ``<dataset>.jsonl`` in one
folder per namespace, the same name each time: enqueued again, the same rows are skipped, rows
added at the end are enqueued, changed rows are refused — as for a file on disk.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson

from genq.api.errors import UsageError
from genq.keys import validate_name

# A path, glob, dataset folder or Hub id; several; or rows in memory.
Source = str | os.PathLike | Iterable[Any]


def rows_folder(out: Path | None, namespace: str) -> Path:
    """Where rows given in memory are written: ``GENQ_ROWS_DIR``, else ``OUT/.rows`` of the run the
    client reads, else ``~/.cache/genq/rows``; one folder per namespace below it."""
    base = os.environ.get("GENQ_ROWS_DIR")
    if base:
        root = Path(base)
    elif out is not None:
        root = out / ".rows"
    else:
        root = Path.home() / ".cache" / "genq" / "rows"
    return root / namespace


def materialize(source: Source, dataset: str | None, folder: Path) -> list[str]:
    """The files an enqueue of ``source`` reads: the paths themselves, or the rows written to
    ``folder/<dataset>.jsonl`` (replaced at once: a reader never sees half of it)."""
    if isinstance(source, (str, os.PathLike)):
        return [os.fspath(source)]
    if (
        isinstance(source, (list, tuple))
        and source
        and all(isinstance(s, (str, os.PathLike)) for s in source)
    ):
        return [os.fspath(s) for s in source]
    if dataset is None:
        raise UsageError("rows given in memory need dataset= (their name has no file to come from)")
    name = validate_name(dataset)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    partial = path.with_suffix(".jsonl.partial")
    with partial.open("wb") as fh:
        for at, row in enumerate(_rows(source)):
            if not isinstance(row, Mapping):
                raise UsageError(f"{name}: row {at} is a {type(row).__name__}, not a dict (a row's fields)")
            try:
                fh.write(orjson.dumps(row, default=_plain, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            except TypeError as exc:
                raise UsageError(
                    f"{name}: row {at}: {exc}; give JSON values (str, numbers, lists, dicts)"
                ) from None
    partial.replace(path)
    return [str(path)]


def _rows(source: Iterable[Any]) -> Iterable[Any]:
    """A DataFrame's rows as dicts (its iteration yields column names); anything else as it iterates
    (a ``datasets.Dataset`` yields dicts)."""
    to_dict = getattr(source, "to_dict", None)
    if callable(to_dict) and hasattr(source, "columns"):
        return to_dict(orient="records")
    return source


def _plain(value: Any) -> Any:
    """orjson's fallback: a date or time (pandas' Timestamp too) as ISO text; nothing else guessed."""
    if hasattr(value, "isoformat"):
        return value.isoformat()
    raise TypeError(f"a {type(value).__name__} is not JSON")
