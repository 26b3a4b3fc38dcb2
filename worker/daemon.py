"""The asyncio worker: C jobs in flight in one process, read top to bottom.

One event loop does the HTTP, through a backend (genq/backends: the engine's API); every
Redis/RQ call goes to :class:`~worker.bookkeeping.Bookkeeper` on a single thread, so the loop
never blocks on Redis and RQ's one-job-at-a-time worker state is only ever touched by one caller.

What a failed send costs is decided in one place, :meth:`Worker._judge`; docs/failures.md is the
table of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import secrets
import signal
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
import redis

from genq import backends, conversation, logprobs
from genq.backends import Answer, Backend, Http, ServerInfo, ServerRefused
from genq.backends.base import AttemptError, Cost
from genq.keys import Keys
from genq.schema import KIND_RECORD, JobSpec, error_record
from genq.templates import ChatTemplate, TemplateError
from worker import metrics
from worker.bookkeeping import Bookkeeper, Finished, Taken
from worker.commits import GroupCommit
from worker.config import WorkerConfig
from worker.probation import Probation
from worker.record import build_record
from worker.retry import backoff

log = logging.getLogger("genq.worker")
T = TypeVar("T")
HEALTH_EVERY_S = 10.0
REPORT_EVERY_S = 2.0
# Exit status of a worker whose server cannot serve genq: the systemd unit does not restart it.
EXIT_REFUSED = 78


# A conversation's turn being sent: (0-based index, number of turns); None for a single prompt.
_TurnOf = tuple[int, int] | None
_RETRY = object()  # a send failed and may be retried


@dataclass
class _Tries:
    """One job's (or one turn's) sends so far, in this worker."""

    started: float
    attempt: int = 0  # the attempt that answered
    failures: int = 0
    delay: float = 0.0
    last_sent: float = 0.0
    last: AttemptError | None = None
    crash_lives: set[int] = field(default_factory=set)  # the server lives it was dropped at the end of


class Worker:
    def __init__(self, conn: redis.Redis, keys: Keys, config: WorkerConfig, http: Http):
        self.config = config
        self.keys = keys
        self.http = http
        self.backend: Backend
        self.books = Bookkeeper(conn, keys, config.heartbeat_ttl, config.server)
        self._redis_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genq-redis")
        # Takes and maintenance on threads of their own: on a slow link a take must not wait
        # behind the hand-overs and the reaper's round trips (worker/bookkeeping.py).
        self._take_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genq-take")
        self._maintenance_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genq-reap")
        self._in_flight: dict[asyncio.Task, Taken] = {}
        self._finishing = 0  # jobs of _in_flight handing their result over: they free their slot
        self._ready: deque[Taken] = deque()  # taken ahead, waiting for a slot
        # The last takes' round trips: on a lossy link one in a few waits for a retransmission.
        self._take_s: deque[float] = deque([0.0], maxlen=16)
        self._ended: deque[float] = deque(maxlen=256)  # when the last jobs ended: the rate slots free
        self._aborts: set[asyncio.Task] = set()
        self._commits = GroupCommit(lambda charges, ends: self.redis(self.books.commit, charges, ends))
        self._stopping = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._server_up = asyncio.Event()
        self._server_up.set()
        self._server_failures = 0
        self._signals = 0
        self._background: list[asyncio.Task] = []
        self._retrying: Counter[str] = Counter()  # per dataset, jobs between two attempts
        self._retries = 0
        self._served = 0  # generations the server returned to this worker
        self._life = 0  # the server's restarts seen by this worker (a crash ends a life)
        self._probation = Probation()
        self._templates: dict[bytes, ChatTemplate] = {}  # chat templates of conversation datasets
        self._template_lock = asyncio.Lock()
        self._suspects: dict[str, _Tries] = {}  # job id -> its tries, for jobs on probation

    def _ctx(self, t: Taken | None = None) -> dict[str, Any]:
        """The context of a log line (fields of --log-format json)."""
        ctx: dict[str, Any] = {"worker": self.books.name}
        if t is not None:
            ctx.update(job_id=t.job.id, dataset=t.spec.dataset)
        return ctx

    # -- plumbing ---------------------------------------------------------------------------

    async def redis(self, fn: Callable[..., T], *args: Any, on: ThreadPoolExecutor | None = None) -> T:
        """Run an RQ/Redis call on the Redis thread (or ``on`` another); ride out Redis restarts
        with backoff."""
        loop = asyncio.get_running_loop()
        delay = 0.5
        while True:
            try:
                return await loop.run_in_executor(on or self._redis_thread, fn, *args)
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
        info = await self._know_server()
        if info is None:
            return  # stopped while waiting for the server
        await self.redis(self.books.start, {k: str(v) for k, v in info.summary().items() if v is not None})
        log.info(
            "worker %s: serving %s (%s%s %s, model %s) with %d in flight at most",
            self.books.name,
            self.config.server,
            info.backend,
            " detected" if self.config.backend == "auto" else "",
            info.version or "?",
            info.model or "?",
            self.config.concurrency,
            extra={**self._ctx(), "server": self.config.server},
        )
        for note in info.notes:
            log.warning("server %s: %s", self.config.server, note, extra=self._ctx())
        metrics.watch(
            lambda: len(self._in_flight), lambda: sum(self._retrying.values()), self._server_up.is_set
        )
        self._background += [
            asyncio.create_task(self._commits.run()),
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
        for thread in (self._take_thread, self._maintenance_thread, self._redis_thread):
            thread.shutdown(wait=True)
        log.info("worker %s: stopped", self.books.name, extra=self._ctx())

    async def _know_server(self) -> ServerInfo | None:
        """Probe the server before taking any job (decision 13); wait while it is not up yet.

        A server genq cannot use (wrong engine or version, a refused key) ends the worker with
        one line and EXIT_REFUSED, before a single job has paid for it.
        """
        delay = 1.0
        while not self._stopping.is_set():
            # A server that hangs (its probe may wait out a 120 s deadline) must not hold up a
            # SIGTERM: the probe is given up the moment a stop is asked for.
            probe = asyncio.ensure_future(self._probe())
            stop = asyncio.ensure_future(self._stopping.wait())
            await asyncio.wait({probe, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not probe.done():
                probe.cancel()
                await asyncio.gather(probe, return_exceptions=True)
                return None
            try:
                return probe.result()
            except ServerRefused as exc:
                log.error("worker %s: %s", self.books.name, exc, extra=self._ctx())
                raise SystemExit(EXIT_REFUSED) from exc
            except AttemptError as exc:
                log.warning(
                    "server %s not ready (%s); probing again in %.0f s",
                    self.config.server,
                    exc,
                    delay,
                    extra={**self._ctx(), "server": self.config.server},
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            delay = min(delay * 2, 30.0)
        return None

    async def _probe(self) -> ServerInfo:
        self.backend = await backends.choose(self.config.backend, self.http, self.config.model)
        return await self.backend.probe()

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
                # Suspects waiting for their turn, and jobs handing their result over, hold no
                # connection: they take no slot.
                busy = len(self._in_flight) - self._finishing - self._probation.waiting
                free = self.config.concurrency - busy
                self._drop_stale_ready()
                while free > 0 and self._ready and self._server_up.is_set():
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
                elif self._server_up.is_set() and (free > 0 or len(self._ready) <= prefetch // 2):
                    taking = asyncio.create_task(self._take(min(free + prefetch - len(self._ready), 256)))
                    taking.add_done_callback(lambda _: self._slot_freed.set())
                    continue
                if self.config.burst and not self._in_flight and not self._ready and await self._all_done():
                    log.info(
                        "worker %s: burst: nothing queued or in flight", self.books.name, extra=self._ctx()
                    )
                    return
                idle_polls += 1
                if idle_polls % 20 == 0:
                    await self.redis(self.books.refresh_queues, on=self._take_thread)
                await self._wait_for_slot(0.25 if free > 0 else 5)
        finally:
            if taking is not None:  # its jobs are started in RQ: _drain puts them back
                self._ready.extend((await taking)[1])

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
        retransmission timeout (200 ms or more) while every slot that frees meanwhile waits."""
        ended = self._ended
        rate = (len(ended) - 1) / (ended[-1] - ended[0]) if len(ended) > 1 and ended[-1] > ended[0] else 0.0
        wanted = math.ceil(2 * rate * max(self._take_s))
        return max(self.config.prefetch, min(wanted, self.config.concurrency))

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
            extra=self._ctx(),
        )

    def _start(self, t: Taken) -> None:
        task = asyncio.create_task(self._run_job(t))
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
            extra=self._ctx(),
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), 2)

    def _job_done(self, task: asyncio.Task) -> None:
        taken = self._in_flight.pop(task, None)
        self._slot_freed.set()
        self._ended.append(time.monotonic())
        if taken is not None:
            self._suspects.pop(taken.job.id, None)
            self._finishing -= taken.finishing
        if not task.cancelled() and task.exception() is not None and taken is not None:
            # Its execution is no longer heartbeated: RQ puts the job back after the TTL.
            log.error(
                "job %s: unexpected error, it will run again after the heartbeat TTL",
                taken.job.id,
                exc_info=task.exception(),
                extra=self._ctx(taken),
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
                extra=self._ctx(),
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
            extra=self._ctx(),
        )

    # -- one job ----------------------------------------------------------------------------

    async def _run_job(self, t: Taken) -> None:
        """Send until the job ends: a record, or an error for errors.jsonl."""
        if t.spec.logprobs is not None and not self.backend.logprobs:
            why = f"the job asks for logprobs, which the {self.backend.name} backend cannot return"
            await self._fail(t, AttemptError("bad_request", why, cost=Cost.FATAL), 0)
            return
        if t.spec.turns == "all":
            await self._run_conversation(t)
            return
        tries = _Tries(started=time.monotonic())
        answer = await self._answer(t, t.spec, tries)
        if answer is not None:
            frame = logprobs.pack(t.spec.id, answer.logprobs) if answer.logprobs is not None else None
            await self._succeed(t, self._record(t.spec, answer, tries), frame)

    async def _run_conversation(self, t: Taken) -> None:
        """Every user turn in order, each sent with the model's own earlier answers (decision 14).
        Finished turns are kept in Redis, so a job whose worker died goes on from its first
        unfinished turn; each turn has the whole attempt budget."""
        spec, job_id = t.spec, t.job.id
        messages = spec.messages or []
        n = conversation.user_turns(messages)
        done: list[dict[str, Any]] = await self.redis(self.books.turns_done, job_id)
        answers = [conversation.answer_message(d["content"], d["reasoning"]) for d in done]
        template = None
        if self.backend.sends == "ids":
            try:
                template = await self._template(spec)
            except TemplateError as exc:
                await self._fail(t, AttemptError("tokenizer", str(exc), cost=Cost.FATAL), 0)
                return
        started = time.monotonic()
        record: dict[str, Any] = {}
        for k in range(len(done), n):
            prompt = conversation.turn_prompt(messages, answers, k)
            ids = None
            if template is not None:
                ids = (await asyncio.to_thread(template.render, [prompt]))[0]
                why = ids if isinstance(ids, str) else None
                if k == 0 and why is None and spec.input_ids is not None and ids != spec.input_ids:
                    why = "the worker's chat template renders the first turn differently from enqueue's"
                if why is not None:
                    await self._fail(t, AttemptError("bad_request", why, cost=Cost.FATAL), 0, (k, n))
                    return
            turn = dataclasses.replace(spec, input_ids=ids, messages=prompt, text=None, turns=None)
            tries = _Tries(started=time.monotonic())
            answer = await self._answer(t, turn, tries, (k, n))
            if answer is None:
                return
            record = self._record(turn, answer, tries)
            done.append({key: record.get(key) for key in conversation.TURN_FIELDS})
            answers.append(conversation.answer_message(record["content"], record["reasoning"]))
            if k < n - 1:
                await self.redis(self.books.save_turns, job_id, done)
        record.update(conversation.totals(done), latency_s=round(time.monotonic() - started, 4), turns=done)
        await self._succeed(t, record)

    async def _template(self, spec: JobSpec) -> ChatTemplate:
        """The dataset's chat template, loaded once per worker (transformers, offline)."""
        key = orjson.dumps(spec.template, option=orjson.OPT_SORT_KEYS)
        async with self._template_lock:  # one load at a time: transformers' import is not thread-safe
            if key not in self._templates:
                self._templates[key] = await asyncio.to_thread(ChatTemplate.from_spec, spec.template or {})
        return self._templates[key]

    def _record(self, spec: JobSpec, answer: Answer, tries: _Tries) -> dict[str, Any]:
        return build_record(
            spec,
            answer,
            attempts=tries.attempt,
            latency_s=time.monotonic() - tries.started,
            server=self.config.server,
            worker=self.books.name,
            backend=self.backend.name,
        )

    async def _succeed(self, t: Taken, record: dict[str, Any], frame: bytes | None = None) -> None:
        self._finish(t)
        await self._commits.finish(Finished(t, KIND_RECORD, record, frame))
        metrics.finished(t.spec.dataset, record)

    def _finish(self, t: Taken) -> None:
        """The job has its ending: never requeue it, and let another job have its slot."""
        t.finishing = True
        self._finishing += 1
        self._slot_freed.set()

    async def _answer(self, t: Taken, spec: JobSpec, tries: _Tries, turn: _TurnOf = None) -> Answer | None:
        """Send ``spec`` until an answer comes, or None once the job failed for good."""
        while True:
            outcome = await self._try_once(t, spec, tries, turn)
            if outcome is not _RETRY:
                return outcome  # type: ignore[return-value]
            await self._wait_to_retry(spec.dataset, tries.delay)

    async def _try_once(
        self, t: Taken, spec: JobSpec, tries: _Tries, turn: _TurnOf
    ) -> Answer | None | object:
        """One send (a suspect waits for its turn first)."""
        await self._server_up.wait()
        holds_turn = False
        if t.crashes > 0:
            self._suspects[t.job.id] = tries
            holds_turn = await self._probation.turn(t.job.id, t.crashes, tries.last_sent)
        try:
            return await self._send(t, spec, tries, turn)
        finally:
            if holds_turn:
                self._probation.done()

    async def _send(self, t: Taken, spec: JobSpec, tries: _Tries, turn: _TurnOf) -> Answer | None | object:
        """The answer; None when the job failed for good; _RETRY to send again after tries.delay."""
        job_id = t.job.id  # RQ's, namespaced; spec.id: the record's
        attempt, t.charged = t.charged or await self._commits.charge(job_id), 0
        if attempt > self.config.max_attempts:
            why = tries.last or AttemptError(
                "attempts_exhausted",
                f"used its {self.config.max_attempts} attempts without an answer "
                "(the workers running it stopped or died)",
            )
            await self._fail(t, why, attempt - 1, turn)
            return None
        # A fresh rid on every send, and none a prefix of another: SGLang refuses a rid it still
        # holds, and aborts every rid that starts with the one given. Job ids hold no ".", and the
        # random tail has a fixed length.
        rid = f"{job_id}.{attempt}.{secrets.token_hex(6)}"
        served, life = self._served, self._life
        tries.last_sent = sent = time.monotonic()
        try:
            answer = await self.backend.generate(spec, rid, self.config.attempt_timeout(spec.max_new_tokens))
        except asyncio.CancelledError:
            await self.backend.abort(rid)
            raise
        except AttemptError as exc:
            metrics.attempt(time.monotonic() - sent, exc)
            tries.last = exc
            if exc.kind == "timeout":
                # In the background: an unreachable server would hold the job (and the gate's
                # verdict) for the abort's own timeout.
                abort = asyncio.create_task(self.backend.abort(rid))
                self._aborts.add(abort)
                abort.add_done_callback(self._aborts.discard)
            ending = await self._judge(t, tries, exc, attempt, served, life)
            if ending is not None:
                await self._fail(t, *ending, turn)
                return None
            tries.failures += 1
            self._retries += 1
            tries.delay = backoff(
                tries.failures, self.config.backoff_base, self.config.backoff_cap, exc.retry_after
            )
            log.info(
                "job %s (%s): attempt %d failed: %s; retrying in %.1f s",
                job_id,
                spec.dataset,
                attempt,
                exc,
                tries.delay,
                extra={
                    **self._ctx(t),
                    "attempt": attempt,
                    "error": exc.kind,
                    "delay_s": round(tries.delay, 1),
                },
            )
            return _RETRY
        metrics.attempt(time.monotonic() - sent, None)
        self._served += 1
        self._server_failures = 0
        tries.attempt = attempt
        return answer

    async def _judge(
        self, t: Taken, tries: _Tries, exc: AttemptError, attempt: int, served: int, life: int
    ) -> tuple[AttemptError, int] | None:
        """What a failed send costs (decision 7, docs/failures.md). Returns (error, attempts) when
        the job must end now, else None: retry, with the send charged or spared."""
        cost = exc.cost
        if exc.dropped:
            if await self.backend.healthy():
                cost = Cost.ATTEMPT  # the server is fine: the drop was this request's
            else:
                return await self._crashed(t, tries, exc, attempt)
        elif exc.kind == "timeout" and not await self._answered_through(life):
            # No answer, and the server was unreachable or hung (a partition, SIGSTOP) meanwhile:
            # whatever it answered others before, no fault of this prompt.
            exc.down = True
            return await self._spare(t, exc, attempt, life)
        if cost is Cost.FATAL:
            return exc, attempt
        if cost is Cost.ATTEMPT:
            return None
        if cost is Cost.SERVER and self._served > served:
            # The server answered other jobs while this one was in flight: its failure is this
            # prompt's own (SGLang's "Request running timeout reached." for a long generation).
            return None
        if cost is Cost.SERVER:
            return await self._spare(t, exc, attempt, life)
        await self.redis(self.books.spare, t.job.id, None)  # FREE or AUTH: no work was done
        if cost is Cost.AUTH:
            self._close_gate(f"the server refused the API key ({exc})", self._auth_works)
        elif exc.down:
            self._note_server_failure(str(exc), life)
        return None

    async def _answered_through(self, life: int) -> bool:
        """The server answers /health now, and has not been down since ``life`` began (its gate did
        not close and reopen meanwhile: a health check that started during an outage may answer
        only once it is over)."""
        healthy = await self.backend.healthy()
        return healthy and self._life == life and self._server_up.is_set()

    async def _spare(
        self, t: Taken, exc: AttemptError, attempt: int, life: int
    ) -> tuple[AttemptError, int] | None:
        """A send the server failed: not charged, but counted, and bounded by --max-spared."""
        spared = await self.redis(self.books.spare, t.job.id, self.keys.spared)
        if exc.down:
            self._note_server_failure(str(exc), life)
        if spared > self.config.max_spared:
            return AttemptError(
                exc.kind,
                f"{exc.message} (the server failed this prompt {spared} times while it served "
                "no other job of this worker; --max-spared bounds that)",
                exc.status,
            ), attempt - 1
        return None

    async def _crashed(
        self, t: Taken, tries: _Tries, exc: AttemptError, attempt: int
    ) -> tuple[AttemptError, int] | None:
        """The connection died and /health fails: the server crashed with this job in flight."""
        crashes = await self.redis(self.books.spare, t.job.id, self.keys.crashes)
        t.crashes = crashes
        tries.crash_lives.add(self._life)
        self._suspects[t.job.id] = tries
        self._note_server_failure(f"{exc}; /health fails", at_once=True)
        if crashes < self.config.max_crashes:
            return None
        pardoned = [
            job_id
            for job_id, other in self._suspects.items()
            if job_id != t.job.id and other.crash_lives & tries.crash_lives
        ]
        for job_id in pardoned:
            self._suspects.pop(job_id)
            self._probation.pardon(job_id)
        for other in self._in_flight.values():
            if other.job.id in pardoned:
                other.crashes = 0
        await self.redis(self.books.pardon, pardoned)
        log.warning(
            "job %s (%s): in flight at %d server crashes: failing it as the suspect; %d jobs dropped "
            "by the same crashes leave probation",
            t.job.id,
            t.spec.dataset,
            crashes,
            len(pardoned),
            extra={**self._ctx(t), "error": "suspect_crash"},
        )
        message = (
            f"the server crashed {crashes} times with this prompt in flight (resent alone among the "
            f"jobs those crashes dropped); last: {exc.message}"
        )
        return AttemptError("suspect_crash", message, exc.status), attempt - 1

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

    async def _fail(self, t: Taken, exc: AttemptError, attempts: int, turn: _TurnOf = None) -> None:
        message = exc.message if turn is None else f"turn {turn[0] + 1} of {turn[1]}: {exc.message}"
        log.warning(
            "job %s (%s): failed for good after %d attempts: %s",
            t.job.id,
            t.spec.dataset,
            attempts,
            f"{exc.kind}: {message}",
            extra={**self._ctx(t), "attempt": attempts, "error": exc.kind},
        )
        error = error_record(
            id=t.spec.id,
            dataset=t.spec.dataset,
            row=t.spec.row,
            sample=t.spec.sample,
            source_id=t.spec.source_id,
            error=exc.kind,
            message=message,
            status=exc.status,
            attempts=attempts,
        )
        if turn is not None:
            error["turn"] = turn[0] + 1
        self._finish(t)
        await self.redis(self.books.fail, t, error)
        metrics.finished(t.spec.dataset, None)

    # -- the server gate --------------------------------------------------------------------

    def _note_server_failure(self, why: str, life: int | None = None, at_once: bool = False) -> None:
        """Decision 7: a server that is down gets probed, not fed jobs (nor burns their attempts).
        A failure of a send made before the server was last seen coming back (``life``) belongs
        to the outage already over: it closes nothing, or the gate would flap."""
        if life is not None and life != self._life:
            return
        self._server_failures += 1
        if at_once or self._server_failures >= self.config.down_after:
            self._close_gate(f"server looks down ({why})", self.backend.healthy)

    def _close_gate(self, why: str, check: Callable[[], Any]) -> None:
        if not self._server_up.is_set():
            return
        self._server_up.clear()
        log.warning(
            "%s %s; taking no jobs, probing until it answers",
            self.config.server,
            why,
            extra={**self._ctx(), "server": self.config.server},
        )
        self._background.append(asyncio.create_task(self._probe_until_up(check)))

    async def _probe_until_up(self, check: Callable[[], Any]) -> None:
        delay = 1.0
        while not await check():
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)
        log.info(
            "server %s is up again; resuming",
            self.config.server,
            extra={**self._ctx(), "server": self.config.server},
        )
        self._life += 1
        self._server_failures = 0
        self._server_up.set()

    async def _auth_works(self) -> bool:
        """The gate's check after a 401/403: the probe's tiny generation, with the key as it is now
        (GENQ_SERVER_API_KEY_FILE is read again, so fixing the file is enough)."""
        try:
            await self.backend.probe()
        except (ServerRefused, AttemptError):
            return False
        return True

    async def _watch_health(self) -> None:
        """Probe /health now and then, so a dead server is noticed even between requests."""
        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            if self._server_up.is_set() and not await self.backend.healthy():
                self._note_server_failure("/health failed")

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
            await self.redis(self.books.report, len(self._in_flight), dict(self._retrying), self._retries)
            await asyncio.sleep(REPORT_EVERY_S)

    async def _maintenance(self) -> None:
        interval = max(2.0, self.config.heartbeat_ttl / 4)
        while True:
            await self.redis(self.books.refresh_queues, on=self._maintenance_thread)
            await self.redis(self.books.reap, int(interval), on=self._maintenance_thread)
            await asyncio.sleep(interval)
