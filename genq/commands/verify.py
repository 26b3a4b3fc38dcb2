"""`genq verify`: the audit of docs/design.md's first invariant, on Redis and the files on disk.

Every job a dataset should have (every row of its source files × samples, or, without files,
every job its ``enqueued`` bitmap names) must be exactly one of: queued, in flight, retrying, in
raw_responses.jsonl, or in errors.jsonl. Redis can go back in time (an older snapshot, AOF
``everysec`` after an OS crash, a replica promoted before it had the last writes); genq recovers
from any earlier state, and this says whether it has: what is missing (with the command that
puts it back), what is on disk twice. Fast on 10M jobs: a few bitmaps of one bit per job, one
pass over each file, and the queues read in bulk — never a round trip per job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import orjson
import redis

from genq import datasets, provenance, sources, token_counts
from genq.bitmaps import is_set, set_bits
from genq.commands.run_redis import has_private_redis, redis_of, require_datasets
from genq.connection import connect, redact
from genq.entries import BadEntry, quarantined, read_entry
from genq.keys import Keys
from genq.producer import stage
from genq.queues import rq_queue
from genq.schema import (
    ERRORS,
    ID_AT_START,
    RAW,
    REJECTED_SAMPLES,
    bit_index,
    extends,
    parse_record_id,
    rejudged,
    supersedes,
)
from genq.settings import option, redis_options

SUPERSEDE_KEYS = (b'"extends":', b'"rejudged":')
EXAMPLES = 10


class Bits:
    """A growable bitmap of job indexes."""

    def __init__(self, data: bytes = b"") -> None:
        self.data = bytearray(data)

    def set(self, index: int) -> bool:
        """Set the bit; True if it was set already."""
        byte, bit = divmod(index, 8)
        if byte >= len(self.data):
            self.data.extend(bytes(byte + 1 - len(self.data)))
        mask = 0x80 >> bit  # Redis's bit order: the first bit is the highest of byte 0
        was = bool(self.data[byte] & mask)
        self.data[byte] |= mask
        return was

    def count(self) -> int:
        return int.from_bytes(self.data, "big").bit_count()


@dataclass
class Audit:
    """One dataset's verdict."""

    dataset: str
    expected: int
    states: dict[str, int] = field(default_factory=dict)
    rejected: int = 0
    in_source: int = 0  # rows enqueue --max-queued has not read yet (still in their files)
    unread: int = 0  # rows past the last enqueue's --limit: not read yet, not missing
    limit: int | None = None  # that --limit
    missing: list[str] = field(default_factory=list)
    missing_indexes: list[int] = field(default_factory=list)  # their bit indexes (--repair)
    duplicated: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    extended: int = 0  # records superseded by a longer one (genq retry --truncated)
    bad_extensions: list[str] = field(default_factory=list)  # lines that break the supersede rule
    command: str = ""
    repair: str = ""  # reopens the missing jobs, so that `command` makes them again
    quarantined: int = 0  # stream entries that were not a worker's, in the dead letter (genq failed)
    bad_entries: int = 0  # such entries still in the stream: the collector moves them there

    @property
    def ok(self) -> bool:
        return not self.missing and not self.duplicated and not self.unreadable and not self.bad_extensions

    def as_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "expected": self.expected,
            **self.states,
            "rejected_at_enqueue": self.rejected,
            "still_in_source": self.in_source,
            "not_read_yet": self.unread,
            "missing": len(self.missing),
            "missing_examples": self.missing[:EXAMPLES],
            "duplicated": len(self.duplicated),
            "duplicated_examples": self.duplicated[:EXAMPLES],
            "unreadable_lines": self.unreadable[:EXAMPLES],
            "extended": self.extended,
            "bad_extensions": self.bad_extensions[:EXAMPLES],
            "quarantined_entries": self.quarantined,
            "bad_entries_in_stream": self.bad_entries,
            "put_back": self.command if self.missing else None,
            "ok": self.ok,
        }


