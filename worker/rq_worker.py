"""RQ bookkeeping for many jobs in flight in one process (decision 1).

RQ's ``BaseWorker`` holds a single ``execution``; this subclass gives each in-flight job its
own :class:`rq.executions.Execution`. Jobs are taken and ended (finished or failed) in batches,
writing RQ's keys as RQ's worker does (worker/rq_batch.py); a payload genq cannot read goes
through RQ's own ``handle_job_failure``, with ``self.execution`` pointed at the job's just before,
under a lock. Every method here is synchronous and runs on a thread of the worker's: takes and
maintenance each on their own (so neither waits behind the other's round trips on a slow link),
everything else on one, in order (heartbeats and hand-overs must not overtake each other).

RQ internals relied on (``rq>=2.12,<4``; tests/test_rq_contract.py): the keys of
worker/rq_batch.py, ``Execution.delete`` (rq/executions.py), ``handle_job_failure``
(rq/worker/base.py), ``StartedJobRegistry.cleanup`` for abandoned jobs (rq/registry.py).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import redis
from rq import Queue, worker_registration
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job
from rq.worker import BaseWorker, WorkerStatus

from genq import datasets
from genq.allocation import slurm_job
from genq.clock import RedisClock
from genq.entries import stream_entry
from genq.keys import Keys
from genq.queues import GenqJob, count_unfinished
from genq.reaper import reap
from genq.schema import KIND_ERROR, JobSpec, dumps, loads
from genq.worker import rq_batch

log = logging.getLogger("genq.worker")
# An execution not heartbeated for this part of its TTL is taken for lapsed (heartbeats run every
# sixth of the TTL, so only an outage gets there).
ALIVE_FOR = 0.75


@dataclass
class Taken:
    """A job this worker has started: its RQ objects and its payload."""

    job: Job
    queue: Queue
    execution: Execution
    spec: JobSpec
    crashes: int = 0  # server crashes it was in flight at (the ``crashes`` hash): on probation if > 0
    charged: int = 0  # its first attempt, charged when it was taken (0: not yet)
    finishing: bool = False  # its result is being handed to Redis: never requeue it
    handed_over: bool = False  # its result is in Redis: never heartbeat it again
    # When its execution was last known alive in Redis (taken or heartbeated; this process's
    # monotonic clock): a job taken ahead that waited past its TTL may already run elsewhere.
    beat_at: float = field(default_factory=time.monotonic)

    def may_have_lapsed(self, ttl: int) -> bool:
        """Whether its execution may have expired in Redis (not heartbeated for most of the TTL):
        then RQ's abandoned-job cleanup may have queued it for another worker."""
        return time.monotonic() - self.beat_at > ttl * ALIVE_FOR


@dataclass
class Finished:
    """A job's ending on its way to Redis: a record (with its logprobs frame) or an error."""

    taken: Taken
    kind: bytes
    data: dict
    logprobs: bytes | None = None


