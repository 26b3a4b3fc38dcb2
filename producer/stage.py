"""Stages: a dataset whose rows are another dataset's records, enqueued as they land on disk.

`genq enqueue --from-dataset A --dataset B --template T --from-out OUT` follows ``OUT/A/
raw_responses.jsonl``: each record of A (its first line: a record superseded later keeps the row
it made) is turned by the template into one row of B, numbered by A's job index, and enqueued in
B's usual MULTI (its ``enqueued`` bit with the job). So whatever is killed — this follower
included — each record of A makes one row of B: a follower started again reads A's file from the
start and every row whose bit is set is skipped, as for a file enqueued again. Rows the template
fails on are B's refused rows (the reason names A's id). While it follows, B counts one job more
than it has (``in_source``) for as long as A is unsettled, so nothing waiting on B ends early;
it stops once A is settled (every job of A on disk, nothing in its stream or source) and its file
is read to the end. B's records name their parent (``parent``: A's record id).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import redis

from genq import datasets, progress, provenance
from genq.keys import Keys
from genq.producer.enqueue import Options, Report, Summary, enqueue_rows
from genq.producer.fingerprints import Fingerprints
from genq.producer.formats import RowError, Shape, ShapeError
from genq.producer.readers import Rejected, Row
from genq.producer.rejects import RejectsFile
from genq.producer.row_template import RowTemplate
from genq.redis_errors import Outage, patiently
from genq.schema import RAW, bit_index
from genq.sources import SourceError

log = logging.getLogger("genq.enqueue")

POLL_S = 0.2  # how often A's file and counts are looked at: a record of A is B's job within a second
# The fields of a record (docs/design.md, Records) a stage's template may name, and ``prompt``: the
# prompt's text (its last user turn).
RECORD_FIELDS = frozenset(
    {
        "id", "dataset", "row", "sample", "source_id", "parent", "prompt", "messages", "input_ids",
        "output_ids", "text", "reasoning", "content", "finish_reason", "matched_stop", "prompt_tokens",
        "completion_tokens", "cached_tokens", "fields", "check", "tools", "sampling_params", "attempts",
        "server", "worker", "backend", "finished_at", "schema", "latency_s", "finish_length",
    }
)  # fmt: skip


class StageRefused(ValueError):
    """A stage that cannot be: no such dataset, a cycle, no records folder. One line."""


@dataclass(frozen=True)
class StageSource:
    """Where a stage's rows come from: dataset ``dataset``'s records in ``folder`` (``OUT/<dataset>``),
    only those its checker accepted and/or that stopped by themselves when asked."""

    dataset: str
    folder: Path
    only_accepted: bool = False
    only_stopped: bool = False

    def describe(self) -> dict[str, Any]:
        """What the dataset's settings record of it (its recipe: another source is another dataset)."""
        filters = [name for name, on in (("accepted", self.only_accepted), ("stop", self.only_stopped)) if on]
        return {"dataset": self.dataset, "only": filters or None}


def check_source(
    conn: redis.Redis, keys: Keys, name: str, source: StageSource, template: RowTemplate
) -> None:
    """Refuse, before anything is recorded: a missing source dataset, a cycle (A from B from A),
    a template naming what no record has."""
    known = datasets.load_all(conn, keys)
    if source.dataset not in known:
        raise StageRefused(
            f"--from-dataset {source.dataset}: no such dataset in namespace {keys.namespace!r}; "
            "enqueue it first"
        )
    chain, at = [name], source.dataset
    while at is not None:
        chain.append(at)
        if at == name:
            raise StageRefused(f"--from-dataset {source.dataset}: a cycle ({' <- '.join(chain)})")
        upstream = known.get(at)
        at = (upstream.prompting.get("from_dataset") or {}).get("dataset") if upstream is not None else None
    if not source.folder.parent.is_dir():
        raise StageRefused(
            f"--from-out {source.folder.parent}: no such folder; give the collector's --out, where "
            f"{source.dataset}'s records land"
        )
    if source.only_accepted and not known[source.dataset].checked:
        raise StageRefused(
            f"--only-accepted: {source.dataset} is not checked (enqueue it with --checked or --accept K): "
            "none of its records would be taken"
        )
    template.check_names(RECORD_FIELDS, f"{source.dataset}'s records")


def enqueue_stage(
    conn: redis.Redis,
    keys: Keys,
    name: str,
    sampling_params: dict[str, Any],
    samples: int,
    options: Options,
    replace_settings: bool = False,
    report: Report = lambda line: None,
    register_only: bool = False,
    rejects: RejectsFile | None = None,
) -> Summary:
    """A stage's enqueue: its source checked, its settings registered (decision 12, the source and
    the template among them), then its source followed until settled."""
    source, template = options.stage, options.shape.template
    assert source is not None and template is not None  # EnqueueRequest.check said so
    check_source(conn, keys, name, source, template)
    wanted = datasets.settings_for(name, [], sampling_params, samples, options.prompting(), options.check)
    outage = Outage(log, conn, keys)
    settings = patiently(lambda: datasets.register(conn, keys, wanted, replace=replace_settings), outage)
    patiently(lambda: provenance.record_command(conn, keys, name, "enqueue"), outage)
    if register_only:
        return Summary()
    report(f"{name}: following {source.dataset}'s records in {source.folder} until it is settled")
    # One job held open from the start: nothing waiting on the stage sees it finished early.
    patiently(lambda: conn.hset(keys.in_source, name, settings.first_draw), outage)
    return follow(conn, keys, settings, source, options, report, rejects)


