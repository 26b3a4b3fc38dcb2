"""Enqueue: one RQ job per prompt and sample, idempotent, in pipelined batches, optionally bounded.

Rows flow through stages, each a generator, so a dataset is never whole in memory: read (sources,
formats) -> skip what is already enqueued or done (before any tokenization, so a resumed run only
re-reads) -> render conversations with the chat template, a batch at a time (one Jinja render
each, one batched encode in the Rust tokenizer) -> check the context length -> push. Each push is
one MULTI: the jobs and their bits in the dataset's ``enqueued`` bitmap land together, so a killed
enqueue never leaves a job without its bit (which would enqueue it twice on the next run) or a bit
without its job. With ``max_queued`` a push waits until the queue has room, so Redis holds at most
that many waiting jobs whatever the dataset's size. One enqueue of a dataset runs at a time
(producer/lease.py: its lease fences every push), and each source file's rows are checked against
the print of the rows enqueued from it before (producer/fingerprints.py), saved with every push.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import redis
from redis.client import Pipeline

from genq import datasets, provenance, rq_jobs, sources
from genq.bitmaps import is_set, set_bits
from genq.conversation import first_turn
from genq.keys import Keys
from genq.producer.context import Limits, check_fits, check_recipe, check_vocab
from genq.producer.fingerprints import Change, Fingerprints
from genq.producer.formats import Shape
from genq.producer.lease import Lease
from genq.producer.readers import Rejected, Row, read_dataset
from genq.producer.rejects import RejectsFile
from genq.queues import rq_queue
from genq.redis_errors import Outage, patiently
from genq.schema import JobSpec, bit_index, record_id
from genq.sources import SourceError
from genq.templates import ChatTemplate

if TYPE_CHECKING:
    from genq.producer.stage import StageSource

log = logging.getLogger("genq.enqueue")

BATCH = 1000
# A reject's reason, counted by its class: numbers and quoted values out, this long at most.
_NUMBER = re.compile(r"\d+")
_QUOTED_VALUE = re.compile(r"(?<=: )'[^']*'|\"[^\"]*\"")
REASON_CHARS = 120
RENDER_BATCH = 256  # conversations per apply_chat_template call
POLL_S = 0.05  # how often a full queue is looked at again (--max-queued): one LLEN

Report = Callable[[str], None]


@dataclass
class Options:
    """How one enqueue turns rows into jobs, beyond the sampling settings."""

    shape: Shape = field(default_factory=Shape)
    split: str | None = None
    config: str | None = None  # a Hugging Face dataset id's configuration
    limit: int | None = None  # only the first rows (--limit): a trial
    template: ChatTemplate | None = None
    think: dict[str, Any] | None = None
    keep_prompt: bool = True
    logprobs: int | None = None  # top-K log-probabilities per output token (genq/logprobs.py)
    limits: Limits = field(default_factory=Limits)
    clip: bool = False
    max_queued: int | None = None
    max_row_bytes: int = sources.MAX_ROW_BYTES
    # What an openai-batch row's own sampling is laid over before it is compared with the dataset's
    # (the command line's settings); None: the dataset's settings.
    row_base: dict[str, Any] | None = None
    # chat_template_kwargs a chat backend sends with each request (the server renders); with a
    # tokenizer they are the template's own (template.kwargs).
    server_kwargs: dict[str, Any] | None = None
    continue_to: int | None = None  # outputs continued in pieces up to this many tokens (worker/pieces.py)
    check: dict[str, Any] = field(default_factory=dict)  # the check stage (DatasetSettings.check)
    # A stage's source: another dataset's records, followed as they land (producer/stage.py).
    stage: StageSource | None = None

    def prompting(self) -> dict[str, Any]:
        """The dataset settings (decision 12) these options fix; defaults left out."""
        shape = self.shape
        values: dict[str, Any] = {
            "format": shape.format if shape.format != "auto" else None,
            "fields": shape.fields or None,
            "system_prompt": shape.system_prompt,
            "backend": "openai-chat" if shape.server_renders else None,
            "turns": "all" if shape.turns == "all" else None,
            "logprobs": self.logprobs,
            "tokenizer": self.template.name if self.template else None,
            "chat_template": self.template.fingerprint if self.template else None,
            "chat_template_kwargs": (self.template.kwargs or None) if self.template else self.server_kwargs,
            # The tokenizer is code (a worker rendering turns needs its host's consent to run it).
            "tokenizer_code": (self.template.code or None) if self.template else None,
            "think": self.think,
            "keep_prompt": None if self.keep_prompt else False,
            "clip_max_new_tokens": self.clip or None,
            "split": self.split,
            "config": self.config,
            "continue_to": self.continue_to,
            "keep_fields": list(shape.keep_fields) or None,
            "row_template": shape.template.fingerprint if shape.template else None,
            "from_dataset": self.stage.describe() if self.stage else None,
        }
        return {k: v for k, v in values.items() if v is not None}


@dataclass
class Summary:
    read: int = 0
    enqueued: int = 0
    skipped: int = 0
    rejected: int = 0
    clipped: int = 0
    fatal: str | None = None  # a source that could not be read on: nothing after it was enqueued
    rejected_by_reason: Counter[str] = field(default_factory=Counter)  # reason_class -> rows

    def as_dict(self) -> dict[str, Any]:
        counts = {"read": self.read, "enqueued": self.enqueued, "skipped": self.skipped}
        clipped = {"clipped": self.clipped} if self.clipped else {}
        return {**counts, "rejected": self.rejected, **clipped}


def enqueue_rows(
    conn: redis.Redis,
    keys: Keys,
    settings: datasets.DatasetSettings,
    rows: Iterable[Row | Rejected],
    prints: Fingerprints,
    options: Options | None = None,
    expected_rows: int | None = None,
    report: Report = lambda line: None,
    rejects: RejectsFile | None = None,
) -> Summary:
    """Enqueue every usable row not already enqueued (or done), ``settings.samples`` jobs each.

    Rejected rows (and rows clipped to fit) are reported as they come, rejected ones also to
    ``rejects``. ``expected_rows`` (the
    sources' row count) lets `genq status` show the dataset's full total while ``max_queued``
    holds most of it back. ``prints``: the sources' prints ``rows`` checks as it reads (loaded
    here, under the lease), saved with every push.
    """
    options = options or Options()
    lease = Lease(conn, keys.enqueuing(settings.name), keys.enqueue_epoch(settings.name), settings.name)
    patiently(lambda: lease.acquire(report), Outage(log, conn, keys))  # before the bitmaps are read
    try:
        patiently(lambda: prints.load(conn), Outage(log, conn, keys))
        return _enqueue_leased(
            conn, keys, settings, rows, options, expected_rows, report, lease, prints, rejects
        )
    finally:
        lease.release()


def _enqueue_leased(
    conn: redis.Redis,
    keys: Keys,
    settings: datasets.DatasetSettings,
    rows: Iterable[Row | Rejected],
    options: Options,
    expected_rows: int | None,
    report: Report,
    lease: Lease,
    prints: Fingerprints,
    rejects: RejectsFile | None,
) -> Summary:
    summary = Summary()
    pusher = _Pusher(conn, keys, settings, options, expected_rows, lease, prints)
    stream = _fresh(conn, keys, settings, rows, summary, prints)
    if options.template is not None:
        stream = render_stream(stream, options.template, options.shape.turns == "all")
    max_new = int(settings.sampling_params["max_new_tokens"])
    try:
        for item, todo in stream:
            item = checked(item, settings.sampling_params, options)
            if isinstance(item, Rejected):
                summary.rejected += 1
                summary.rejected_by_reason[reason_class(item.reason)] += 1
                report(f"rejected {item}")
                if rejects is not None:
                    rejects.write(item)
                summary.enqueued += pusher.reject(item.row, prints.turned_down(item.row, item.mark))
                continue
            if item.max_new_tokens is not None:
                summary.clipped += 1
                report(f"clipped {item.where}: max_new_tokens {max_new} -> {item.max_new_tokens} to fit")
            summary.enqueued += pusher.add(item, todo, prints.taken_in(item.row, item.mark))
    except SourceError as exc:
        summary.fatal = str(exc)
    summary.enqueued += pusher.flush()
    pusher.save_prints()  # the files read to their end (rows refused or skipped at their ends too)
    # Every row read: the bitmap holds the full total. A stage's follower holds in_source itself
    # until its source is settled (producer/stage.py): a gap here would show it finished early.
    if summary.fatal is None and options.stage is None:
        patiently(lambda: conn.hdel(keys.in_source, settings.name), pusher.outage)
    return summary


def checked(item: Row | Rejected, params: dict[str, Any], options: Options) -> Row | Rejected:
    """A row that may be queued as is: its ids in the vocabulary, it fits the context, and its own
    sampling (an openai-batch row's) is the dataset's."""
    if isinstance(item, Rejected):
        return item
    raw, mark, limits = item.raw, item.mark, options.limits
    if limits.vocab_size is not None:
        item = check_vocab(item, limits.vocab_size)
    if isinstance(item, Row) and item.prompt.sampling is not None:
        item = check_recipe(item, options.row_base if options.row_base is not None else params, params)
    if isinstance(item, Row) and options.continue_to is not None and item.prompt.input_ids is None:
        item = Rejected(
            item.where,
            item.row,
            "--continue-to needs the prompt as token ids, and this row is text: give --tokenizer (or rows "
            "of input_ids)",
        )
    if isinstance(item, Row):
        max_new = int(params["max_new_tokens"])
        item = check_fits(item, max_new, limits.context_length, options.clip, limits.max_input_len)
    if isinstance(item, Rejected):
        item.raw, item.mark = raw, mark
    return item


def _fresh(
    conn: redis.Redis,
    keys: Keys,
    settings: datasets.DatasetSettings,
    rows: Iterable[Row | Rejected],
    summary: Summary,
    prints: Fingerprints,
) -> Iterator[tuple[Row | Rejected, list[int]]]:
    """Rows with the samples still to enqueue, and rejected rows (counted where every rejection is);
    rows already enqueued or done are only counted. Those inside their file's recorded rows wait
    until the reading has checked those rows (a file that differs then stops the enqueue first)."""
    name, samples = settings.name, settings.samples
    known = conn.get(keys.enqueued(name)) or b""
    done = conn.get(keys.done(name)) or b""
    held: list[tuple[Row | Rejected, list[int]]] = []
    for item in rows:
        summary.read += 1
        todo = []
        if isinstance(item, Row):
            for sample in range(settings.first_draw):  # under --accept K, the rest are drawn later
                index = bit_index(item.row, sample, samples)
                if is_set(known, index) or is_set(done, index):
                    summary.skipped += 1
                else:
                    todo.append(sample)
        if item.mark is not None and prints.held(item.mark):
            if todo or isinstance(item, Rejected):
                held.append((item, todo))
            continue
        yield from held
        held = []
        if todo or isinstance(item, Rejected):
            yield item, todo
    yield from held


def render_stream(
    stream: Iterator[tuple[Row | Rejected, list[int]]], template: ChatTemplate, all_turns: bool = False
) -> Iterator[tuple[Row | Rejected, list[int]]]:
    """Conversations rendered to input_ids, RENDER_BATCH at a time, in order.

    A source error upstream first lets through what was read before it, then goes on up.
    """
    held: list[tuple[Row | Rejected, list[int]]] = []
    waiting = 0
    try:
        for entry in stream:
            held.append(entry)
            waiting += isinstance(entry[0], Row) and entry[0].prompt.messages is not None
            if waiting >= RENDER_BATCH:
                yield from _render_held(held, template, all_turns)
                held, waiting = [], 0
    except SourceError:
        yield from _render_held(held, template, all_turns)
        raise
    yield from _render_held(held, template, all_turns)


def _render_held(
    held: list[tuple[Row | Rejected, list[int]]], template: ChatTemplate, all_turns: bool
) -> Iterator[tuple[Row | Rejected, list[int]]]:
    """Render each conversation's prompt; with ``all_turns``, its first turn's (the later turns
    need the model's answers: the worker renders them, and checks its first render against this)."""
    chats = [item for item, _ in held if isinstance(item, Row) and item.prompt.messages is not None]
    shown = [first_turn(i.prompt.messages) if all_turns else i.prompt.messages for i in chats]  # type: ignore[arg-type]
    rendered = iter(template.render(shown, [i.prompt.tools for i in chats]) if chats else [])
    for item, todo in held:
        if isinstance(item, Row) and item.prompt.messages is not None:
            ids = next(rendered)
            if isinstance(ids, str):
                yield Rejected(item.where, item.row, ids, item.raw, item.mark), todo
                continue
            item.prompt.input_ids = ids
        yield item, todo


@dataclass
class _Pending:
    """What one MULTI of the pusher writes."""

    jobs: list[tuple[int, rq_jobs.Job]]
    rejected: list[int]
    taken_in: list[int]
    changes: list[Change]


class _Pusher:
    """Builds job payloads and pushes them in MULTI batches, waiting for room with ``max_queued``.

    A MULTI holds the jobs, their ``enqueued`` bits, the ``rejected`` bits of rows refused (set)
    and of rows refused before and queued now (cleared), and the sources' prints that match those
    bits (producer/fingerprints.py): what `genq status` and the next enqueue read always agree."""

    def __init__(
        self,
        conn: redis.Redis,
        keys: Keys,
        settings: datasets.DatasetSettings,
        options: Options,
        expected_rows: int | None,
        lease: Lease,
        prints: Fingerprints,
    ):
        self.conn, self.keys, self.settings, self.options = conn, keys, settings, options
        self.lease, self.prints = lease, prints
        self.queue = rq_queue(conn, keys, settings.name)
        self.size = BATCH if options.max_queued is None else max(1, min(BATCH, options.max_queued // 2))
        self.expected_jobs = expected_rows * settings.first_draw if expected_rows is not None else None
        self.batch: list[tuple[int, rq_jobs.Job]] = []
        self.rejected: list[int] = []  # bits to set: rows refused now
        self.taken_in: list[int] = []  # bits to clear: rows refused before, queued now
        self.changes: list[Change] = []  # the prints' terms those bits change
        self.outage = Outage(log, conn, keys)

    def _indexes(self, row: int) -> list[int]:
        return [bit_index(row, k, self.settings.samples) for k in range(self.settings.first_draw)]

    def reject(self, row: int, change: Change | None) -> int:
        """Remember a row refused here, so `genq verify` tells it from a row never enqueued;
        returns how many jobs were pushed now (the jobs pending go in the same MULTI)."""
        self.rejected.extend(self._indexes(row))
        if change is not None:
            self.changes.append(change)
        return self.flush() if len(self.rejected) >= self.size else 0

    def add(self, item: Row, todo: list[int], change: Change | None) -> int:
        """Queue a row's samples ``todo`` for the next push; returns how many jobs were pushed now.
        ``change``: the row was refused before, and its bits and print change with its jobs."""
        pushed = 0
        if change is not None:
            self.taken_in.extend(self._indexes(item.row))
            self.changes.append(change)
        for sample in todo:
            index = bit_index(item.row, sample, self.settings.samples)
            self.batch.append((index, self._job_data(item, sample)))
            if len(self.batch) >= self.size:
                pushed += self.flush()
        return pushed

    def flush(self) -> int:
        """Push what is pending in one MULTI; returns how many jobs it held."""
        if not (self.batch or self.rejected or self.taken_in):
            return 0
        pending = _Pending(self.batch, self.rejected, self.taken_in, self.changes)
        self.batch, self.rejected, self.taken_in, self.changes = [], [], [], []
        # A MULTI refused (Redis out of memory, its disk full, ...) was not applied and is sent
        # again; a lost connection may hide one that was, so that fails when it holds jobs (bits
        # alone set twice are set once).
        patiently(lambda: self._push(pending), self.outage, replies_only=bool(pending.jobs))
        return len(pending.jobs)

    def _push(self, pending: _Pending) -> None:
        if self.options.max_queued is not None and pending.jobs:
            while self.conn.llen(self.queue.key) + len(pending.jobs) > self.options.max_queued:
                time.sleep(POLL_S)  # the lease's own thread renews it meanwhile
        self._saving(lambda pipe: self._queue_push(pipe, pending), pending.changes)

    def save_prints(self) -> None:
        """Save the prints of the files read to their end, fenced like a push."""
        patiently(lambda: self._saving(lambda pipe: None, []), self.outage)

    def _saving(self, build: Callable[[Pipeline], None], changes: list[Change]) -> None:
        """Run ``build``'s MULTI with the sources' prints it covers."""
        written: dict[int, tuple[int, int]] = {}

        def queued(pipe: Pipeline) -> None:
            build(pipe)
            written.update(self.prints.save(pipe, changes))

        self.lease.push(queued)
        self.prints.saved_as(written, changes)

    def _queue_push(self, pipe: Pipeline, pending: _Pending) -> None:
        name = self.settings.name
        set_bits(pipe, self.keys.rejected(name), pending.rejected)
        set_bits(pipe, self.keys.rejected(name), pending.taken_in, 0)
        if not pending.jobs:
            return
        rq_jobs.push(pipe, self.queue, [job for _, job in pending.jobs], rq_jobs.JOBS)
        set_bits(pipe, self.keys.enqueued(name), [index for index, _ in pending.jobs])
        if self.expected_jobs is not None:
            # Jobs of the rows after this batch: still in the files (`genq status` counts them queued).
            left = max(0, self.expected_jobs - pending.jobs[-1][0] - 1)
            pipe.hset(self.keys.in_source, name, left)

    def _job_data(self, item: Row, sample: int) -> rq_jobs.Job:
        settings, options, prompt = self.settings, self.options, item.prompt
        params = dict(settings.sampling_params)
        if settings.samples > 1:
            params["sampling_seed"] = params.get("sampling_seed", 0) + sample
        if item.max_new_tokens is not None:
            params["max_new_tokens"] = item.max_new_tokens
        spec = JobSpec(
            dataset=settings.name,
            row=item.row,
            sample=sample,
            id=record_id(settings.name, item.row, sample, settings.samples),
            sampling_params=params,
            input_ids=prompt.input_ids,
            text=prompt.text if prompt.input_ids is None else None,
            source_id=prompt.source_id,
            # A chat backend sends the messages themselves, a conversation is answered turn by turn
            # from them: then they travel whatever --keep-prompt says.
            messages=prompt.messages
            if options.keep_prompt or prompt.input_ids is None or options.shape.turns == "all"
            else None,
            think=options.think,
            keep_prompt=options.keep_prompt or None,
            turns="all" if options.shape.turns == "all" else None,
            logprobs=options.logprobs,
            template=options.template.spec() if options.template and options.shape.turns == "all" else None,
            batch=prompt.batch,
            tools=prompt.tools,
            chat_template_kwargs=options.server_kwargs,
            continue_to=options.continue_to,
            fields=prompt.fields,
            parent=prompt.parent,
        )
        described = f"{settings.name} row {item.row}" + (f" sample {sample}" if settings.samples > 1 else "")
        return self.keys.job_id(spec.id), spec.to_kwargs(), described


def reason_class(reason: str) -> str:
    """A reject's reason with its numbers and quoted values taken out, so rows refused for the same
    reason count together (``prompt of 9000 tokens ...`` and ``prompt of 9100 tokens ...``)."""
    return _NUMBER.sub("N", _QUOTED_VALUE.sub("…", reason))[:REASON_CHARS]


def record_rejects(conn: redis.Redis, keys: Keys, dataset: str, summary: Summary) -> None:
    """The rows this enqueue refused, by reason, beside its command line: the dataset card's
    ledger says why rows are missing (each enqueue reads every row, so the latest one's counts
    are the dataset's)."""
    by_reason = dict(summary.rejected_by_reason.most_common())
    conn.hset(keys.provenance(dataset), provenance.REJECTS_FIELD, orjson.dumps(by_reason))


def enqueue_dataset(
    conn: redis.Redis,
    keys: Keys,
    paths: list[Path],
    dataset: str,
    sampling_params: dict[str, Any],
    samples: int,
    options: Options,
    replace_settings: bool = False,
    report: Report = lambda line: None,
    register_only: bool = False,
    rejects: RejectsFile | None = None,
) -> Summary:
    """Register the dataset's settings (decision 12), then enqueue its sources (unless
    ``register_only``: `genq run` registers first, so its collector knows the dataset).

    With ``max_queued`` the sources are counted first (cheaply: Parquet and saved datasets from
    their metadata, JSON Lines by counting lines) so `genq status` shows the full total at once.
    """
    wanted = datasets.settings_for(
        dataset, paths, sampling_params, samples, options.prompting(), options.check
    )
    register = lambda: datasets.register(conn, keys, wanted, replace=replace_settings)  # noqa: E731
    settings = patiently(register, Outage(log, conn, keys))  # HSETNX first: registering again changes nothing
    patiently(lambda: provenance.record_command(conn, keys, dataset, "enqueue"), Outage(log, conn, keys))
    if register_only:
        return Summary()
    expected = None
    if options.max_queued is not None:
        expected = sum(sources.count(path, options.split, options.max_row_bytes) for path in paths)
        if options.limit is not None:
            expected = min(expected, options.limit)
        report(f"{dataset}: {expected} rows in its sources; at most {options.max_queued} jobs queued at once")
    prints = Fingerprints(
        keys.sources(dataset), keys.rejected(dataset), dataset, settings.samples, replace_settings, report
    )
    rows: Iterable[Row | Rejected] = read_dataset(
        paths, options.shape, options.split, report, options.max_row_bytes, prints
    )
    if options.limit is not None:
        rows = itertools.islice(rows, options.limit)  # the reader stops there: its print covers them
    summary = enqueue_rows(conn, keys, settings, rows, prints, options, expected, report, rejects)
    if summary.fatal is None:  # every row read (or the first --limit): the counts are whole
        patiently(lambda: record_rejects(conn, keys, dataset, summary), Outage(log, conn, keys))
        limited = options.limit is not None and summary.read == options.limit
        patiently(lambda: provenance.record_limit(conn, keys, dataset, summary.read if limited else None),
                  Outage(log, conn, keys))  # fmt: skip
    return summary
