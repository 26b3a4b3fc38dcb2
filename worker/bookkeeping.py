"""RQ bookkeeping for many jobs in flight in one process (decision 1).

RQ's ``BaseWorker`` holds a single ``execution``; this subclass gives each in-flight job its
own :class:`rq.executions.Execution` and points ``self.execution`` at the right one just
before calling RQ's own ``handle_job_success`` / ``handle_job_failure``. Every method here is
synchronous and runs on one dedicated thread, so that swap is never interleaved.

RQ internals relied on (pinned ``rq==2.12.*``): ``Execution.create`` / ``heartbeat`` /
``delete``, ``Job.prepare_for_execution``, ``Queue.lmove`` into the intermediate queue,
``StartedJobRegistry.cleanup`` for abandoned jobs, ``IntermediateQueue.cleanup``.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass
from itertools import islice

import redis
from rq import Queue, worker_registration
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.utils import now
from rq.worker import BaseWorker, WorkerStatus

from genq import datasets
from genq.keys import Keys
from genq.maintenance import reap
from genq.schema import KIND_ERROR, KIND_RECORD, JobSpec, dumps, loads

log = logging.getLogger("genq.worker")


@dataclass
class Taken:
    """A job this worker has started: its RQ objects and its payload."""

    job: Job
    queue: Queue
    execution: Execution
    spec: JobSpec
    crashes: int = 0  # server crashes it was in flight at (the ``crashes`` hash): on probation if > 0
    finishing: bool = False  # its result is being handed to Redis: never requeue it


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
            worker_ttl=heartbeat_ttl,
            job_monitoring_interval=heartbeat_ttl,
        )
        self._rotation = 0

    # -- life cycle -------------------------------------------------------------------------

    def start(self, server: dict[str, str]) -> None:
        """Register with RQ; ``server`` (what the probe learned) goes into the worker hash as
        ``genq_*`` fields, for status."""
        self.refresh_queues()
        self.register_birth()
        self.connection.hset(
            self.key, mapping={"genq_server": self.server, **{f"genq_{k}": v for k, v in server.items()}}
        )
        self.set_state(WorkerStatus.IDLE)

    def stop(self) -> None:
        self.connection.delete(self.keys.retrying(self.name))
        self.register_death()

    def refresh_queues(self) -> None:
        """Serve every dataset of the namespace, including ones enqueued after start."""
        names = [self.keys.queue_name(n) for n in datasets.load_all(self.connection, self.keys)]
        if names == self.queue_names():
            return
        self.queues = [Queue(n, connection=self.connection, serializer=self.serializer) for n in names]
        self._ordered_queues = self.queues[:]
        if self.birth_date is not None:
            with self.connection.pipeline() as pipe:
                pipe.hset(self.key, "queues", ",".join(names))
                worker_registration.register(self, pipe)
                pipe.execute()

    # -- taking jobs ------------------------------------------------------------------------

    def take(self, limit: int) -> list[Taken]:
        """Move up to ``limit`` jobs from the queues into this worker, each with an Execution.

        ``LMOVE`` into RQ's intermediate queue first, so a crash between the move and the
        Execution leaves the id where RQ's intermediate-queue cleanup finds it.
        """
        ids: list[tuple[Queue, str]] = []
        queues = self._ordered_queues[self._rotation :] + self._ordered_queues[: self._rotation]
        self._rotation = (self._rotation + 1) % max(1, len(self._ordered_queues))
        for queue in queues:
            want = limit - len(ids)
            if want <= 0:
                break
            with self.connection.pipeline(transaction=False) as pipe:
                for _ in range(want):
                    pipe.lmove(queue.key, queue.intermediate_queue_key)
                moved = [m for m in pipe.execute() if m is not None]
            ids.extend((queue, m.decode()) for m in moved)
        if not ids:
            return []
        jobs = Job.fetch_many([i for _, i in ids], self.connection, serializer=self.serializer)
        crashes = self.connection.hmget(self.keys.crashes, [i for _, i in ids])
        taken: list[Taken] = []
        with self.connection.pipeline() as pipe:
            for (queue, job_id), job, crashed in zip(ids, jobs, crashes, strict=True):
                pipe.lrem(queue.intermediate_queue_key, 1, job_id)
                if job is None:
                    # Its hash is gone (deleted by hand, or expired): there is nothing to run, and
                    # `genq status` will show the job as unaccounted for.
                    log.warning(
                        "job %s was queued but no longer exists in Redis: skipped",
                        job_id,
                        extra={"job_id": job_id, "worker": self.name},
                    )
                    continue
                if job.get_status(refresh=False) in (JobStatus.FINISHED, JobStatus.FAILED):
                    # Finished elsewhere while its id waited in a queue (an RQ requeue that raced the
                    # result): running it again would pay for the generation twice.
                    log.warning(
                        "job %s was queued but has already %s: skipped",
                        job_id,
                        job.get_status(refresh=False),
                        extra={"job_id": job_id, "worker": self.name},
                    )
                    continue
                if "unserialized" in job.meta:
                    # `rq info` or rq-dashboard without the JSON serializer re-saved the meta as
                    # pickle when it requeued the job; genq keeps nothing in meta, so drop it.
                    job.meta = {}
                    pipe.hset(job.key, "meta", job.serializer.dumps({}))
                try:
                    spec = JobSpec.from_kwargs(job.kwargs)
                except Exception as exc:  # noqa: BLE001 - a payload we cannot read fails, loudly
                    log.error(
                        "job %s: unreadable payload (%s); failing it",
                        job_id,
                        exc,
                        extra={"job_id": job_id, "worker": self.name},
                    )
                    self._fail_unreadable(job, queue, str(exc))
                    continue
                execution = Execution.create(job, self.heartbeat_ttl, pipeline=pipe, worker_name=self.name)
                job.prepare_for_execution(self.name, pipeline=pipe)
                taken.append(Taken(job, queue, execution, spec, int(crashed or 0)))
            if taken:
                self.set_state(WorkerStatus.BUSY, pipeline=pipe)
                self.set_current_job_id(taken[-1].job.id, pipeline=pipe)
            pipe.execute()
        return taken

    def _fail_unreadable(self, job: Job, queue: Queue, message: str) -> None:
        """A job in a genq queue that genq did not write: fail it where operators will see it."""
        job.retries_left = 0
        self.handle_job_failure(job, queue, exc_string=f"unreadable genq job payload: {message}")

    # -- in flight --------------------------------------------------------------------------

    def heartbeat_all(self, taken: list[Taken]) -> None:
        """Refresh this worker and every in-flight execution (RQ's abandoned-job clock).

        ``taken`` was listed when the heartbeat was scheduled; a job whose result has been handed
        over since (on this same thread, after a Redis outage that queued both) is skipped here:
        refreshing its execution would put it back in RQ's started registry, and once that lapsed,
        RQ's abandoned-job cleanup would queue a finished job again."""
        taken = [t for t in taken if not t.finishing]
        ttl = self.heartbeat_ttl
        for chunk in _chunks(taken, 500):
            with self.connection.pipeline() as pipe:
                self.heartbeat(ttl + 60, pipeline=pipe)
                for t in chunk:
                    t.execution.heartbeat(t.job.started_job_registry, ttl, pipeline=pipe)
                    t.job.heartbeat(now(), ttl, pipeline=pipe)
                pipe.execute()
        if not taken:
            self.heartbeat(ttl + 60)
        else:
            self.set_current_job_id(taken[-1].job.id)

    def report(self, in_flight: int, retrying: dict[str, int], retries: int) -> None:
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

    def attempt(self, job_id: str) -> int:
        """Charge a send to the job before it goes out, so the budget holds across workers (and a
        worker that dies mid-send has used it)."""
        return int(self.connection.hincrby(self.keys.attempts, job_id, 1))

    def spare(self, job_id: str, counter: str | None) -> int:
        """Take back the send charged by :meth:`attempt` and count it in ``counter`` (``spared``
        or ``crashes``) instead; returns that count (0 without a counter)."""
        with self.connection.pipeline() as pipe:
            pipe.hincrby(self.keys.attempts, job_id, -1)
            if counter is not None:
                pipe.hincrby(counter, job_id, 1)
            counts = pipe.execute()
        return int(counts[-1]) if counter is not None else 0

    def turns_done(self, job_id: str) -> list[dict]:
        """A conversation's finished turns, from an earlier worker or this one."""
        raw = self.connection.hget(self.keys.turns, job_id)
        return loads(raw) if raw else []

    def save_turns(self, job_id: str, turns: list[dict]) -> None:
        """Keep the finished turns; the next turn starts with a fresh budget (attempts per turn)."""
        with self.connection.pipeline() as pipe:
            pipe.hset(self.keys.turns, job_id, dumps(turns))
            for counter in (self.keys.attempts, self.keys.spared, self.keys.crashes):
                pipe.hdel(counter, job_id)
            pipe.execute()

    def pardon(self, job_ids: list[str]) -> None:
        """The crash these jobs were in flight at has its culprit: they are suspects no more."""
        if job_ids:
            self.connection.hdel(self.keys.crashes, *job_ids)

    # -- endings ----------------------------------------------------------------------------

    def succeed(self, t: Taken, record: dict, logprobs: bytes | None = None) -> None:
        """Hand the record (and its logprobs frame) to the collector, then let RQ finish the job
        its own way."""
        self._hand_over(t, KIND_RECORD, record, logprobs)
        t.job._result = {"tokens": record["completion_tokens"]}
        t.job.ended_at = now()
        self.execution = t.execution
        self.handle_job_success(t.job, t.queue, t.job.started_job_registry)
        self._idle_if_empty()

    def fail(self, t: Taken, error: dict) -> None:
        """A terminal failure: the error goes to the collector, the job to RQ's failed registry."""
        self._hand_over(t, KIND_ERROR, error)
        t.job.ended_at = now()
        t.job.retries_left = 0  # ours is a final verdict: RQ must not requeue it
        self.execution = t.execution
        self.handle_job_failure(
            t.job, t.queue, t.job.started_job_registry, exc_string=f"{error['error']}: {error['message']}"
        )
        self._idle_if_empty()

    def _hand_over(self, t: Taken, kind: bytes, data: dict, logprobs: bytes | None = None) -> None:
        """Add a result to the stream, counted per dataset in the same MULTI."""
        entry = {"kind": kind, "id": t.spec.id, "data": dumps(data)}
        if logprobs is not None:
            entry["lp"] = logprobs
        with self.connection.pipeline() as pipe:
            pipe.xadd(self.keys.results, entry)
            pipe.hincrby(self.keys.in_stream, t.spec.dataset, 1)
            for counter in self.keys.job_state:
                pipe.hdel(counter, t.job.id)
            pipe.execute()

    def requeue(self, taken: list[Taken]) -> None:
        """Put jobs back at the front of their queues at once (graceful stop)."""
        with self.connection.pipeline() as pipe:
            for t in taken:
                t.execution.delete(job=t.job, pipeline=pipe)
                t.queue._enqueue_job(t.job, pipeline=pipe, at_front=True)
            self.set_current_job_id(None, pipeline=pipe)
            pipe.execute()

    def _idle_if_empty(self) -> None:
        self.execution = None

    # -- maintenance ------------------------------------------------------------------------

    def reap(self, interval_s: int) -> None:
        reap(self.connection, self.keys, self.name, interval_s)

    def unfinished_count(self) -> int:
        """Jobs queued or started anywhere: a dead worker's started jobs come back to the queue."""
        with self.connection.pipeline(transaction=False) as pipe:
            for q in self.queues:
                pipe.llen(q.key)
                pipe.llen(q.intermediate_queue_key)
                pipe.zcard(q.started_job_registry.key)
            return sum(pipe.execute())

    def stream_length(self) -> int:
        return int(self.connection.xlen(self.keys.results))


def _chunks(items: list, size: int):
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk
