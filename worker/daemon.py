"""The asyncio worker: C jobs in flight in one process, read top to bottom.

One event loop does the HTTP; every Redis/RQ call goes to :class:`~worker.bookkeeping.Bookkeeper`
on a single thread, so the loop never blocks on Redis and RQ's one-job-at-a-time worker state
is only ever touched by one caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

from genq.keys import Keys
from genq.schema import error_record
from worker import metrics
from worker.bookkeeping import Bookkeeper, Taken
from worker.client import SGLangClient
from worker.errors import AttemptError, backoff
from worker.record import build_record

log = logging.getLogger("genq.worker")
T = TypeVar("T")
HEALTH_EVERY_S = 10.0
REPORT_EVERY_S = 2.0


@dataclass
class WorkerConfig:
    server: str
    concurrency: int = 128
    max_attempts: int = 5
    request_timeout: float | None = None  # overrides the deadline derived from max_new_tokens
    grace: float = 60.0
    burst: bool = False
    heartbeat_ttl: int = 60
    stream_limit: int = 10_000
    backoff_base: float = 1.0
    backoff_cap: float = 60.0
    # A connection that fails this many times in a row closes the gate until /health answers.
    down_after: int = 3

    def attempt_timeout(self, max_new_tokens: int) -> float:
        """Decision 8: long generations get long deadlines (8 tok/s floor per sequence + 120 s)."""
        if self.request_timeout is not None:
            return self.request_timeout
        return 120.0 + max_new_tokens / 8.0


class Worker:
    def __init__(self, conn: redis.Redis, keys: Keys, config: WorkerConfig):
        self.config = config
        self.keys = keys
        self.books = Bookkeeper(conn, keys, config.heartbeat_ttl, config.server)
        self._redis_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genq-redis")
        self._in_flight: dict[asyncio.Task, Taken] = {}
        self._stopping = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._server_up = asyncio.Event()
        self._server_up.set()
        self._server_failures = 0
        self._signals = 0
        self._background: list[asyncio.Task] = []
        self._retrying: Counter[str] = Counter()  # per dataset, jobs between two attempts
        self._retries = 0

    def _ctx(self, t: Taken | None = None) -> dict[str, Any]:
        """The context of a log line (fields of --log-format json)."""
        ctx: dict[str, Any] = {"worker": self.books.name}
        if t is not None:
            ctx.update(job_id=t.job.id, dataset=t.spec.dataset)
        return ctx

    # -- plumbing ---------------------------------------------------------------------------

    async def redis(self, fn: Callable[..., T], *args: Any) -> T:
        """Run an RQ/Redis call on the Redis thread; ride out Redis restarts with backoff."""
        loop = asyncio.get_running_loop()
        delay = 0.5
        while True:
            try:
                return await loop.run_in_executor(self._redis_thread, fn, *args)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning(
                    "Redis unreachable (%s); retrying %s in %.1f s",
                    exc,
                    fn.__name__,
                    delay,
                    extra=self._ctx(),
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    def _on_signal(self) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info(
                "worker %s: stop requested; draining %d in flight (grace %.0f s)",
                self.books.name,
                len(self._in_flight),
                self.config.grace,
                extra=self._ctx(),
            )
            self._stopping.set()
            self._slot_freed.set()
        else:
            log.warning(
                "worker %s: second signal, stopping at once; RQ requeues what was in flight",
                self.books.name,
                extra=self._ctx(),
            )
            os._exit(1)

    # -- main loop --------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        await self.redis(self.books.start)
        log.info(
            "worker %s: serving %s with %d in flight at most",
            self.books.name,
            self.config.server,
            self.config.concurrency,
            extra={**self._ctx(), "server": self.config.server},
        )
        metrics.watch(
            lambda: len(self._in_flight), lambda: sum(self._retrying.values()), self._server_up.is_set
        )
        async with SGLangClient(self.config.server, self.config.concurrency) as client:
            self.client = client
            self._background += [
                asyncio.create_task(self._heartbeats()),
                asyncio.create_task(self._maintenance()),
                asyncio.create_task(self._watch_health()),
                asyncio.create_task(self._reports()),
            ]
            try:
                await self._take_loop()
                await self._drain()
            finally:
                for task in self._background:
                    task.cancel()
                await self.redis(self.books.stop)
        self._redis_thread.shutdown(wait=True)
        log.info("worker %s: stopped", self.books.name, extra=self._ctx())

    async def _take_loop(self) -> None:
        idle_polls = 0
        while not self._stopping.is_set():
            self._slot_freed.clear()
            free = self.config.concurrency - len(self._in_flight)
            taken: list[Taken] = []
            if free > 0 and self._server_up.is_set() and await self._stream_has_room():
                taken = await self.redis(self.books.take, min(free, 256))
            for t in taken:
                task = asyncio.create_task(self._run_job(t))
                self._in_flight[task] = t
                task.add_done_callback(self._job_done)
            if taken:
                idle_polls = 0
                continue
            if self.config.burst and not self._in_flight and await self._all_done():
                log.info("worker %s: burst: nothing queued or in flight", self.books.name, extra=self._ctx())
                return
            idle_polls += 1
            if idle_polls % 20 == 0:
                await self.redis(self.books.refresh_queues)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), timeout=0.25 if free > 0 else 5)

    async def _all_done(self) -> bool:
        """--burst ends when nothing is queued and no worker has a job started (a dead one's
        jobs come back once their heartbeat lapses, and this worker should be there to run them)."""
        await self.redis(self.books.refresh_queues)
        return await self.redis(self.books.unfinished_count) == 0

    async def _stream_has_room(self) -> bool:
        """Decision 10: stop taking jobs while the collector is behind."""
        length = await self.redis(self.books.stream_length)
        if length < self.config.stream_limit:
            return True
        log.warning(
            "result stream holds %d entries (limit %d): waiting for the collector",
            length,
            self.config.stream_limit,
            extra=self._ctx(),
        )
        await asyncio.sleep(2)
        return False

    def _job_done(self, task: asyncio.Task) -> None:
        taken = self._in_flight.pop(task, None)
        self._slot_freed.set()
        if not task.cancelled() and task.exception() is not None and taken is not None:
            # Its execution is no longer heartbeated: RQ puts the job back after the TTL.
            log.error(
                "job %s: unexpected error, it will run again after the heartbeat TTL",
                taken.job.id,
                exc_info=task.exception(),
                extra=self._ctx(taken),
            )

    async def _drain(self) -> None:
        """Let in-flight jobs finish within the grace period; put the rest back at once."""
        if not self._in_flight:
            return
        done, pending = await asyncio.wait(list(self._in_flight), timeout=self.config.grace)
        if not pending:
            return
        # A job already handing its result to Redis finishes; cancelling it would only run it twice.
        cancel = [task for task in pending if not self._in_flight[task].finishing]
        left = [self._in_flight[task] for task in cancel]
        for task in cancel:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self.redis(self.books.requeue, left)
        log.info(
            "worker %s: grace over, put %d jobs back on their queues",
            self.books.name,
            len(left),
            extra=self._ctx(),
        )

    # -- one job ----------------------------------------------------------------------------

    async def _run_job(self, t: Taken) -> None:
        spec, job_id = t.spec, t.job.id  # job_id: RQ's, namespaced; spec.id: the record's
        body: dict[str, Any] = {"sampling_params": spec.sampling_params}
        if spec.input_ids is not None:
            body["input_ids"] = spec.input_ids
        else:
            body["text"] = spec.text
        timeout = self.config.attempt_timeout(spec.max_new_tokens)
        failures = 0
        last: AttemptError | None = None
        started = time.monotonic()
        while True:
            await self._server_up.wait()
            attempt = await self.redis(self.books.attempt, job_id)
            if attempt > self.config.max_attempts:
                why = last or AttemptError(
                    "attempts_exhausted",
                    f"used its {self.config.max_attempts} attempts without an answer "
                    "(the workers running it stopped or died)",
                )
                await self._fail(t, why, attempt - 1)
                return
            rid = f"{job_id}-a{attempt}"
            body["rid"] = rid
            sent = time.monotonic()
            try:
                response = await self.client.generate(body, timeout)
            except AttemptError as exc:
                metrics.attempt(time.monotonic() - sent, exc)
                last = exc
                if exc.kind == "timeout":
                    await self.client.abort(rid)
                if not exc.retryable:
                    await self._fail(t, exc, attempt)
                    return
                if exc.kind == "connection" and not exc.unavailable and not await self.client.healthy():
                    # The connection dropped and the server is gone too: it crashed under this job
                    # and its neighbours, no fault of the prompt. A healthy server means the drop
                    # was this request's, and it counts.
                    exc.unavailable = True
                if exc.unavailable:
                    await self.redis(self.books.attempt, job_id, -1)
                    self._note_server_failure(f"{exc}")
                failures += 1
                self._retries += 1
                delay = backoff(failures, self.config.backoff_base, self.config.backoff_cap, exc.retry_after)
                log.info(
                    "job %s (%s): attempt %d failed: %s; retrying in %.1f s",
                    job_id,
                    spec.dataset,
                    attempt,
                    exc,
                    delay,
                    extra={**self._ctx(t), "attempt": attempt, "error": exc.kind, "delay_s": round(delay, 2)},
                )
                await self._wait_to_retry(spec.dataset, delay)
                continue
            except asyncio.CancelledError:
                await self.client.abort(rid)
                raise
            metrics.attempt(time.monotonic() - sent, None)
            self._server_failures = 0
            record = build_record(
                spec.id,
                spec,
                response,
                attempts=attempt,
                latency_s=time.monotonic() - started,
                server=self.config.server,
                worker=self.books.name,
            )
            t.finishing = True
            await self.redis(self.books.succeed, t, record)
            metrics.finished(spec.dataset, record)
            return

    async def _wait_to_retry(self, dataset: str, delay: float) -> None:
        """Back off (and wait for a server that is down): meanwhile the job counts as retrying."""
        self._retrying[dataset] += 1
        await self.redis(self.books.set_retrying, dataset, self._retrying[dataset])
        try:
            await asyncio.sleep(delay)
            await self._server_up.wait()
        finally:
            self._retrying[dataset] -= 1
            await self.redis(self.books.set_retrying, dataset, self._retrying[dataset])

    async def _fail(self, t: Taken, exc: AttemptError, attempts: int) -> None:
        log.warning(
            "job %s (%s): failed for good after %d attempts: %s",
            t.job.id,
            t.spec.dataset,
            attempts,
            exc,
            extra={**self._ctx(t), "attempt": attempts, "error": exc.kind},
        )
        error = error_record(
            id=t.spec.id,
            dataset=t.spec.dataset,
            row=t.spec.row,
            sample=t.spec.sample,
            error=exc.kind,
            message=exc.message,
            status=exc.status,
            attempts=attempts,
        )
        t.finishing = True
        await self.redis(self.books.fail, t, error)
        metrics.finished(t.spec.dataset, None)

    def _note_server_failure(self, why: str) -> None:
        """Decision 7: a server that is down gets probed, not fed jobs (nor burns their attempts)."""
        self._server_failures += 1
        if self._server_failures >= self.config.down_after and self._server_up.is_set():
            self._server_up.clear()
            log.warning(
                "server %s looks down (%s); taking no jobs, probing /health",
                self.config.server,
                why,
                extra={**self._ctx(), "server": self.config.server},
            )
            self._background.append(asyncio.create_task(self._probe_until_up()))

    async def _probe_until_up(self) -> None:
        delay = 1.0
        while not await self.client.healthy():
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)
        log.info(
            "server %s is up again; resuming",
            self.config.server,
            extra={**self._ctx(), "server": self.config.server},
        )
        self._server_failures = 0
        self._server_up.set()

    async def _watch_health(self) -> None:
        """Probe /health now and then, so a dead server is noticed even between requests."""
        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            if self._server_up.is_set() and not await self.client.healthy():
                self._note_server_failure("/health failed")

    # -- background -------------------------------------------------------------------------

    async def _heartbeats(self) -> None:
        interval = max(1.0, self.config.heartbeat_ttl / 6)
        while True:
            await asyncio.sleep(interval)
            await self.redis(self.books.heartbeat_all, list(self._in_flight.values()))

    async def _reports(self) -> None:
        """genq's own numbers (in flight, retrying) for status and monitor, every few seconds."""
        while True:
            await self.redis(self.books.report, len(self._in_flight), dict(self._retrying), self._retries)
            await asyncio.sleep(REPORT_EVERY_S)

    async def _maintenance(self) -> None:
        interval = max(2.0, self.config.heartbeat_ttl / 4)
        while True:
            await self.redis(self.books.refresh_queues)
            await self.redis(self.books.reap, int(interval))
            await asyncio.sleep(interval)
