"""`genq stats DIR`: what an output folder holds, from the files alone (no Redis).

Any folder, genq's or another tool's: every ``*.jsonl`` under DIR is read, and a file's dataset
is its folder (``DIR/<dataset>/raw_responses.jsonl``; files directly in DIR belong to DIR's own
name). Each line goes to the first reader that knows its shape:

- ``genq``:      genq's records (``schema``, top-level ``prompt_tokens`` / ``completion_tokens``)
- ``error``:     a failure (genq's ``errors.jsonl``, or any line whose ``error`` is set)
- ``openai``:    chat completions, ``usage.{prompt,completion}_tokens``, ``choices[0]``
- ``generate``:  SGLang ``/generate`` results, token counts in ``meta_info`` or at the top level
- ``tokenized``: ``input_ids`` with ``loss_mask``: completion tokens are those under a 1

A line no reader knows, or a known shape without its token counts, is counted as unrecognized
and reported with ``file:line`` — never read as zero tokens (a stats script that silently reported
zero tokens after a format change is why this exists).
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
import orjson
from rich.table import Table

from genq import datasets as dataset_settings
from genq import terminal
from genq.schema import EXPORTS, RAW, REJECTED_SAMPLES, REJECTS, cut_short, extends, rejudged
from genq.settings import option

MAX_EXAMPLES = 5
SHORT_LISTED = 100  # rows of the prompts short of K listed by stats --json


@dataclass
class Rec:
    """The numbers of one record, whatever its shape."""

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    latency_s: float | None = None
    capped: bool | None = None  # stopped below the max_new_tokens asked for (genq's finish_length)
    finished_at: float | None = None  # epoch seconds
    attempts: int | None = None  # sends it took
    extends: int | None = None  # the completion tokens of the record it supersedes (genq/schema.py)
    pieces: int | None = None  # requests its output was made in (--continue-to)
    id: str | None = None  # genq's record id: a record beats an earlier error of its id


class Unreadable(Exception):
    """A line of a known shape whose numbers cannot be found."""


# -- readers: each returns None when the line is not its shape ---------------------------------


def _dig(obj: Any, *path: str | int) -> Any:
    for step in path:
        if isinstance(step, int):
            obj = obj[step] if isinstance(obj, list) and len(obj) > step else None
        else:
            obj = obj.get(step) if isinstance(obj, dict) else None
    return obj


def _count(value: Any, shape: str, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise Unreadable(f"{shape} record without an integer {name}")


def _finish(value: Any) -> str | None:
    """``"stop"``, or SGLang's ``{"type": "stop", ...}``."""
    value = value.get("type") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def _latency(*candidates: Any) -> float | None:
    for value in candidates:
        if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
            return float(value)
    return None


def _epoch(value: Any) -> float | None:
    """An ISO time (genq's ``finished_at``, UTC when it names no zone) as epoch seconds; None when
    absent or unreadable."""
    if not isinstance(value, str):
        return None
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        return None
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def read_genq(obj: dict) -> Rec | None:
    if not isinstance(obj.get("schema"), int) or "id" not in obj or obj.get("error"):
        return None
    return Rec(
        _count(obj.get("prompt_tokens"), "genq", "prompt_tokens"),
        _count(obj.get("completion_tokens"), "genq", "completion_tokens"),
        _finish(obj.get("finish_reason")),
        _latency(obj.get("latency_s")),
        cut_short(obj),
        _epoch(obj.get("finished_at")),
        _positive(obj.get("attempts")),
        extends(obj),
        _positive(obj.get("pieces")),
        obj["id"] if isinstance(obj["id"], str) else None,
    )


def read_openai(obj: dict) -> Rec | None:
    if not isinstance(obj.get("choices"), list):
        return None
    return Rec(
        _count(_dig(obj, "usage", "prompt_tokens"), "openai", "usage.prompt_tokens"),
        _count(_dig(obj, "usage", "completion_tokens"), "openai", "usage.completion_tokens"),
        _finish(_dig(obj, "choices", 0, "finish_reason")),
        _latency(obj.get("latency_s"), obj.get("latency")),
    )


