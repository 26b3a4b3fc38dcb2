"""`genq enqueue --dry-run`: every row read, checked and rendered as a real enqueue would, nothing
enqueued and no Redis touched: the check before a 20-hour run.

The rows go through the same stages as :func:`producer.enqueue.enqueue_rows` (the formats, the
chat template, :func:`producer.enqueue.checked`), file by file, so what it counts is what an
enqueue of a fresh dataset would enqueue and reject. Rows an earlier enqueue already queued are
not looked up (that needs Redis): it counts as if the dataset were new.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from genq.producer.enqueue import Options, Report, checked, render_stream
from genq.producer.readers import Rejected, Row, read_dataset
from genq.sources import SourceError


@dataclass
class FileCheck:
    """What one file would give."""

    path: Path
    rows: int = 0
    usable: int = 0
    rejected: int = 0
    clipped: int = 0
    first: Row | None = None  # its first usable row, rendered
    fatal: str | None = None  # the file could not be read on (nothing after it would be enqueued)


def check_files(
    paths: list[Path], params: dict[str, Any], options: Options, report: Report
) -> list[FileCheck]:
    """One :class:`FileCheck` per file, in order; the first file that cannot be read on is the last."""
    out = []
    for path in paths:
        check = FileCheck(path)
        out.append(check)
        try:
            for item in _rows(path, options, report):
                check.rows += 1
                item = checked(item, params, options)
                if isinstance(item, Rejected):
                    check.rejected += 1
                    report(f"rejected {item}")
                    continue
                check.usable += 1
                check.clipped += item.max_new_tokens is not None
                if check.first is None:
                    check.first = item
        except SourceError as exc:
            check.fatal = str(exc)
            break
    return out


def _rows(path: Path, options: Options, report: Report) -> Iterator[Row | Rejected]:
    stream: Iterator[tuple[Row | Rejected, list[int]]] = (
        (item, [0])
        for item in read_dataset([path], options.shape, options.split, report, options.max_row_bytes)
    )
    if options.template is not None:
        stream = render_stream(stream, options.template, options.shape.turns == "all")
    return (item for item, _ in stream)


def describe(check: FileCheck, samples: int, options: Options) -> list[str]:
    """The lines said of one file: its counts, then its first prompt as the server will get it."""
    jobs = (
        f"{check.usable * samples} jobs ({check.usable} rows x {samples} samples)"
        if samples > 1
        else (f"{check.usable} jobs")
    )
    clipped = f", clip max_new_tokens of {check.clipped}" if check.clipped else ""
    lines = [f"{check.path}: {check.rows} rows: would enqueue {jobs}, reject {check.rejected}{clipped}"]
    if check.fatal:
        lines.append(f"{check.path}: cannot be read on: {check.fatal}")
    if check.first is not None:
        text, tokens = _shown(check.first, options)
        lines.append(f"{check.path}: first prompt ({check.first.where}), {tokens}:")
        lines.append(text)
    return lines


def _shown(row: Row, options: Options) -> tuple[str, str]:
    """The prompt as text, and its token count (or who counts them)."""
    prompt, template = row.prompt, options.template
    if prompt.input_ids is not None:
        count = f"{len(prompt.input_ids)} tokens"
        if template is None:
            return f"input_ids {prompt.input_ids} (give --tokenizer to see them as text)", count
        return template.tokenizer.decode(prompt.input_ids), count
    if prompt.text is not None:
        if template is None:
            return prompt.text, "tokens counted by the server (give --tokenizer to count them here)"
        return prompt.text, f"{len(template.encode(prompt.text))} tokens"
    return orjson.dumps(prompt.messages).decode(), "messages: the server renders and counts them"