def follow(
    conn: redis.Redis,
    keys: Keys,
    settings: datasets.DatasetSettings,
    source: StageSource,
    options: Options,
    report: Report = lambda line: None,
    rejects: RejectsFile | None = None,
) -> Summary:
    """Follow ``source`` until it is settled, each record of it enqueued as one row of the dataset."""
    outage = Outage(log, conn, keys)
    upstream = datasets.load(conn, keys, source.dataset)
    assert upstream is not None  # check_source said so
    tail = _Tail(source.folder / RAW)
    made: set[str] = set()  # A's ids that made a row of B (their later lines are superseders)
    total = Summary()
    superseded = 0
    try:
        while True:
            # Settled first, then the file: every record of a settled A is on disk before it reads.
            settled = patiently(lambda: _settled(conn, keys, source.dataset), outage)
            records = tail.read()
            rows, later = _rows(records, source, options.shape, upstream.samples, made)
            superseded += later
            if rows:
                name = settings.name  # no source file: the prints stay empty
                prints = Fingerprints(
                    keys.sources(name), keys.rejected(name), name, settings.samples, False, report
                )
                got = enqueue_rows(conn, keys, settings, rows, prints, options, None, report, rejects)
                _add(total, got)
            if settled and not records:
                break
            pending = max(1, _unsettled(conn, keys, source.dataset)) * settings.first_draw
            patiently(lambda pending=pending: conn.hset(keys.in_source, settings.name, pending), outage)
            time.sleep(POLL_S)
    finally:
        if superseded:
            report(
                f"{settings.name}: {superseded} records of {source.dataset} superseded by a later line "
                "(a continuation, a record judged again) made no second row"
            )
    patiently(lambda: conn.hdel(keys.in_source, settings.name), outage)
    return total


def expected_indexes(out: Path, settings: datasets.DatasetSettings, upstream_samples: int) -> set[int]:
    """The job indexes a stage's rows take, from its source's records on disk under ``out``: one a
    record that passes its filters (any of its id's lines), for `genq verify`'s expected jobs."""
    source = settings.prompting.get("from_dataset") or {}
    only = source.get("only") or []
    stage = StageSource(
        source.get("dataset", ""), out / source.get("dataset", ""), "accepted" in only, "stop" in only
    )
    found: set[int] = set()
    for _, record in _Tail(stage.folder / RAW).read():
        row, sample = record.get("row"), record.get("sample") or 0
        if isinstance(row, int) and isinstance(sample, int) and _passes(record, stage):
            for k in range(settings.first_draw):
                found.add(bit_index(bit_index(row, sample, upstream_samples), k, settings.samples))
    return found


def _settled(conn: redis.Redis, keys: Keys, name: str) -> bool:
    """Every job of ``name`` on disk, nothing of it in its result stream, none left in its source."""
    counts = progress.dataset_counts(conn, keys).get(name)
    if counts is None:
        return False
    return progress.finished({name: counts}) and not conn.xlen(keys.results(name))


def _unsettled(conn: redis.Redis, keys: Keys, name: str) -> int:
    counts = progress.dataset_counts(conn, keys).get(name, {})
    return counts.get("total", 0) - counts.get("done", 0) - counts.get("failed", 0)


def _rows(
    records: list[tuple[str, dict[str, Any]]],
    source: StageSource,
    shape: Shape,
    samples: int,
    made: set[str],
) -> tuple[list[Row | Rejected], int]:
    """The rows ``records`` of A make (filtered ones make none), and how many were superseders."""
    rows: list[Row | Rejected] = []
    later = 0
    for where, record in records:
        rid = record.get("id")
        row, sample = record.get("row"), record.get("sample") or 0
        if not isinstance(rid, str) or not isinstance(row, int) or not isinstance(sample, int):
            continue  # not a genq record (the collector writes only genq's)
        if rid in made:
            later += 1
            continue
        if not _passes(record, source):
            continue  # a later line of this id (judged again) may still pass
        made.add(rid)
        index = bit_index(row, sample, samples)
        try:
            _, prompt = shape.parse(_context(record))  # the template makes the row first
        except RowError as exc:
            rows.append(Rejected(f"{where} ({rid})", index, str(exc), orjson.dumps(record)[:512]))
            continue
        except ShapeError as exc:
            raise SourceError(f"{where} ({rid}): {exc}") from exc
        prompt.parent = rid
        rows.append(Row(f"{where} ({rid})", index, prompt))
    return rows, later


def _passes(record: dict[str, Any], source: StageSource) -> bool:
    check = record.get("check")
    if source.only_accepted and not (isinstance(check, dict) and check.get("status") == "accepted"):
        return False
    return not (source.only_stopped and record.get("finish_reason") != "stop")


def _context(record: dict[str, Any]) -> dict[str, Any]:
    """What a template sees of a record: its fields, and ``prompt`` (its last user turn's text)."""
    context = dict(record)
    messages = record.get("messages")
    if isinstance(messages, list):
        users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            context["prompt"] = users[-1]
    return context


def _add(total: Summary, got: Summary) -> None:
    total.read += got.read
    total.enqueued += got.enqueued
    total.skipped += got.skipped
    total.rejected += got.rejected
    total.clipped += got.clipped
    total.rejected_by_reason.update(got.rejected_by_reason)
    total.fatal = total.fatal or got.fatal


class _Tail:
    """A file read as it grows: the complete lines past what was read, with their place."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.line = path, 0, 0

    def read(self) -> list[tuple[str, dict[str, Any]]]:
        if not self.path.exists():
            return []
        found = []
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            for line in fh:
                if not line.endswith(b"\n"):
                    break  # the collector is writing it
                self.offset += len(line)
                self.line += 1
                try:
                    record = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # the collector writes whole JSON lines; verify names any other
                if isinstance(record, dict):
                    found.append((f"{self.path}:{self.line}", record))
        return found