def read_generate(obj: dict) -> Rec | None:
    meta = obj.get("meta_info")
    if isinstance(meta, dict):
        where, src = "meta_info.", meta
    elif "completion_tokens" in obj:
        where, src = "", obj
    else:
        return None
    return Rec(
        _count(src.get("prompt_tokens"), "generate", where + "prompt_tokens"),
        _count(src.get("completion_tokens"), "generate", where + "completion_tokens"),
        _finish(src.get("finish_reason") or obj.get("finish_reason")),
        _latency(obj.get("latency_s"), src.get("e2e_latency"), obj.get("latency")),
    )


def read_tokenized(obj: dict) -> Rec | None:
    ids, mask = obj.get("input_ids"), obj.get("loss_mask")
    if ids is None or mask is None:
        return None
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
        raise Unreadable("tokenized row whose input_ids and loss_mask are not lists of one length")
    completion = sum(1 for m in mask if m == 1)
    return Rec(len(ids) - completion, completion)


READERS: list[tuple[str, Callable[[dict], Rec | None]]] = [
    ("genq", read_genq),
    ("openai", read_openai),
    ("generate", read_generate),
    ("tokenized", read_tokenized),
]


def error_class(obj: dict) -> str | None:
    """The class of a failure line (genq's ``error`` string, or an API's ``{"error": {...}}``)."""
    error = obj.get("error")
    if not error:
        return None
    if isinstance(error, dict):
        return str(error.get("type") or error.get("code") or "error")
    return str(error)


def error_message(obj: dict) -> str | None:
    """What a failure line says happened (genq's ``message``, or an API error's ``message``)."""
    error = obj.get("error")
    message = error.get("message") if isinstance(error, dict) else obj.get("message")
    return message if isinstance(message, str) and message else None


# -- one dataset --------------------------------------------------------------------------------


# Widths of a Timeline's buckets in seconds, each dividing the next: buckets coarsen exactly.
WIDTHS_S = (1, 2, 10, 30, 60, 120, 600, 1800, 3600, 7200, 21600, 43200, 86400)
MAX_BUCKETS = 4096  # a run of days is kept at the first width that holds it in this many