class Bookkeeper(BaseWorker):
    """The RQ side of one genq worker process."""

    def __init__(self, conn: redis.Redis, keys: Keys, heartbeat_ttl: int, server: str):
        self.keys = keys
        self.heartbeat_ttl = heartbeat_ttl
        self.server = server
        host = socket.gethostname().split(".")[0]
        name = f"{keys.worker_prefix}{host}.{os.getpid()}.{uuid.uuid4().hex[:6]}"
        super().__init__(
            [],
            name=name,
            connection=conn,
            serializer="json",
            job_class=GenqJob,
            worker_ttl=heartbeat_ttl,
            job_monitoring_interval=heartbeat_ttl,
        )
        self._rotation = 0
        self._take_script = conn.register_script(rq_batch.TAKE)
        self.clock = RedisClock(conn)  # every time this worker writes for other hosts to compare
        self._apply_script = conn.register_script(rq_batch.APPLY)
        self._rq_lock = threading.Lock()  # RQ's single ``execution``, swapped for a failure
        # Why this worker leaves a dataset's jobs queued (None: it serves them); set by the daemon.
        self.declines: Callable[[datasets.DatasetSettings], str | None] = lambda settings: None
        self._declined: set[str] = set()
        self._checked: set[str] = set()  # datasets whose endings go to the check stage first

    def log_context(self, t: Taken | None = None) -> dict[str, Any]:
        """The context of a log line (fields of --log-format json)."""
        ctx: dict[str, Any] = {"worker": self.name}
        if t is not None:
            ctx.update(job_id=t.job.id, dataset=t.spec.dataset)
        return ctx

    # -- life cycle -------------------------------------------------------------------------

    def start(self, server: dict[str, str]) -> None:
        """Register with RQ; ``server`` (what the probe learned) goes into the worker hash as
        ``genq_*`` fields, for status."""
        self.refresh_queues()
        self.register_birth()
        self.connection.hset(
            self.key,
            mapping={
                "genq_server": self.server,
                "genq_slurm_job": slurm_job() or "",
                "genq_heartbeat_ttl": self.heartbeat_ttl,  # status: no heartbeat for longer is a dead worker
                **{f"genq_{k}": v for k, v in server.items()},
            },
        )
        self.set_state(WorkerStatus.IDLE)

    def stop(self) -> None:
        self.connection.delete(self.keys.retrying(self.name), self.keys.committed(self.name))
        self.register_death()

    def refresh_queues(self) -> None:
        """Serve every dataset of the namespace, including ones enqueued after start, but those
        :attr:`declines` leaves queued for another worker (said once each)."""
        names = []
        for name, settings in datasets.load_all(self.connection, self.keys).items():
            why = self.declines(settings)
            if settings.checked:
                self._checked.add(name)
            if why is None:
                names.append(self.keys.queue_name(name))
            elif name not in self._declined:
                self._declined.add(name)
                log.warning("dataset %s: %s", name, why, extra=self.log_context())
        if names == self.queue_names():
            return
        self.queues = [
            Queue(n, connection=self.connection, serializer=self.serializer, job_class=GenqJob) for n in names
        ]
        self._ordered_queues = self.queues[:]
        if self.birth_date is not None:
            with self.connection.pipeline() as pipe:
                pipe.hset(self.key, "queues", ",".join(names))
                worker_registration.register(self, pipe)
                pipe.execute()

    # -- taking jobs ------------------------------------------------------------------------

    def take(self, limit: int, stream_limit: int) -> tuple[list[str], list[Taken]]:
        """Start up to ``limit`` jobs from the queues (in turn, so every dataset gets served), in
        one round trip (worker/rq_batch.py); with the datasets skipped because their result stream
        holds ``stream_limit`` entries (decision 10: their collector is behind)."""
        queues = self._ordered_queues[self._rotation :] + self._ordered_queues[: self._rotation]
        self._rotation = (self._rotation + 1) % max(1, len(self._ordered_queues))
        if not queues:
            return [], []
        streams = [(q, self._stream(self._dataset(q))) for q in queues]
        keys = (self.key, self.keys.crashes, self.keys.attempts, rq_batch.executions_index(self.name))
        full, popped = rq_batch.take(
            self._take_script,
            streams,
            limit,
            self.name,
            keys,
            stream_limit,
            self.heartbeat_ttl,
            at=self.clock.now(),
        )
        taken: list[Taken] = []
        for p in popped:
            ctx = {"job_id": p.job_id, "worker": self.name}
            if p.job is None or p.execution is None:
                # Its hash is gone (deleted by hand, or expired): `genq status` shows it unaccounted
                # for. Or it finished elsewhere while its id waited in a queue (an RQ requeue that
                # raced the result): running it again would pay for the generation twice.
                why = "no longer exists in Redis" if p.state == "missing" else f"has already {p.state}"
                log.warning("job %s was queued but %s: skipped", p.job_id, why, extra=ctx)
                continue
            if "unserialized" in p.job.meta:
                # `rq info` or rq-dashboard without the JSON serializer re-saved the meta as
                # pickle when it requeued the job; genq keeps nothing in meta, so drop it.
                p.job.meta = {}
                self.connection.hset(p.job.key, "meta", p.job.serializer.dumps({}))
            try:
                spec = self._spec(p.job, p.queue)
            except Exception as exc:  # noqa: BLE001 - a payload we cannot read fails, loudly
                why = str(exc) or type(exc).__name__
                log.error("job %s: not a genq job's payload: %s; failing it", p.job_id, why, extra=ctx)
                self._fail_unreadable(p.job, p.queue, p.execution, why)
                continue
            taken.append(Taken(p.job, p.queue, p.execution, spec, p.crashes, p.attempt))
        return [self._dataset(q) for q in full], taken

    def _spec(self, job: Job, queue: Queue) -> JobSpec:
        """The job's payload, checked (JobSpec.from_kwargs), and its own: of the queue's dataset,
        under the RQ id its record id makes. ValueError says what is not."""
        spec = JobSpec.from_kwargs(job.kwargs)
        if spec.dataset != self._dataset(queue):
            raise ValueError(f"field 'dataset' is {spec.dataset!r}, in the queue of {self._dataset(queue)!r}")
        if self.keys.job_id(spec.id) != job.id:
            raise ValueError(f"field 'id' is {spec.id!r}, not the record id of job {job.id!r}")
        return spec

    def _dataset(self, queue: Queue) -> str:
        return self.keys.dataset_of_queue(queue.name) or queue.name

    def _fail_unreadable(self, job: Job, queue: Queue, execution: Execution, message: str) -> None:
        """A job in a genq queue that genq did not write: fail it where operators will see it."""
        job.refresh()  # RQ saves the whole job
        job.retries_left = 0
        self._handle_failure(job, queue, execution, f"unreadable genq job payload: {message}")

    def _handle_failure(self, job: Job, queue: Queue, execution: Execution, exc_string: str) -> None:
        """RQ's own ``handle_job_failure`` (rq/worker/base.py) for one of many executions: RQ 3 takes
        the execution as an argument; RQ 2 reads the worker's single ``execution``, pointed at this
        job's for the call."""
        with self._rq_lock:
            if rq_batch.INDEXED:
                self.handle_job_failure(
                    job, queue, job.started_job_registry, exc_string=exc_string, execution=execution
                )
                return
            self.execution = execution
            self.handle_job_failure(job, queue, job.started_job_registry, exc_string=exc_string)
            self.execution = None

    # -- in flight --------------------------------------------------------------------------

    def heartbeat_all(self, taken: list[Taken]) -> None:
        """Refresh this worker and every in-flight execution (RQ's abandoned-job clock).

        ``taken`` was listed when the heartbeat was scheduled; a job whose result has been handed
        over since (on this same thread, after a Redis outage that queued both) is skipped here:
        refreshing its execution would put it back in RQ's started registry, and once that lapsed,
        RQ's abandoned-job cleanup would queue a finished job again. A job still waiting to hand
        its result over is refreshed: it is not finished in Redis yet."""
        ttl = self.heartbeat_ttl
        # An execution that may have lapsed is not refreshed: that would put it back in the
        # started registry beside the copy RQ queued again (it runs on, and its late result is
        # dropped as a duplicate, or its RQ state lapses for good).
        taken = [t for t in taken if not t.handed_over and not t.may_have_lapsed(ttl)]
        for chunk in _chunks(taken, 500) if taken else [[]]:
            sent_at = time.monotonic()
            with self.connection.pipeline() as pipe:
                at = self.clock.now()
                beats = [(t.job, t.execution) for t in chunk]
                rq_batch.heartbeat(pipe, self.key, rq_batch.executions_index(self.name), beats, ttl, at)
                if chunk and not rq_batch.INDEXED:  # RQ 2 names one current job (rq/worker/base.py)
                    self.set_current_job_id(chunk[-1].job.id, pipeline=pipe)
                pipe.execute()
            for t in chunk:
                t.beat_at = sent_at

    def report(
        self,
        in_flight: int,
        retrying: dict[str, int],
        retries: int,
        target: int,
        suspects: int,
        probation_s: float | None,
        held: str | None,
    ) -> None:
        """genq's fields in the RQ worker hash, next to RQ's job counts, for status and monitor; and
        the per-dataset retrying counts rewritten whole (they survive a Redis restart this way)."""
        key = self.keys.retrying(self.name)
        waiting = {dataset: n for dataset, n in retrying.items() if n}
        with self.connection.pipeline() as pipe:
            pipe.hset(
                self.key,
                mapping={
                    "genq_in_flight": in_flight,
                    "genq_retrying": sum(waiting.values()),
                    "genq_retries": retries,
                    "genq_target": target,  # jobs in flight it aims for (--concurrency, or auto's now)
                    "genq_suspects": suspects,  # crash suspects on probation: resent one at a time
                    # about how long they take to pass ("" while unknown): status's ETA counts it
                    "genq_probation_s": "" if probation_s is None else round(probation_s, 1),
                    "genq_held": held or "",  # why it takes no jobs now (its server gate), "" if it does
                },
            )
            pipe.expire(self.key, self.heartbeat_ttl + 60)  # as RQ's own heartbeat does
            pipe.delete(key)
            if waiting:
                pipe.hset(key, mapping=waiting)
                pipe.expire(key, self.heartbeat_ttl)
            pipe.execute()

    def set_retrying(self, dataset: str, count: int) -> None:
        """Jobs of ``dataset`` this worker holds between two attempts: status counts them as
        retrying, not in flight. If the worker dies the key lapses when its executions do (the
        heartbeat TTL), so the count never outlives the jobs it describes."""
        key = self.keys.retrying(self.name)
        with self.connection.pipeline() as pipe:
            if count:
                pipe.hset(key, dataset, count)
            else:
                pipe.hdel(key, dataset)
            pipe.expire(key, self.heartbeat_ttl)
            pipe.execute()

    def commit(self, token: str, charges: list[str], finished: list[Finished]) -> list[int]:
        """A group of writes in one script call (the worker's group commit, worker/commits.py): a
        send charged to each job of ``charges`` before it goes out, so the budget holds across
        workers (and a worker that dies mid-send has used it); and endings handed to the collector,
        each job finished (a record) or failed (an error) as RQ does it, its stream entry and its
        RQ state in the same step, so no crash leaves one without the other. Sent again with the
        same ``token`` (its reply was lost), it writes nothing twice (rq_batch.APPLY). Returns the
        charged jobs' attempt numbers."""
        at = self.clock.now()
        records = [f for f in finished if f.kind != KIND_ERROR]
        errors = [f for f in finished if f.kind == KIND_ERROR]
        for f in list(errors):
            try:
                f.taken.job.refresh()  # RQ saves the whole job
            except NoSuchJobError:  # deleted by hand meanwhile: only its error entry is left to write
                errors.remove(f)
            f.taken.job.retries_left = 0  # ours is a final verdict: RQ must not requeue it
        for f in finished:
            f.taken.job.ended_at = at
        pipe = self.connection.pipeline()
        if finished:
            self._hand_over(pipe, finished)
        if records:
            done = [(f.taken.job, f.taken.execution) for f in records]
            rq_batch.finish(pipe, self.key, rq_batch.executions_index(self.name), done, at)
        for f in errors:
            why = f"{f.data['error']}: {f.data['message']}"
            rq_batch.fail(pipe, self, f.taken.job, f.taken.execution, why)
        keys = (self.keys.committed(self.name), self.keys.attempts)
        attempts = rq_batch.apply(self._apply_script, keys, token, charges, pipe)
        for f in finished:
            f.taken.handed_over = True
        return attempts

    def spare(self, job_id: str, counter: str | None) -> int:
        """Take back the send charged by :meth:`attempt` and count it in ``counter`` (``spared``
        or ``crashes``) instead; returns that count (0 without a counter)."""
        with self.connection.pipeline() as pipe:
            pipe.hincrby(self.keys.attempts, job_id, -1)
            if counter is not None:
                pipe.hincrby(counter, job_id, 1)
            counts = pipe.execute()
        return int(counts[-1]) if counter is not None else 0

    def announce(self, dataset: str, server: dict) -> None:
        """Say which server (and what it is) answers ``dataset``'s jobs: its provenance."""
        self.connection.hset(self.keys.servers(dataset), self.server, dumps(server))

    def turns_done(self, job_id: str) -> list[dict]:
        """A conversation's finished turns, from an earlier worker or this one."""
        raw = self.connection.hget(self.keys.turns, job_id)
        return loads(raw) if raw else []

    def save_turns(self, job_id: str, turns: list[dict]) -> None:
        """Keep the finished turns; the next turn starts with a fresh budget (attempts per turn)."""
        self._save_job_state(self.keys.turns, job_id, dumps(turns))

    def pieces_done(self, job_id: str) -> bytes | None:
        """The output so far of a job continued in pieces (worker/pieces.py), as Redis holds it."""
        return self.connection.hget(self.keys.pieces, job_id)

    def save_pieces(self, job_id: str, progress: bytes) -> None:
        """Keep the output so far; the next piece starts with a fresh budget (attempts per piece)."""
        self._save_job_state(self.keys.pieces, job_id, progress)

    def _save_job_state(self, key: str, job_id: str, value: bytes) -> None:
        with self.connection.pipeline() as pipe:
            pipe.hset(key, job_id, value)
            for counter in (self.keys.attempts, self.keys.spared, self.keys.crashes):
                pipe.hdel(counter, job_id)
            pipe.execute()

    def pardon(self, job_ids: list[str]) -> None:
        """The crash these jobs were in flight at has its culprit: they are suspects no more."""
        if job_ids:
            self.connection.hdel(self.keys.crashes, *job_ids)

    # -- endings ----------------------------------------------------------------------------

    def _stream(self, dataset: str) -> str:
        """Where a dataset's endings go: its results stream, or first the check stage's."""
        return self.keys.unchecked(dataset) if dataset in self._checked else self.keys.results(dataset)

    def _hand_over(self, pipe, finished: list[Finished]) -> None:
        """Add results to the stream (a checked dataset's with the job's payload, from which the
        check stage draws more samples), counted per dataset, and forget the jobs' attempt counters."""
        for f in finished:
            dataset = f.taken.spec.dataset
            spec = f.taken.spec.to_kwargs() if dataset in self._checked else None
            pipe.xadd(self._stream(dataset), stream_entry(f.kind, f.taken.spec.id, f.data, f.logprobs, spec))
        for dataset, n in Counter(f.taken.spec.dataset for f in finished).items():
            pipe.hincrby(self.keys.in_check if dataset in self._checked else self.keys.in_stream, dataset, n)
        for counter in self.keys.job_state:
            pipe.hdel(counter, *(f.taken.job.id for f in finished))

    def requeue(self, taken: list[Taken]) -> None:
        """Put jobs back at the front of their queues at once (graceful stop)."""
        jobs = GenqJob.fetch_many([t.job.id for t in taken], self.connection, serializer=self.serializer)
        with self.connection.pipeline() as pipe:
            for t, job in zip(taken, jobs, strict=True):
                t.execution.delete(job=t.job, pipeline=pipe)
                if job is not None:  # RQ saves the whole job: the one read just now
                    t.queue._enqueue_job(job, pipeline=pipe, at_front=True)
            if not rq_batch.INDEXED:  # on RQ 3, Execution.delete took it out of the worker's index
                self.set_current_job_id(None, pipeline=pipe)
            pipe.execute()

    # -- maintenance ------------------------------------------------------------------------

    def reap(self, interval_s: int) -> None:
        reap(self.connection, self.keys, interval_s)

    def unfinished_count(self) -> int:
        """Jobs queued or started anywhere: a dead worker's started jobs come back to the queue."""
        with self.connection.pipeline(transaction=False) as pipe:
            for q in self.queues:
                count_unfinished(pipe, q)
            return sum(pipe.execute())


def _chunks(items: list, size: int):
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk
