"""The asyncio worker: C jobs in flight in one process, read top to bottom.

One event loop does the HTTP, through a backend (genq/backends: the engine's API); every
Redis/RQ call goes to :class:`~worker.rq_worker.Bookkeeper` on a single thread, so the loop
never blocks on Redis and RQ's one-job-at-a-time worker state is only ever touched by one caller.

The Worker takes jobs and starts them, drains on SIGTERM and reports; the server gate is
:class:`~worker.gate.ServerGate`, one job's run to its ending :class:`~worker.runner.JobRunner`,
its sends :class:`~worker.attempts.Attempts`. What a failed send
costs is decided in one place, :meth:`Attempts._judge <worker.attempts.Attempts._judge>`;
docs/failures.md is the table of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import redis

from genq import backoff
from genq.backends import Backend, Http
from genq.backends.base import AttemptError
from genq.datasets import DatasetSettings
from genq.keys import Keys
from genq.redis_errors import Outage
from genq.templates import TRUST_FLAG
from genq.worker import metrics
from genq.worker.attempts import Attempts
from genq.worker.background import keep_running
from genq.worker.commits import GroupCommit
from genq.worker.concurrency import Concurrency
from genq.worker.config import WorkerConfig
from genq.worker.gate import ServerGate
from genq.worker.rq_worker import Bookkeeper, Taken
from genq.worker.runner import JobRunner

log = logging.getLogger("genq.worker")
T = TypeVar("T")
REPORT_EVERY_S = 2.0
# Jobs taken ahead cover at least twice what ends in this long: against a fast server (150 jobs/s
# at 16 in flight) a take of the floor's 4 jobs came every 27 ms, each a script call with its
# fixed cost; as long as a group commit lingers (worker/commits.py), so both come in batches.
TAKE_EVERY_S = 0.025
# After --grace, the time a stop has left to hand what remains back to Redis; a Redis still
# unreachable or refusing then does not hold the stop (systemd's TimeoutStopSec=330 > 300 + this).
STOP_SLACK_S = 15.0


class Worker:
    """One worker process: takes jobs while a slot is free and its server gate is open, runs each
    (a prompt, or a conversation turn by turn) through :class:`Attempts`, hands the results over,
    drains on SIGTERM, and keeps heartbeats, reports and maintenance going in the background."""

    def __init__(self, conn: redis.Redis, keys: Keys, config: WorkerConfig, http: Http):
        self.config = config
        self.keys = keys
        self.http = http
        self.books = Bookkeeper(conn, keys, config.heartbeat_ttl, config.server)
        self._redis_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genq-redis")
        # Takes and maintenance on threads of their own: on a slow link a take must not wait
        # behind the hand-overs and the reaper's round trips (worker/rq_worker.py).
        self._take_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genq-take")
        self._maintenance_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genq-reap")
        self._in_flight: dict[asyncio.Task, Taken] = {}
        self._finishing = 0  # jobs of _in_flight handing their result over: they free their slot
        self._ready: deque[Taken] = deque()  # taken ahead, waiting for a slot
        # The last takes' round trips: on a lossy link one in a few waits for a retransmission.
        self._take_s: deque[float] = deque([0.0], maxlen=16)
        self._ended: deque[float] = deque(maxlen=256)  # when the last jobs ended: the rate slots free
        # Redis unreachable or refusing (a genq key of the wrong type too): no new job starts meanwhile.
        self.outage = Outage(log, conn, keys)
        self._commits = GroupCommit(lambda *group: self.redis(self.books.commit, *group))
        self._stopping = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._signals = 0
        self._stop_by: float | None = None  # the monotonic time a requested stop ends by
        self._background: list[asyncio.Task] = []
        self.books.declines = self._declines
        self.gate = ServerGate(config, http, self.books)
        self.concurrency = Concurrency.of(config)  # how many jobs in flight
        self.attempts = Attempts(
            config,
            keys,
            self.books,
            self.redis,
            self._commits,
            self.gate,
            lambda: self._in_flight.values(),
            self._finish,
            self.concurrency,
            self._stopping.is_set,
        )
        self.runner = JobRunner(
            config,
            keys,
            self.books,
            self.redis,
            self.attempts,
            self._commits,
            lambda: self.backend,
            self._finish,
        )

    @property
    def backend(self) -> Backend:
        return self.gate.backend

    def _declines(self, settings: DatasetSettings) -> str | None:
        """Why this worker leaves a dataset's jobs queued: its server refuses the dataset's sampling
        (SGLang without its tokenizer, stop strings); its outputs are continued in pieces and
        this worker's backend cannot send token ids; or its tokenizer is code, which the worker
        would run to render its conversations' turns (--turns all, a token backend), and this
        host has not consented (its own flag, never Redis's say). Its jobs wait, unfailed, for a
        worker that can (one on a token backend, one started with --trust-remote-code)."""
        prompting = settings.prompting
        refused = self.backend.declines(settings.sampling_params)
        if refused is not None:
            return refused
        if prompting.get("continue_to") and self.backend.sends != "ids":
            return (
                f"its outputs are continued in pieces (--continue-to), which needs token ids in and "
                f"out, and the {self.backend.name} backend sends {self.backend.sends}: its jobs stay "
                "queued for a worker on sglang, vllm or llamacpp"
            )
        code = prompting.get("tokenizer_code")
        if not code or self.config.trust_remote_code or prompting.get("turns") != "all":
            return None
        if self.backend.sends != "ids":
            return None  # the server renders: no tokenizer here
        return (
            f"its tokenizer is code ({str(code)[:200]!r}), run to render its turns, and this host has not "
            f"consented: its jobs stay queued for a worker started with {TRUST_FLAG}"
        )

    # -- plumbing ---------------------------------------------------------------------------

    async def redis(self, fn: Callable[..., T], *args: Any, on: ThreadPoolExecutor | None = None) -> T:
        """Run an RQ/Redis call on the Redis thread (or ``on`` another); ride out a Redis that is
        unreachable or refuses for now (genq/redis_errors.py) with backoff, saying so once."""
        loop = asyncio.get_running_loop()
        refused = False
        for delay in backoff.doubling(0.5, 30.0):
            try:
                result = await loop.run_in_executor(on or self._redis_thread, fn, *args)
            except redis.RedisError as exc:
                if self.outage.refused(exc, self.books.log_context()) is None:
                    raise
                refused = True
                await asyncio.sleep(delay)
                continue
            if refused:  # not any call: an OOM Redis still answers reads
                self.outage.over(self.books.log_context())
            return result

    def _on_signal(self) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info(
                "worker %s: stop requested; draining %d in flight (grace %.0f s)",
                self.books.name,
                len(self._in_flight),
                self.config.grace,
                extra=self.books.log_context(),
            )
            self._stop_by = time.monotonic() + self.config.grace + STOP_SLACK_S
            self._stopping.set()
            self._slot_freed.set()
        else:
            log.warning(
                "worker %s: second signal, stopping at once; RQ requeues what was in flight",
                self.books.name,
                extra=self.books.log_context(),
            )
            os._exit(1)

    # -- main loop --------------------------------------------------------------------------

    def _time_left(self) -> float | None:
        """Seconds until a requested stop's deadline; None while no stop is requested."""
        return None if self._stop_by is None else max(0.0, self._stop_by - time.monotonic())

    async def _before_deadline(self, step: Awaitable[Any]) -> bool:
        """Run one step of the stop; give it up at the stop's deadline (False)."""
        try:
            await asyncio.wait_for(step, self._time_left())
        except TimeoutError:
            return False
        return True

    async def run(self) -> int:
        """Serve until stopped; the exit status: 1 when a stop's deadline passed with Redis unable
        to take back what was in flight (RQ runs those jobs again after the heartbeat TTL)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        info = await self.gate.know_server(self._stopping)
        if info is None:
            return 0  # stopped while waiting for the server
        await self.redis(self.books.start, {k: str(v) for k, v in info.summary().items() if v is not None})
        log.info(
            "worker %s: serving %s (%s%s %s, model %s) with %s",
            self.books.name,
            self.config.server,
            info.backend,
            " detected" if self.config.backend == "auto" else "",
            info.version or "?",
            info.model or "?",
            f"{self.concurrency.target} in flight at first, up to {self.config.ceiling}, steered by its load"
            if self.config.auto
            else f"{self.config.concurrency} in flight at most",
            extra={**self.books.log_context(), "server": self.config.server},
        )
        for note in info.notes:
            log.warning("server %s: %s", self.config.server, note, extra=self.books.log_context())
        metrics.watch(
            lambda: len(self._in_flight), lambda: sum(self.attempts.retrying.values()), self.gate.is_up
        )
        self._background += [
            asyncio.create_task(keep_running(name, body, self.books.log_context))
            for name, body in (
                ("commit", self._commits.run),
                ("heartbeats", self._heartbeats),
                ("maintenance", self._maintenance),
                ("health", self.gate.watch_health),
                ("reports", self._reports),
            )
        ]
        if self.config.auto:
            self._background.append(asyncio.create_task(self._steer()))
        clean, held = True, 0
        try:
            await self._take_loop()
            held = len(self._in_flight) + len(self._ready)
            clean = await self._before_deadline(self._drain())
        finally:
            for task in self._background:
                task.cancel()
            self.gate.cancel()
            clean = await self._before_deadline(self.redis(self.books.stop)) and clean
        for thread in (self._take_thread, self._maintenance_thread, self._redis_thread):
            thread.shutdown(wait=True, cancel_futures=True)
        if not clean:
            log.warning(
                "worker %s: stopped with Redis still out of reach %.0f s after the signal "
                "(--grace + %.0f s); up to %d jobs in flight or taken ahead at the signal were not "
                "handed back: RQ runs them again once their heartbeat lapses",
                self.books.name,
                self.config.grace + STOP_SLACK_S,
                STOP_SLACK_S,
                held,
                extra=self.books.log_context(),
            )
            return 1
        log.info("worker %s: stopped", self.books.name, extra=self.books.log_context())
        return 0

    async def _take_loop(self) -> None:
        """Start a job whenever a slot is free, from a few taken ahead (``prefetch``): jobs are taken
        in batches, one round trip each, in the background, so a freed slot never waits for Redis —
        not even while a take is on its way (on a slow link, one waiting out a retransmission)."""
        idle_polls = 0
        taking: asyncio.Task | None = None
        try:
            while not self._stopping.is_set():
                prefetch = self._prefetch()
                self._slot_freed.clear()
                free = self.concurrency.target - self._busy()
                self._drop_stale_ready()
                # While Redis refuses (or cannot be reached), no job starts: a finished one's
                # result waits in memory for its commit, and those stay within the concurrency.
                while free > 0 and self._ready and self.gate.is_up() and not self.outage.on:
                    self._start(self._ready.popleft())
                    free -= 1
                if taking is not None:
                    if not taking.done():
                        await self._wait_for_slot(5)  # or for the take: it sets the event too
                        continue
                    full, taken = taking.result()
                    taking = None
                    self._ready.extend(taken)
                    if taken:
                        idle_polls = 0
                        continue
                    if full:
                        await self._wait_for_collector(full)
                        continue
                elif self.gate.is_up() and (free > 0 or len(self._ready) <= prefetch // 2):
                    taking = asyncio.create_task(self._take(min(free + prefetch - len(self._ready), 256)))
                    taking.add_done_callback(lambda _: self._slot_freed.set())
                    continue
                if self.config.burst and not self._in_flight and not self._ready and await self._all_done():
                    log.info(
                        "worker %s: burst: nothing queued or in flight",
                        self.books.name,
                        extra=self.books.log_context(),
                    )
                    return
                idle_polls += 1
                if idle_polls % 20 == 0:
                    await self.redis(self.books.refresh_queues, on=self._take_thread)
                await self._wait_for_slot(0.25 if free > 0 else 5)
        finally:
            if taking is not None:  # its jobs are started in RQ: _drain puts them back
                with contextlib.suppress(TimeoutError):
                    self._ready.extend((await asyncio.wait_for(taking, self._time_left()))[1])

    def _busy(self) -> int:
        """Jobs holding a slot: suspects waiting for their turn, and jobs handing their result
        over, hold no connection."""
        return len(self._in_flight) - self._finishing - self.attempts.waiting

    async def _steer(self) -> None:
        """--concurrency auto: move the target by the server's load once a second (4 times while
        it ramps up); a server that cannot be reached now is left to the gate."""
        while True:
            await asyncio.sleep(self.concurrency.every())
            if not self.gate.is_up():
                continue
            try:
                load = await self.backend.load()
            except AttemptError:
                continue
            if self.concurrency.steer(load, self._busy()):
                self._slot_freed.set()
            line = self.concurrency.log_line(time.monotonic())
            if line is not None:
                log.info("worker %s: %s", self.books.name, line, extra=self.books.log_context())

    async def _take(self, want: int) -> tuple[list[str], list[Taken]]:
        asked = time.monotonic()
        taken = await self.redis(self.books.take, want, self.config.stream_limit, on=self._take_thread)
        self._take_s.append(time.monotonic() - asked)
        return taken

    async def _wait_for_slot(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._slot_freed.wait(), timeout=timeout)

    def _prefetch(self) -> int:
        """Enough jobs taken ahead to cover the slots that free while the slowest of the last takes
        was on its way, twice over (a slow or lossy link to Redis, a busy Redis), within the
        concurrency: the slowest, not the mean, as one lost packet holds a take for a
        retransmission timeout (200 ms or more) while every slot that frees meanwhile waits. And
        at least what ends in TAKE_EVERY_S, so a fast server's jobs are taken a handful at a time."""
        ended = self._ended
        rate = (len(ended) - 1) / (ended[-1] - ended[0]) if len(ended) > 1 and ended[-1] > ended[0] else 0.0
        wanted = math.ceil(2 * rate * max(max(self._take_s), TAKE_EVERY_S))
        target = self.concurrency.target
        return max(self.config.prefetch(target), min(wanted, target))

    def _drop_stale_ready(self) -> None:
        """Forget jobs taken ahead whose heartbeat could have lapsed (Redis unreachable for most
        of the TTL): RQ's abandoned-job cleanup may have queued them for another worker, so
        starting one, or heartbeating it back into the started registry, could run it twice. They
        are left to that cleanup."""
        ttl = self.config.heartbeat_ttl
        stale = [t for t in self._ready if t.may_have_lapsed(ttl)]
        if not stale:
            return
        self._ready = deque(t for t in self._ready if not t.may_have_lapsed(ttl))
        log.warning(
            "worker %s: %d jobs taken ahead went without a heartbeat for most of their TTL: "
            "left for RQ to queue again",
            self.books.name,
            len(stale),
            extra=self.books.log_context(),
        )

    def _start(self, t: Taken) -> None:
        self.concurrency.started(t.spec.prompt_length, t.spec.max_new_tokens)
        task = asyncio.create_task(self.runner.run(t))
        self._in_flight[task] = t
        task.add_done_callback(self._job_done)

    async def _all_done(self) -> bool:
        """--burst ends when nothing is queued and no worker has a job started (a dead one's
        jobs come back once their heartbeat lapses, and this worker should be there to run them)."""
        await self.redis(self.books.refresh_queues, on=self._take_thread)
        return await self.redis(self.books.unfinished_count) == 0

    async def _wait_for_collector(self, full: list[str]) -> None:
        """Decision 10: take no jobs of a dataset while its collector is behind."""
        log.warning(
            "result stream of %s holds %d entries (--stream-limit): waiting for its collector",
            ", ".join(full),
            self.config.stream_limit,
            extra=self.books.log_context(),
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), 2)

    def _job_done(self, task: asyncio.Task) -> None:
        taken = self._in_flight.pop(task, None)
        self._slot_freed.set()
        self._ended.append(time.monotonic())
        if taken is not None:
            self.attempts.forget(taken.job.id)
            self._finishing -= taken.finishing
        if not task.cancelled() and task.exception() is not None and taken is not None:
            # Its execution is no longer heartbeated: RQ puts the job back after the TTL.
            log.error(
                "job %s: unexpected error, it will run again after the heartbeat TTL",
                taken.job.id,
                exc_info=task.exception(),
                extra=self.books.log_context(taken),
            )

    async def _drain(self) -> None:
        """Put the jobs taken ahead back at once; let in-flight jobs finish within the grace
        period, and put the rest back then."""
        if self._ready:
            ready, self._ready = list(self._ready), deque()
            await self.redis(self.books.requeue, ready)
            log.info(
                "worker %s: put %d jobs taken ahead back on their queues",
                self.books.name,
                len(ready),
                extra=self.books.log_context(),
            )
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
            extra=self.books.log_context(),
        )

    def _finish(self, t: Taken) -> None:
        """The job has its ending: never requeue it, and let another job have its slot."""
        t.finishing = True
        self._finishing += 1
        self._slot_freed.set()

    # -- background -------------------------------------------------------------------------

    async def _heartbeats(self) -> None:
        interval = max(1.0, self.config.heartbeat_ttl / 6)
        while True:
            await asyncio.sleep(interval)
            self._drop_stale_ready()
            await self.redis(self.books.heartbeat_all, [*self._in_flight.values(), *self._ready])

    async def _reports(self) -> None:
        """genq's own numbers (in flight, retrying) for status and monitor, every few seconds."""
        while True:
            await self.redis(
                self.books.report,
                len(self._in_flight),
                dict(self.attempts.retrying),
                self.attempts.retries,
                self.concurrency.target,
                self.attempts.suspects,
                self.attempts.probation_s,
                self.gate.held,
            )
            await asyncio.sleep(REPORT_EVERY_S)

    async def _maintenance(self) -> None:
        interval = max(2.0, self.config.heartbeat_ttl / 4)
        while True:
            await self.redis(self.books.refresh_queues, on=self._maintenance_thread)
            await self.redis(self.books.reap, int(interval), on=self._maintenance_thread)
            await asyncio.sleep(interval)
