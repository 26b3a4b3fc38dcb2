"""genq from Python: one client of one Redis namespace, on the operations the command line runs.

:func:`connect` reaches a Redis as every command does (the URL, then ``GENQ_REDIS_URL``; the
password, TLS files and Sentinels from the ``GENQ_REDIS_*`` variables: genq/connection.py), or the
private Redis of a `genq run` folder (``out=``). :class:`Client` enqueues (the same request, checks
and plan as `genq enqueue`: producer/cli.py ``prepared`` and ``submit``), reads the status `genq
status --json` prints, waits with a progress bar, and reads a dataset's records off the files.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from genq import progress
from genq.api.errors import GenqError, UsageError, WaitTimeout, genq_errors
from genq.api.results import Results
from genq.api.rows import Source, materialize, rows_folder
from genq.commands.embedded import EmbeddedRedis
from genq.commands.run_redis import FOLDER, NAMESPACE_FILE, has_private_redis
from genq.commands.status import status as status_of
from genq.connection import RedisURLError
from genq.connection import connect as redis_connect
from genq.keys import Keys, validate_name
from genq.producer.cli import prepared, submit
from genq.producer.readers import Rejected
from genq.producer.rejects import RejectsFile, entry
from genq.producer.request import EnqueueRequest
from genq.sampling import DEFAULT_MAX_NEW_TOKENS, Sampling
from genq.settings import DEFAULT_NAMESPACE, DEFAULT_REDIS_URL

log = logging.getLogger("genq.api")

WAIT_EVERY_S = 0.5  # how often wait() looks at the counts
SOURCE_WAIT_S = (
    30.0  # stage(): how long a source not registered yet (another stage's, starting) is waited for
)
# EnqueueRequest's fields the caller does not set: the source, the sampling (keywords of their own)
# and what the request learns from its --server.
_NOT_OPTIONS = {"files", "sampling", "given", "max_input_len", "server_version", "row_template"}
# `--template` is ``template=`` here (a file, or a function of the row: run on this host only).
OPTIONS = ("template", *(f.name for f in dataclasses.fields(EnqueueRequest) if f.name not in _NOT_OPTIONS))


@dataclass(frozen=True)
class EnqueueResult:
    """What one enqueue did: rows read, jobs enqueued, jobs skipped (already queued or on disk),
    rows refused (each as `genq enqueue --rejects` writes it: file, line or row, dataset_row,
    field, reason, raw) and rows clipped to fit."""

    dataset: str
    read: int
    enqueued: int
    skipped: int
    rejected: int
    clipped: int = 0
    refusals: list[dict[str, Any]] = field(default_factory=list)


class _Refusals(RejectsFile):
    """The rows an enqueue refused, kept for its result (as the rejects file holds them)."""

    def __init__(self) -> None:
        self.found: list[dict[str, Any]] = []

    def write(self, item: Rejected) -> None:
        self.found.append(entry(item))

    def close(self) -> None:
        pass


class Client:
    """One namespace of one Redis. Made by :func:`connect` (or ``LocalRun.start``); ``out`` is the
    collector's folder, where :meth:`results` reads; ``server`` and ``backend`` are what enqueue
    asks for its limits (as ``genq enqueue --server``)."""

    def __init__(
        self,
        conn: redis.Redis,
        namespace: str = DEFAULT_NAMESPACE,
        out: Path | None = None,
        server: str | None = None,
        backend: str = "auto",
        private: EmbeddedRedis | None = None,
    ) -> None:
        self.conn = conn
        self.namespace = validate_name(namespace, "namespace")
        self.keys = Keys(self.namespace)
        self.out = out
        self.server = server
        self.backend = backend
        self._private = private  # a run's private Redis this client started: stopped by close()

    def close(self) -> None:
        """Let go of Redis (and stop a run's private Redis this client started to read it)."""
        self.conn.close()
        if self._private is not None:
            self._private.stop()
            self._private = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- enqueue ---------------------------------------------------------------------------------

    def enqueue(
        self,
        source: Source | None = None,
        dataset: str | None = None,
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stop_token_ids: list[int] | None = None,
        samples: int = 1,
        seed: int | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> EnqueueResult:
        """Enqueue one job per row (and sample) of ``source``: a path, glob, dataset folder or Hub
        id (or a list of them), or rows in memory (a list or iterable of dicts, a
        ``datasets.Dataset``, a pandas ``DataFrame``: written to ``<dataset>.jsonl`` in
        :func:`~genq.api.rows.rows_folder`, so an enqueue again skips what is done and refuses
        changed rows, as for a file). ``options`` are `genq enqueue`'s other flags by their Python
        names (``tokenizer=``, ``trust_remote_code=``, ``continue_to=``, ``accept=``, ...: docs/python.md).

        Idempotent, as the command: rows already queued or on disk are skipped. Refused rows come
        back in the result's ``refusals``; the others are enqueued. Raises :class:`UsageError` for
        options that cannot go together, :class:`GenqError` for the rest of what the command line
        says in one line (a changed file, a recipe that differs from the dataset's, ...).
        """
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise UsageError(
                f"enqueue() takes no option {', '.join(unknown)} (it takes: {', '.join(OPTIONS)})"
            )
        sampling = Sampling(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=stop_token_ids,
            samples=samples,
            seed=seed,
            sampling_params=dict(sampling_params) if sampling_params else None,
        )
        if "template" in options:
            options["row_template"] = options.pop("template")
        if options.get("from_dataset") is not None:  # a stage: its rows are another dataset's records
            options.setdefault("from_out", self.out)
            if source is not None:
                raise UsageError("a stage (from_dataset=) takes its rows from records: give no source")
        files = (
            materialize(source, dataset, rows_folder(self.out, self.namespace)) if source is not None else []
        )
        # Set on purpose (an OpenAI Batch row may not contradict it): what differs from the defaults.
        given = {
            k for k in sampling.params() if k != "max_new_tokens" or max_new_tokens != DEFAULT_MAX_NEW_TOKENS
        }
        options.setdefault("server", self.server)
        options.setdefault("backend", self.backend if options["server"] else "auto")
        refusals = _Refusals()
        with genq_errors():
            request = EnqueueRequest(
                files=tuple(files), sampling=sampling, dataset=dataset, given=frozenset(given), **options
            )
            request, plan = prepared(request)
            if request.dry_run:
                raise UsageError("dry_run: use `genq enqueue --dry-run` (the API enqueues or refuses)")
            summary = submit(self.conn, self.keys, request, plan, refusals)
        if summary.fatal:
            raise GenqError(f"{plan.name}: {summary.fatal}")
        if not request.register_only and summary.read == 0:
            raise GenqError(f"{plan.name}: no rows in {', '.join(map(str, plan.paths))}: nothing to enqueue")
        return EnqueueResult(
            dataset=plan.name,
            read=summary.read,
            enqueued=summary.enqueued,
            skipped=summary.skipped,
            rejected=summary.rejected,
            clipped=summary.clipped,
            refusals=refusals.found,
        )

    def stage(
        self, from_dataset: str, dataset: str, template: Any, **options: Any
    ) -> concurrent.futures.Future[EnqueueResult]:
        """Follow ``from_dataset`` in a thread: each of its records, as it lands in ``out``, becomes
        a row of ``dataset`` by ``template`` (a Jinja file, or a function of the record run here),
        until ``from_dataset`` is settled; a source not registered yet (another stage's thread
        starting) is waited for up to SOURCE_WAIT_S. ``options`` as for :meth:`enqueue` (sampling,
        ``only_accepted``, ``only_stopped``, ...). The future's result is the enqueue's; a
        refusal (a missing dataset, a cycle, a template naming what no record has) is its exception."""
        deadline = time.monotonic() + SOURCE_WAIT_S  # a source another stage's thread registers now
        while not self.conn.hexists(self.keys.datasets, from_dataset) and time.monotonic() < deadline:
            time.sleep(0.05)
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"genq-stage-{dataset}")
        future = pool.submit(
            self.enqueue, None, dataset, from_dataset=from_dataset, template=template, **options
        )
        pool.shutdown(wait=False)
        return future

    # -- progress --------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What `genq status --json` prints: per dataset and in total, workers and warnings."""
        with genq_errors():
            return status_of(self.conn, self.keys)

    def settled(self, dataset: str | None = None) -> bool:
        """Every job of ``dataset`` (of every dataset, without one) is on disk, as a record or an
        error, and nothing waits in the result stream."""
        counts = self._counts(dataset)
        with genq_errors():
            return progress.finished(counts) and progress.stream_lag(self.conn, self.keys)["length"] == 0

    def wait(
        self, dataset: str | None = None, timeout: float | None = None, show: bool = True
    ) -> dict[str, Any]:
        """Return once ``dataset`` (every dataset, without one) is settled, with its status (the
        ``datasets`` entry of :meth:`status`, or the totals). A progress bar (tqdm: a terminal's,
        or a notebook's widget) while ``show``. After ``timeout`` seconds :class:`WaitTimeout`;
        Ctrl-C stops the waiting only (KeyboardInterrupt): the run goes on."""
        from tqdm.auto import tqdm  # a notebook's widget when in one, else the terminal's bar

        deadline = None if timeout is None else time.monotonic() + timeout
        counts = self._counts(dataset)
        bar = tqdm(
            desc=dataset or "all datasets",
            unit="job",
            initial=sum(c["done"] + c["failed"] for c in counts.values()),  # the rate: of this wait's jobs
            disable=not show,
            dynamic_ncols=True,
        )
        try:
            while True:
                bar.total = sum(c["total"] for c in counts.values())
                bar.n = sum(c["done"] + c["failed"] for c in counts.values())
                bar.set_postfix(
                    in_flight=sum(c["in_flight"] for c in counts.values()),
                    failed=sum(c["failed"] for c in counts.values()),
                    refresh=False,
                )
                bar.refresh()
                if counts and self.settled(dataset):
                    return self._summary(dataset)
                if deadline is not None and time.monotonic() > deadline:
                    raise WaitTimeout(
                        f"{dataset or 'the datasets'}: not settled within {timeout:g} s "
                        f"({bar.n} of {bar.total} jobs on disk); the run goes on"
                    )
                time.sleep(WAIT_EVERY_S)
                counts = self._counts(dataset)
        except KeyboardInterrupt:
            log.warning("stopped waiting; the run goes on")
            raise
        finally:
            bar.close()

    def _counts(self, dataset: str | None) -> dict[str, dict[str, int]]:
        with genq_errors():
            counts = progress.dataset_counts(self.conn, self.keys)
        if dataset is None:
            return counts
        if dataset not in counts:
            raise GenqError(f"no dataset {dataset!r} in namespace {self.namespace!r}")
        return {dataset: counts[dataset]}

    def _summary(self, dataset: str | None) -> dict[str, Any]:
        data = self.status()
        return data["datasets"][dataset] if dataset is not None else data["totals"]

    # -- results ---------------------------------------------------------------------------------

    def results(self, dataset: str) -> Results:
        """The records of ``dataset`` in the collector's folder (``out`` of :func:`connect`)."""
        if self.out is None:
            raise UsageError(
                "results() reads the collector's folder: connect(out=OUT) or genq.results(OUT, name)"
            )
        return Results(self.out, dataset)


def connect(
    redis_url: str | None = None,
    namespace: str | None = None,
    *,
    out: str | os.PathLike[str] | None = None,
    server: str | None = None,
    backend: str = "auto",
) -> Client:
    """A :class:`Client` of ``redis_url`` (else ``GENQ_REDIS_URL``, else the local default) and
    ``namespace`` (else ``GENQ_NAMESPACE``, else ``genq``); the password, TLS files and Sentinels
    come from the ``GENQ_REDIS_*`` variables, as for every command. With ``out`` alone, the private
    Redis of the `genq run` in that folder and its namespace (started again while the client lives,
    if the run has ended); ``out`` is also where :meth:`Client.results` reads. ``server`` (and
    ``backend``) are asked for their limits at each enqueue, as ``genq enqueue --server``."""
    folder = Path(out) if out is not None else None
    if folder is not None and redis_url is None and has_private_redis(folder):
        return _run_client(folder, namespace, server, backend)
    url = redis_url or os.environ.get("GENQ_REDIS_URL") or DEFAULT_REDIS_URL
    try:
        conn = redis_connect(url)
    except RedisURLError as exc:
        raise UsageError(str(exc)) from None
    name = namespace or os.environ.get("GENQ_NAMESPACE") or DEFAULT_NAMESPACE
    return Client(conn, name, folder, server, backend)


def _run_client(out: Path, namespace: str | None, server: str | None, backend: str) -> Client:
    """A client of the private Redis of the `genq run` in ``out`` (its password and namespace)."""
    recorded = (
        (out / FOLDER / NAMESPACE_FILE).read_text().strip()
        if (out / FOLDER / NAMESPACE_FILE).exists()
        else None
    )
    if namespace is not None and recorded is not None and namespace != recorded:
        raise UsageError(f"namespace {namespace!r}: the run in {out} used {recorded!r}")
    private = EmbeddedRedis(out / FOLDER, private=True)
    started = None
    try:
        url = private.attach()
        if url is None:
            url, started = private.start(), private
    except (OSError, RuntimeError) as exc:
        raise GenqError(f"{out / FOLDER}: cannot start the run's private Redis: {exc}") from None
    conn = redis_connect(url, password=private.password())
    return Client(conn, namespace or recorded or DEFAULT_NAMESPACE, out, server, backend, private=started)


def results(out: str | os.PathLike[str], dataset: str) -> Results:
    """The records of ``dataset`` in the output folder ``out`` (no Redis needed)."""
    return Results(Path(out), dataset)