def audit(conn: redis.Redis, keys: Keys, out: Path, name: str, files: list[Path] | None = None) -> Audit:
    settings = datasets.load_all(conn, keys).get(name)
    if settings is None:
        raise click.ClickException(f"no dataset {name!r} in namespace {keys.namespace!r}")
    samples = settings.samples
    queue = rq_queue(conn, keys, name)
    with conn.pipeline(transaction=False) as pipe:
        pipe.get(keys.enqueued(name))
        pipe.get(keys.rejected(name))
        pipe.hget(keys.in_source, name)
        pipe.exists(keys.enqueuing(name))
        pipe.lrange(queue.key, 0, -1)
        pipe.lrange(queue.intermediate_queue_key, 0, -1)
        pipe.zrange(queue.started_job_registry.key, 0, -1)
        pipe.zrange(queue.scheduled_job_registry.key, 0, -1)
        enqueued, rejected, in_source, enqueuing, queued, moving, started, scheduled = pipe.execute()
    limit = provenance.limited_to(conn, keys, name)
    unread = 0
    if files:
        rows = sum(sources.count(path) for path in files)
        if limit is not None and rows > limit:  # the rest is for the next enqueue without --limit
            rows, unread = limit, rows - limit
        expected_n = rows * samples
    # Rows still in the files count as on their way only while an enqueue is running: after Redis
    # went back in time, in_source may describe an enqueue that is long gone.
    result = Audit(name, 0, in_source=int(in_source or 0) if enqueuing else 0, unread=unread, limit=limit)

    def index_of(record_id: str) -> int | None:
        parsed = parse_record_id(record_id, name, samples)
        return bit_index(*parsed, samples) if parsed else None

    def rq_index(job_id: bytes) -> int | None:  # queue lists hold job ids, registries job_id:execution
        return index_of(keys.record_id(job_id.decode().split(":")[0]) or "")

    streamed, result.bad_entries = _stream_indexes(conn, keys, name, samples, enqueued or b"")
    result.quarantined = quarantined(conn, keys).get(name, 0)
    states: dict[str, Bits] = {
        name_: Bits() for name_ in ("queued", "in_flight", "retrying", "done", "failed")
    }
    for state, indexes in (
        ("queued", map(rq_index, [*queued, *moving])),
        ("in_flight", [*map(rq_index, started), *streamed]),
        ("retrying", map(rq_index, scheduled)),
    ):
        for index in indexes:
            if index is not None:
                states[state].set(index)
    extended: set[int] = set()
    # rejected_samples.jsonl first: a record judged again (retry --check-failed) may land in
    # raw_responses.jsonl, after its check_failed line there.
    for state, filename in (("done", REJECTED_SAMPLES), ("done", RAW), ("failed", ERRORS)):
        path = out / name / filename
        for line_no, record_id, extension in _ids(path):
            index = index_of(record_id) if record_id is not None else None
            if index is None:
                result.unreadable.append(f"{path}:{line_no}")
            elif states[state].set(index) and state == "done":
                if extension:
                    extended.add(index)
                else:
                    result.duplicated.append(record_id)  # type: ignore[arg-type]
            elif extension and state == "done":
                result.bad_extensions.append(f"{path}:{line_no}: {record_id} extends no record before it")
    if extended:
        result.extended = len(extended)
        result.bad_extensions += _broken_extensions(out / name / RAW, extended, index_of)
    # Set arithmetic on whole bitmaps as integers: fast on millions of jobs.
    size = max(len(enqueued or b""), len(rejected or b""), *(len(b.data) for b in states.values()))
    if files:
        size = max(size, (expected_n + 7) // 8)
        expected = ((1 << expected_n) - 1) << (size * 8 - expected_n)
        if settings.first_draw < samples:  # --accept K: K a row at first, then what was drawn
            first = ((1 << settings.first_draw) - 1) << (samples - settings.first_draw)  # a row's first K
            expected = first * ((1 << expected_n) - 1) // ((1 << samples) - 1) << (size * 8 - expected_n)
            expected |= _int(enqueued or b"", size)
    else:
        expected = _int(enqueued or b"", size)
    made = _stage_rows(conn, keys, out, settings) if not files else None
    if made is not None:  # a stage: a row for each record of its source on disk, too
        size = max(size, len(made.data))
        expected = _int(enqueued or b"", size) | _int(bytes(made.data), size)
    refused = _int(rejected or b"", size)
    somewhere = 0  # queued, in flight, retrying or on disk
    for bits in states.values():
        somewhere |= _int(bytes(bits.data), size)
    accounted = refused | somewhere
    result.expected = expected.bit_count()
    result.states = {k: v.count() for k, v in states.items()}
    # A row refused once and enqueued later (say with --clip-max-new-tokens) is counted where it is now.
    result.rejected = (expected & refused & ~somewhere).bit_count()
    missing = expected & ~accounted
    result.missing_indexes = _set_bits(missing, size)
    result.missing = [
        f"{name}-{row}-{sample}" if samples > 1 else f"{name}-{row}"
        for row, sample in (divmod(i, samples) for i in result.missing_indexes)
    ]
    if result.in_source and len(result.missing) <= result.in_source:
        result.missing, result.missing_indexes = [], []  # enqueue --max-queued is still feeding them in
    given = _given(settings, files, out)
    result.command = f"genq enqueue {given} --dataset {name}"
    result.repair = f"genq verify --out {out} {given} --dataset {name} --repair"
    return result


def reopen(conn: redis.Redis, keys: Keys, out: Path, result: Audit) -> None:
    """--repair: clear the missing jobs' bits (enqueued, done, failed), so that the enqueue that
    made them makes them again — those jobs and no other: every other job is on disk, queued, in
    flight or retrying, and keeps its bits. The token counters, which counted the lost records
    too, are derived anew from the files in the same step. Refused while an enqueue of the
    dataset runs (its bits are moving).

    A collector may be writing meanwhile: it appends a line, then counts it in Redis. The counters
    are watched from before the files are read, so a count that lands in between sends the repair
    round again — a line is counted by the recount or by the collector, never both, never neither."""
    if conn.exists(keys.enqueuing(result.dataset)):
        raise click.ClickException(
            f"{result.dataset}: an enqueue of it is running; repair once it has ended (nothing was changed)"
        )

    def repair(pipe: redis.client.Pipeline) -> None:
        lines = [
            obj
            for name in (RAW, REJECTED_SAMPLES)
            for obj in _lines(out / result.dataset / name)
            if isinstance(obj, dict)
        ]
        pipe.multi()
        for key in (keys.enqueued, keys.done, keys.failed):
            set_bits(pipe, key(result.dataset), result.missing_indexes, 0)
        token_counts.recount(pipe, keys, result.dataset, lines)

    conn.transaction(repair, keys.tokens(result.dataset))


def _lines(path: Path) -> Iterator[Any]:
    """Each whole JSON line of a file (none if it is gone); a torn or broken one is passed over."""
    if not path.is_file():
        return
    with path.open("rb") as fh:
        for line in fh:
            try:
                yield orjson.loads(line)
            except orjson.JSONDecodeError:
                continue


def _given(settings: datasets.DatasetSettings, files: list[Path] | None, out: Path) -> str:
    """What the enqueue that makes the dataset's jobs again is given: its files, or its source."""
    if files:
        return " ".join(map(str, files))
    source = settings.prompting.get("from_dataset")
    if source:
        return f"--from-dataset {source.get('dataset')} --from-out {out} --template <its template>"
    return " ".join(settings.sources) or "<its files>"


def _stage_rows(conn: redis.Redis, keys: Keys, out: Path, settings: datasets.DatasetSettings) -> Bits | None:
    """A stage's rows: one for each record of its source on disk that passes its filters (None: the
    dataset is no stage)."""
    source = settings.prompting.get("from_dataset")
    if not source:
        return None
    made = Bits()
    upstream = datasets.load_all(conn, keys).get(source.get("dataset", ""))
    for index in stage.expected_indexes(out, settings, upstream.samples) if upstream else ():
        made.set(index)
    return made


def _int(data: bytes, size: int) -> int:
    """A Redis bitmap as an integer of ``size`` bytes (bit 0 of the bitmap is its highest bit)."""
    return int.from_bytes(data.ljust(size, b"\0"), "big")


def _set_bits(value: int, size: int) -> list[int]:
    """The bitmap indexes of the bits set in ``value`` (usually few: only the nonzero bytes are read)."""
    data = value.to_bytes(size, "big")
    out: list[int] = []
    pos = size - len(data.lstrip(b"\0"))
    while pos < size:
        if data[pos]:
            out.extend(pos * 8 + b for b in range(8) if data[pos] & (0x80 >> b))
        pos += 1
    return out


def _stream_indexes(
    conn: redis.Redis, keys: Keys, name: str, samples: int, known: bytes
) -> tuple[list[int], int]:
    """The job indexes of this dataset's results still in its streams (a checked dataset's first in
    its unchecked one), and how many of their entries
    are not a worker's (genq/entries.py: the collector moves those to the dead letter), among them
    any of a job never enqueued (``known``: the ``enqueued`` bitmap)."""
    indexes, bad = [], 0
    entries = conn.xrange(keys.results(name)) + conn.xrange(keys.unchecked(name))  # on their way to disk
    for _, fields in entries:
        try:
            index = read_entry(fields, name, samples).index
        except BadEntry:
            bad += 1
            continue
        if is_set(known, index):
            indexes.append(index)
        else:
            bad += 1
    return indexes, bad


def _ids(path: Path) -> Iterator[tuple[int, str | None, bool]]:
    """(line number, record id, whether the line extends an earlier one) of each line; the id is
    read off the line's start when genq wrote it, parsed otherwise; None for a line without one.
    Only a line that holds the bytes of the key ``"extends":`` or ``"rejudged":`` is parsed for it
    (in a string value its quotes would be escaped)."""
    if not path.exists():
        return
    with path.open("rb") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            match = ID_AT_START.match(line)
            if match and not any(key in line for key in SUPERSEDE_KEYS):
                yield line_no, match.group(1).decode(), False
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                yield line_no, None, False
                continue
            if not isinstance(obj, dict):
                yield line_no, None, False
                continue
            record_id = obj.get("id") if isinstance(obj.get("id"), str) else None
            yield line_no, record_id, supersedes(obj)


def _broken_extensions(path: Path, extended: set[int], index_of: Callable[[str], int | None]) -> list[str]:
    """The lines of ``extended`` ids that break the supersede rule (genq/schema.py ``extends``): an
    extension must begin with the output of its id's line before it, and say how long that was."""
    before: dict[int, list[int]] = {}  # index -> the output_ids of its line so far
    broken = []
    with path.open("rb") as fh:
        for line_no, line in enumerate(fh, start=1):
            match = ID_AT_START.match(line)
            index = index_of(match.group(1).decode()) if match else None
            if index not in extended:
                continue
            obj = orjson.loads(line)
            ids = obj.get("output_ids") or []
            was = before.get(index)
            if was is not None and rejudged(obj) is not None:  # judged again: the same output
                if ids != was:
                    broken.append(f"{path}:{line_no}: {obj['id']} judged again is not the output it had")
            elif was is not None and (extends(obj) != len(was) or ids[: len(was)] != was):
                broken.append(
                    f"{path}:{line_no}: {obj['id']} does not begin with the {len(was)} output tokens of the "
                    "record it extends"
                )
            before[index] = ids
    return broken


def print_audit(result: Audit, reopened: bool = False) -> None:
    """The audit in lines; ``reopened``: its missing jobs were just reopened (--repair), so it is
    said what was found and done, not NOT OK."""
    states = ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in result.states.items())
    click.echo(
        f"{result.dataset}: {result.expected:,} expected: {states}; rejected at enqueue {result.rejected:,}"
    )
    if result.in_source:
        click.echo(
            f"{result.dataset}: {result.in_source:,} still in its files (enqueue --max-queued is running)"
        )
    if result.unread:
        click.echo(
            f"{result.dataset}: {result.unread:,} rows after the first {result.limit:,} not read yet (the "
            f"last enqueue had --limit {result.limit}): {result.command} without --limit enqueues them"
        )
    if result.missing:
        shown = ", ".join(result.missing[:EXAMPLES])
        click.echo(f"{result.dataset}: MISSING {len(result.missing):,} (e.g. {shown})", err=True)
        if not reopened:
            click.echo(
                f"{result.dataset}: put them back with: {result.repair}, then {result.command} (or the same "
                "`genq run`) again",
                err=True,
            )
    if result.duplicated:
        shown = ", ".join(result.duplicated[:EXAMPLES])
        click.echo(f"{result.dataset}: DUPLICATED {len(result.duplicated):,} lines (e.g. {shown})", err=True)
    if result.quarantined or result.bad_entries:
        click.echo(
            f"{result.dataset}: {result.quarantined:,} stream entries that were not a worker's result "
            f"quarantined, {result.bad_entries:,} more in the stream (`genq failed` lists them)",
            err=True,
        )
    if result.extended:
        click.echo(f"{result.dataset}: {result.extended:,} records extended (each id's last line counts)")
    for where in result.bad_extensions[:EXAMPLES]:
        click.echo(where, err=True)
    for where in result.unreadable[:EXAMPLES]:
        click.echo(f"{where}: a line without a record id of this dataset", err=True)
    if reopened and not result.duplicated and not result.unreadable:
        click.echo(f"{result.dataset}: REPAIRED: the missing jobs are queued again (OK once they are made)")
    else:
        click.echo(f"{result.dataset}: {'OK' if result.ok else 'NOT OK'}")


@click.command("verify")
@click.argument("files", nargs=-1)
@option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="The output folder.")
@option(
    "--dataset",
    env="GENQ_VERIFY_DATASET",  # not GENQ_DATASET: that names the dataset enqueue writes
    default=None,
    help="The dataset (default: FILES' first stem, or every dataset).",
)
@option(
    "--repair",
    is_flag=True,
    help="Reopen the missing jobs (e.g. of a file removed by hand): the same enqueue then makes them again.",
)
@option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@redis_options
def verify_command(
    files: tuple[str, ...],
    out: Path,
    dataset: str | None,
    repair: bool,
    as_json: bool,
    redis_url: str,
    namespace: str,
) -> None:
    """Check that every job of a dataset is exactly one of queued, in flight, retrying, in
    raw_responses.jsonl or in errors.jsonl: every row of FILES (× samples), or without FILES every
    job Redis knows was enqueued. Prints what is missing (and the command that puts it back) and
    what is on disk twice; exits 1 when anything is."""
    try:
        paths = sources.expand(list(files)) if files else None
    except sources.SourceError as exc:
        raise click.ClickException(str(exc)) from exc
    # A `genq run` folder brings its private Redis and namespace; only --redis on the command line
    # names another (an exported GENQ_REDIS_URL is every command's Redis, not this folder's).
    source = click.get_current_context().get_parameter_source("redis_url")
    private = source != click.core.ParameterSource.COMMANDLINE and has_private_redis(out)
    with redis_of(out if private else None, redis_url, namespace) as (url, auth, namespace):
        keys = Keys(namespace)
        conn = connect(url, **auth)
        require_datasets(conn, namespace, url)
        known = datasets.load_all(conn, keys)
        names = [dataset or Path(files[0]).stem] if dataset or paths else sorted(known)
        for name in names:
            if name not in known:
                raise click.ClickException(
                    f"no dataset {name!r} in namespace {namespace!r} on {redact(url)}: nothing to check "
                    f"it against; datasets there: {', '.join(sorted(known))} (--dataset)"
                )
        results = [audit(conn, keys, out, name, paths) for name in names]
        reopened = [r for r in results if repair and r.missing]
        for result in reopened:
            reopen(conn, keys, out, result)
        sources_of = {name: " ".join(files) or " ".join(known[name].sources) for name in names}
    if as_json:
        click.echo(orjson.dumps([r.as_dict() for r in results], option=orjson.OPT_INDENT_2).decode())
    else:
        for result in results:
            print_audit(result, result in reopened)
    for result in reopened:
        click.echo(
            f"{result.dataset}: reopened {len(result.missing):,} missing jobs; make them with the same `genq "
            f"enqueue {sources_of[result.dataset]} --dataset {result.dataset} ...` (or `genq run`) again",
            err=True,
        )
    # Missing jobs reopened are on their way back once the enqueue runs: not a failure of --repair.
    if not all(r.ok or (r in reopened and not r.duplicated and not r.unreadable) for r in results):
        raise SystemExit(1)