class Timeline:
    """Completion tokens by when they finished, in buckets of the finest width that keeps at most
    MAX_BUCKETS of them: a 30-s run is seen by the second, a week-long one by the hour, in bounded
    memory whatever the run's length."""

    def __init__(self) -> None:
        self.width_s = WIDTHS_S[0]
        self.buckets: Counter = Counter()  # bucket (epoch seconds // width_s) -> tokens

    def add(self, at: float, tokens: int) -> None:
        self.buckets[int(at // self.width_s)] += tokens
        while len(self.buckets) > MAX_BUCKETS and self.width_s < WIDTHS_S[-1]:
            self.coarsen()

    def coarsen(self) -> None:
        wider = WIDTHS_S[WIDTHS_S.index(self.width_s) + 1]
        merged: Counter = Counter()
        for bucket, tokens in self.buckets.items():
            merged[bucket * self.width_s // wider] += tokens
        self.width_s, self.buckets = wider, merged

    def __bool__(self) -> bool:
        return bool(self.buckets)


@dataclass
class DatasetStats:
    records: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    lengths: list[int] = field(default_factory=list)
    superseded: list[int] = field(default_factory=list)  # lengths of records an extension superseded
    continued: int = 0  # records continued in pieces whose model stopped
    failed_ids: set[str] = field(default_factory=set)  # ids of errors no record of theirs followed
    rejected: int | None = None  # jobs of the rows enqueue rejected (rejected.jsonl beside the records)
    latencies: list[float] = field(default_factory=list)
    finish_reasons: Counter = field(default_factory=Counter)
    capped: int = 0
    capped_known: int = 0  # records whose shape says whether the server capped them (genq's)
    timed: int = 0  # records that say when they finished
    finished: Timeline = field(default_factory=lambda: Timeline())  # completion tokens by when finished
    first_at: float | None = None
    last_at: float | None = None
    attempts: Counter = field(default_factory=Counter)  # sends a record took -> records
    shapes: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    error_examples: dict[str, str] = field(default_factory=dict)  # class -> its first message
    unrecognized: int = 0
    examples: list[str] = field(default_factory=list)
    # A checked dataset's (genq check): verdicts by status, and per prompt (row) its samples filed
    # and how many of them were accepted; ``accept``: (K, M) from its settings beside the files.
    verdicts: Counter = field(default_factory=Counter)
    per_prompt: dict[int, list[int]] = field(default_factory=dict)
    accept: tuple[int, int] | None = None

    def add_line(self, line: bytes, where: str) -> None:
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            return self._unrecognized(where, "not JSON")
        if not isinstance(obj, dict):
            return self._unrecognized(where, f"a JSON {type(obj).__name__}, not an object")
        if rejudged(obj) is not None:  # judged again: a new verdict for a record counted already
            return self._verdict(obj, again=True)
        try:
            for shape, reader in READERS:
                rec = reader(obj)
                if rec is not None:
                    self._verdict(obj)
                    return self._add(shape, rec)
        except Unreadable as exc:
            return self._unrecognized(where, str(exc))
        error = error_class(obj)
        if error is not None:
            if isinstance(obj.get("id"), str):
                self.failed_ids.add(obj["id"])
            self.errors[error] += 1
            message = error_message(obj)
            if message is not None:
                self.error_examples.setdefault(error, message)
            return None
        keys = ", ".join(list(obj)[:6])
        return self._unrecognized(where, f"unknown shape (keys: {keys})")

    def _add(self, shape: str, rec: Rec) -> None:
        new = rec.completion_tokens
        if rec.extends is None:
            self.shapes[shape] += 1
            self.records += 1
            self.prompt_tokens += rec.prompt_tokens
        else:  # it supersedes a record counted already, which ended on length (the supersede rule)
            self.superseded.append(rec.extends)
            self.finish_reasons["length"] -= 1
            new -= rec.extends
        self.completion_tokens += new
        self.failed_ids.discard(rec.id)  # errors.jsonl sorts before raw_responses.jsonl: read first
        if (rec.pieces or 1) > 1 and rec.finish_reason != "length":
            self.continued += 1
        self.lengths.append(rec.completion_tokens)
        self.finish_reasons[rec.finish_reason or "unknown"] += 1
        if rec.capped is not None and rec.extends is None:
            self.capped += rec.capped
            self.capped_known += 1
        if rec.latency_s is not None:
            self.latencies.append(rec.latency_s)
        if rec.attempts is not None:
            self.attempts[rec.attempts] += 1
        if rec.finished_at is not None:
            self.timed += 1
            self.finished.add(rec.finished_at, new)
            at = rec.finished_at
            self.first_at = at if self.first_at is None else min(at, self.first_at)
            self.last_at = at if self.last_at is None else max(at, self.last_at)

    def _verdict(self, obj: dict, again: bool = False) -> None:
        """A verdict filed; ``again``: one that takes the place of the sample's check_failed verdict
        (genq retry --check-failed), whichever file was read first."""
        check, row = obj.get("check"), obj.get("row")
        if not isinstance(check, dict) or not isinstance(row, int) or isinstance(row, bool):
            return
        status = str(check.get("status"))
        self.verdicts[status] += 1
        counts = self.per_prompt.setdefault(row, [0, 0])
        if again:
            self.verdicts["check_failed"] -= 1
        else:
            counts[0] += 1
        counts[1] += status == "accepted"

    def check(self) -> dict[str, Any] | None:
        """A checked dataset's check stage from its files: verdicts by status, samples filed per
        prompt, and under --accept K --max-samples M the prompts that reached K and those that hit
        M without K (their rows, the first SHORT_LISTED of them)."""
        if not self.verdicts:
            return None
        prompts = len(self.per_prompt)
        out: dict[str, Any] = {
            "verdicts": dict((+self.verdicts).most_common()),
            "prompts": prompts,
            "samples_per_prompt": round(sum(d for d, _ in self.per_prompt.values()) / prompts, 2),
        }
        if self.accept is not None:
            k, m = self.accept
            short = sorted(row for row, (drawn, ok) in self.per_prompt.items() if ok < k and drawn >= m)
            out.update(
                accept=k,
                max_samples=m,
                prompts_with_k=sum(ok >= k for _, ok in self.per_prompt.values()),
                short_of_k=len(short),
                short_of_k_rows=short[:SHORT_LISTED],
            )
        return out

    def ledger(self) -> dict[str, int] | None:
        """Where each row read went, from the files alone (genq's records only): stopped,
        continued, cut (ended on length), failed (errors with no record after them), rejected
        (rejected.jsonl, where `genq run` wrote one); ``read`` is their sum."""
        if set(self.shapes) - {"genq"} or not self.records and not self.failed_ids:
            return None
        length = self.finish_reasons["length"]
        counts = {
            "stopped": self.records - length - self.continued,
            "continued": self.continued,
            "cut": length,
            "failed": len(self.failed_ids),
        }
        if self.rejected is not None:
            counts["rejected"] = self.rejected
        return {**counts, "read": sum(counts.values())}

    def record_lengths(self) -> list[int]:
        """The completion tokens of each record, superseded ones left out."""
        if not self.superseded:
            return self.lengths
        left = Counter(self.superseded)
        kept = []
        for n in self.lengths:
            if left[n]:
                left[n] -= 1
            else:
                kept.append(n)
        return kept

    def _unrecognized(self, where: str, why: str) -> None:
        self.unrecognized += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {why}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "avg_completion_tokens": round(self.completion_tokens / self.records, 1)
            if self.records
            else None,
            "completion_tokens_percentiles": percentiles(self.record_lengths()),
            "finish_reasons": dict((+self.finish_reasons).most_common()),
            "capped": self.capped,
            "latency_s": percentiles(self.latencies),
            "shapes": dict(self.shapes.most_common()),
            "errors": dict(self.errors.most_common()),
            "ledger": self.ledger(),
            "check": self.check(),
            "unrecognized": {"lines": self.unrecognized, "examples": self.examples},
        }


def percentiles(values: list[float]) -> dict[str, float] | None:
    """p50/p90/p99 (inclusive method: within the data's range), min and max; None without data."""
    if not values:
        return None
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {
        "min": min(values),
        "p50": round(cuts[49], 3),
        "p90": round(cuts[89], 3),
        "p99": round(cuts[98], 3),
        "max": max(values),
    }


# -- a folder -----------------------------------------------------------------------------------


def files(root: Path) -> Iterator[tuple[str, Path]]:
    """(dataset, file) for every ``*.jsonl`` under ``root``, hidden folders (.redis, .logs) aside,
    and genq's own exports beside the records they were made from (counting them would count
    those records twice)."""
    for path in sorted(root.rglob("*.jsonl")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if _genq_export(path) or _genq_rejects(path):
            continue
        folder = rel.parent.as_posix()
        yield (root.resolve().name if folder == "." else folder), path


def _genq_export(path: Path) -> bool:
    """A file `genq export` wrote beside the records it was made from: an export's name, next to
    raw_responses.jsonl, its first line one of this dataset's job ids (`<dataset>-<row>[-<k>]`,
    the folder being the dataset). Another tool's file of the same name is read as usual."""
    if path.name not in EXPORTS.values() or not (path.parent / RAW).exists():
        return False
    with path.open("rb") as fh:
        first = fh.readline()
    try:
        job_id = orjson.loads(first).get("id")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    pattern = rf"{re.escape(path.parent.name)}-\d+(-\d+)?"
    return isinstance(job_id, str) and re.fullmatch(pattern, job_id) is not None


def _genq_rejects(path: Path) -> bool:
    """The rows `genq run`'s enqueue rejected (producer/rejects.py), beside the records: no records."""
    if path.name != REJECTS:
        return False
    with path.open("rb") as fh:
        first = fh.readline()
    try:
        entry = orjson.loads(first)
    except orjson.JSONDecodeError:
        return False
    return isinstance(entry, dict) and {"dataset_row", "reason"} <= entry.keys()


def _jobs(rejects: Path) -> int:
    """The jobs of the rows in a rejected.jsonl: its lines x the dataset's samples (its settings
    beside it; one sample without them)."""
    try:
        settings = dataset_settings.read_file(rejects.parent)
    except ValueError:
        settings = None
    with rejects.open("rb") as fh:
        rows = sum(1 for line in fh if line.strip())
    return rows * (settings.samples if settings is not None else 1)


def _accept(folder: Path) -> tuple[int, int] | None:
    """(K, M) of a dataset enqueued with --accept K --max-samples M, from its settings beside it."""
    try:
        settings = dataset_settings.read_file(folder)
    except ValueError:
        return None
    if settings is None or not settings.check.get("accept"):
        return None
    return settings.check["accept"], settings.samples


def folder_stats(root: Path) -> dict[str, DatasetStats]:
    out: dict[str, DatasetStats] = {}
    for dataset, path in files(root):
        stats = out.setdefault(dataset, DatasetStats())
        rejects = path.with_name(REJECTS)
        if stats.rejected is None and rejects.is_file() and _genq_rejects(rejects):
            stats.rejected = _jobs(rejects)
        if stats.accept is None and path.name in (RAW, REJECTED_SAMPLES):
            stats.accept = _accept(path.parent)
        shown = path.relative_to(root).as_posix()
        with path.open("rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    stats.add_line(line, f"{shown}:{lineno}")
    return out


# -- the command --------------------------------------------------------------------------------


@click.command("stats")
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def stats_command(folder: Path, as_json: bool) -> None:
    """Per dataset in FOLDER, from the files alone: records, tokens, completion length percentiles,
    finish reasons, latency; genq's records and other tools' shapes alike. Lines of an unknown
    shape are counted and shown with file:line, never counted as zero tokens."""
    stats = folder_stats(folder)
    data = {"datasets": {name: s.as_dict() for name, s in stats.items()}}
    if as_json:
        click.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    console = terminal.console()
    if not stats:
        console.print(f"no *.jsonl files under {folder}")
        return
    console.print(_table(data["datasets"]))
    for name, d in data["datasets"].items():
        details = [f"finish: {_pairs(d['finish_reasons'])}", f"shapes: {_pairs(d['shapes'])}"]
        if d["latency_s"]:
            lat = d["latency_s"]
            details.append(f"latency s p50 {lat['p50']:.2f} p90 {lat['p90']:.2f} p99 {lat['p99']:.2f}")
        if d["errors"]:
            details.append(f"errors: {_pairs(d['errors'])}")
        if d["ledger"]:
            details.append(f"ledger: {_pairs(d['ledger'])}")
        if d["check"]:
            details.append(_check_line(d["check"]))
        console.print(f"[bold]{name}[/bold]  " + " · ".join(details), highlight=False, soft_wrap=True)
        if d["unrecognized"]["lines"]:
            console.print(
                f"  [yellow]{d['unrecognized']['lines']} unrecognized lines (not counted), e.g.[/yellow]",
                highlight=False,
            )
            for example in d["unrecognized"]["examples"]:
                console.print(f"    {example}", highlight=False, markup=False, soft_wrap=True)


def _check_line(check: dict[str, Any]) -> str:
    """The check stage in words: verdicts, samples a prompt, and under --accept how many reached K."""
    line = f"check: {_pairs(check['verdicts'])}, {check['samples_per_prompt']} samples a prompt"
    if "accept" in check:
        line += (
            f", {check['prompts_with_k']:,} of {check['prompts']:,} prompts with {check['accept']} accepted "
            f"(of at most {check['max_samples']} samples), {check['short_of_k']:,} short after "
            f"{check['max_samples']}"
        )
    return line


def _pairs(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in counts.items()) or "-"


def _table(datasets: dict[str, dict[str, Any]]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in (
        "dataset",
        "records",
        "prompt",
        "completion",
        "avg",
        "p50",
        "p90",
        "p99",
        "length",
        "capped",
        "unrecog.",
    ):
        table.add_column(col, justify="left" if col == "dataset" else "right", no_wrap=True)
    for name, d in datasets.items():
        pct = d["completion_tokens_percentiles"] or {}
        table.add_row(
            name,
            f"{d['records']:,}",
            f"{d['prompt_tokens']:,}",
            f"{d['completion_tokens']:,}",
            f"{d['avg_completion_tokens']:,.0f}" if d["avg_completion_tokens"] is not None else "-",
            *(f"{pct[p]:,.0f}" if pct else "-" for p in ("p50", "p90", "p99")),
            f"{d['finish_reasons'].get('length', 0):,}",
            f"{d['capped']:,}",
            f"{d['unrecognized']['lines']:,}",
        )
    return table
