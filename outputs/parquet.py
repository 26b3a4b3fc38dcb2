"""Parquet shards of an export (``genq export --format parquet``, or ``--parquet``), for
``datasets.load_dataset("parquet", data_files=...)`` and the Hub.

One fixed schema per format, so every shard of a dataset reads as one table: the record's own
fields as typed columns, the nested ones (``sampling_params``, ``messages``, ``tools``...) and any
field beyond them as JSON text (a struct would take its shape from each shard's rows, and shards
that disagree do not load together). Shards are cut by size and named ``<stem>-00000-of-00003.parquet``
once all are written; until then they are ``.part`` files, so an export cut short never looks
finished. pyarrow is the ``datasets`` extra's.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

from genq.schema import shard_glob, shard_name

BATCH = 1000  # rows per row group

# The record's fields (docs/design.md, Records) as columns; everything else goes to ``extra``.
RECORD_COLUMNS: dict[str, str] = {
    "id": "string", "dataset": "string", "row": "int64", "sample": "int64", "source_id": "string",
    "prompt_tokens": "int64", "completion_tokens": "int64", "cached_tokens": "int64",
    "input_ids": "ids", "output_ids": "ids", "text": "string", "reasoning": "string", "content": "string",
    "finish_reason": "string", "latency_s": "float64", "attempts": "int64", "server": "string",
    "worker": "string", "backend": "string", "finished_at": "string", "schema": "int64",
    "sampling_params": "json", "messages": "json", "matched_stop": "json",
}  # fmt: skip
EAGLE3_COLUMNS: dict[str, str] = {
    "id": "string",
    "input_ids": "ids",
    "loss_mask": "mask",
    "source_id": "string",
}


def schema(columns: dict[str, str]) -> Any:
    import pyarrow as pa

    kinds = {
        "string": pa.string(),
        "int64": pa.int64(),
        "float64": pa.float64(),
        "ids": pa.list_(pa.int64()),
        "mask": pa.list_(pa.int8()),
        "json": pa.string(),
    }
    fields = [pa.field(name, kinds[kind]) for name, kind in columns.items()]
    if columns is RECORD_COLUMNS:
        fields.append(pa.field("extra", pa.string()))
    return pa.schema(fields)


def record_row(record: dict[str, Any]) -> dict[str, Any]:
    """A record as a row of RECORD_COLUMNS: nested fields as JSON text, the rest in ``extra``."""
    row = {
        name: (_json(record.get(name)) if kind == "json" else record.get(name))
        for name, kind in RECORD_COLUMNS.items()
    }
    rest = {k: v for k, v in record.items() if k not in RECORD_COLUMNS}
    row["extra"] = _json(rest) if rest else None
    return row


def records_table(records: Iterable[dict[str, Any]]) -> Any:
    """Records as one pyarrow table of RECORD_COLUMNS (what the parquet export's shards hold); a
    record whose values do not fit the columns is a ValueError naming its id, not left out."""
    import pyarrow as pa

    table_schema = schema(RECORD_COLUMNS)
    batches = []
    for batch in _batches(record_row(r) for r in records):
        try:
            batches.append(pa.Table.from_pylist(batch, schema=table_schema))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            for row in batch:
                try:
                    pa.Table.from_pylist([row], schema=table_schema)
                except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
                    raise ValueError(
                        f"record {row.get('id')!r} does not fit the record columns: {exc}"
                    ) from None
    return pa.concat_tables(batches) if batches else table_schema.empty_table()


def _json(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


def write(
    rows: Iterable[dict[str, Any]],
    folder: Path,
    stem: str,
    columns: dict[str, str],
    shard_bytes: int,
    skipped: Counter[str],
) -> tuple[list[Path], int]:
    """Write ``rows`` as shards of about ``shard_bytes`` (of Arrow data) under ``folder``; the
    files, in order, and the rows they hold. Earlier shards of ``stem`` are replaced only once all
    the new ones are written. A row whose values do not fit the columns is left out and counted in
    ``skipped``."""
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(f"{stem}-*.parquet.part"):
        stale.unlink()
    table_schema = schema(columns)
    parts: list[Path] = []
    writer, in_shard, written = None, 0, 0
    try:
        for batch in _batches(rows):
            table = _table(batch, table_schema, skipped)
            while table.num_rows:
                if writer is None or in_shard >= shard_bytes:
                    if writer is not None:
                        writer.close()
                    parts.append(folder / f"{stem}-{len(parts):05d}.parquet.part")
                    writer, in_shard = pq.ParquetWriter(parts[-1], table_schema), 0
                per_row = table.nbytes / table.num_rows
                fit = max(1, min(table.num_rows, int((shard_bytes - in_shard) / per_row) if per_row else 1))
                piece, table = table.slice(0, fit), table.slice(fit)
                writer.write_table(piece)
                in_shard += piece.nbytes
                written += piece.num_rows
        if writer is None:  # no rows: one empty shard, so the export still says what it holds
            parts.append(folder / f"{stem}-00000.parquet.part")
            pq.write_table(table_schema.empty_table(), parts[-1])
    finally:
        if writer is not None:
            writer.close()
    for old in folder.glob(shard_glob(stem)):
        old.unlink()
    done = []
    for k, part in enumerate(parts):
        final = folder / shard_name(stem, k, len(parts))
        with part.open("rb") as fh:
            os.fsync(fh.fileno())
        os.replace(part, final)
        done.append(final)
    return done, written


def _table(batch: list[dict[str, Any]], table_schema: Any, skipped: Counter[str]) -> Any:
    """The batch as a table; where it does not fit, row by row, the rows that do."""
    import pyarrow as pa

    errors = (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError)
    try:
        return pa.Table.from_pylist(batch, schema=table_schema)
    except errors:
        pass
    kept = []
    for row in batch:
        try:
            pa.Table.from_pylist([row], schema=table_schema)
        except errors as exc:
            skipped[f"values that do not fit the parquet columns ({type(exc).__name__})"] += 1
            continue
        kept.append(row)
    return pa.Table.from_pylist(kept, schema=table_schema)


def _batches(rows: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= BATCH:
            yield batch
            batch = []
    if batch:
        yield batch
