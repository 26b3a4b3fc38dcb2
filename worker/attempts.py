"""A job's sends to the server, and what each failed one costs (decision 7, docs/failures.md).

:class:`Attempts` owns everything between taking a job and its ending: the send, the judgement of
a failed send (:meth:`Attempts._judge`: charged, spared, a crash, or the end), the probation of
jobs in flight at server crashes and the pardon of the others, the backoff before the next send
(counted as retrying), and the failure for good. Kept apart from the Worker, which only takes
jobs and hands them here, and from the :class:`~worker.gate.ServerGate` it reports to.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from genq.backends import Answer
from genq.backends.base import AttemptError, Cost
from genq.keys import Keys
from genq.schema import KIND_ERROR, JobSpec, error_record
from genq.worker import metrics
from genq.worker.commits import GroupCommit
from genq.worker.concurrency import Concurrency
from genq.worker.config import WorkerConfig
from genq.worker.gate import ServerGate
from genq.worker.probation import Probation
from genq.worker.rq_worker import Bookkeeper, Finished, Taken

log = logging.getLogger("genq.worker")
# How fast send_s follows the sends: each answer moves it a fifth of the way to its own duration.
SEND_S_WEIGHT = 0.2

# A conversation's turn being sent: (0-based index, number of turns); None for a single prompt.
TurnOf = tuple[int, int] | None
RETRY = object()  # a send failed and may be retried


@dataclass
class Tries:
    """One job's (or one turn's) sends so far, in this worker."""

    started: float
    attempt: int = 0  # the attempt that answered
    failures: int = 0
    delay: float = 0.0
    last_sent: float = 0.0
    last: AttemptError | None = None
    crash_lives: set[int] = field(default_factory=set)  # the server lives it was dropped at the end of


def backoff(failures: int, base: float, cap: float, retry_after: float | None = None) -> float:
    """Exponential backoff with full jitter; never sooner than the server's Retry-After."""
    delay = random.uniform(0, min(cap, base * 2 ** max(0, failures - 1)))
    return max(delay, retry_after or 0.0)


class Attempts:
    """The sends of the jobs in flight: judged, spared, retried, or ended (decision 7).

    Holds the per-dataset count of jobs waiting between two sends (``retrying``), the number of
    retries, the probation of crash suspects, and the aborts of timed-out sends.
    """

    def __init__(
        self,
        config: WorkerConfig,
        keys: Keys,
        books: Bookkeeper,
        redis: Callable[..., Awaitable[Any]],
        commits: GroupCommit,
        gate: ServerGate,
        in_flight: Callable[[], Iterable[Taken]],
        finish: Callable[[Taken], None],
        concurrency: Concurrency,
        stopping: Callable[[], bool],
    ) -> None:
        self.config = config
        self._stopping = stopping  # a stop was asked for: the server may be going down with us
        self.concurrency = concurrency  # told each answer's latency and each 429 (--concurrency auto)
        self.keys = keys
        self.books = books
        self.redis = redis  # Worker.redis: a call on the Redis thread, riding out Redis restarts
        self.commits = commits
        self.gate = gate
        self._in_flight = in_flight  # the jobs in flight now
        self._finish = finish  # Worker._finish: the job has its ending
        self.retrying: Counter[str] = Counter()  # per dataset, jobs between two attempts
        self.retries = 0
        self._probation = Probation()
        self._suspects: dict[str, Tries] = {}  # job id -> its tries, for jobs on probation
        self._aborts: set[asyncio.Task] = set()
        # Sends given up on whose abort could not reach the server (a partition): the server may
        # still be generating them, so they are told again when the gate reopens.
        self._untold: set[str] = set()
        gate.on_up.append(self._tell_again)
        self.send_s: float | None = None  # how long a send takes lately (None before the first answer)

    @property
    def waiting(self) -> int:
        """Suspects waiting for their turn: they hold no connection."""
        return self._probation.waiting

    @property
    def suspects(self) -> int:
        """Jobs on probation after a server crash (resent one at a time): status says so."""
        return len(self._suspects)

    @property
    def probation_s(self) -> float | None:
        """About how long the suspects take to pass, one at a time, each as long as a send takes
        lately; None while no send has been timed."""
        if not self._suspects:
            return 0.0
        return None if self.send_s is None else len(self._suspects) * self.send_s

    def forget(self, job_id: str) -> None:
        """The job ended: it is no longer a suspect."""
        self._suspects.pop(job_id, None)

    async def answer(self, t: Taken, spec: JobSpec, tries: Tries, turn: TurnOf = None) -> Answer | None:
        """Send ``spec`` until an answer comes, or None once the job failed for good."""
        while True:
            outcome = await self._try_once(t, spec, tries, turn)
            if outcome is not RETRY:
                return outcome  # type: ignore[return-value]
            await self._wait_to_retry(spec.dataset, tries.delay)

    async def _try_once(self, t: Taken, spec: JobSpec, tries: Tries, turn: TurnOf) -> Answer | None | object:
        """One send (a suspect waits for its turn first)."""
        await self.gate.wait_up()
        holds_turn = False
        if t.crashes > 0:
            self._suspects[t.job.id] = tries
            holds_turn = await self._probation.turn(t.job.id, t.crashes, tries.last_sent)
        try:
            return await self._send(t, spec, tries, turn)
        finally:
            if holds_turn:
                self._probation.done()

    async def _send(self, t: Taken, spec: JobSpec, tries: Tries, turn: TurnOf) -> Answer | None | object:
        """The answer; None when the job failed for good; RETRY to send again after tries.delay."""
        job_id = t.job.id  # RQ's, namespaced; spec.id: the record's
        attempt, t.charged = t.charged or await self.commits.charge(job_id), 0
        if attempt > self.config.max_attempts:
            why = tries.last or AttemptError(
                "attempts_exhausted",
                f"used its {self.config.max_attempts} attempts without an answer "
                "(the workers running it stopped or died)",
            )
            await self.fail(t, why, attempt - 1, turn)
            return None
        # A fresh rid on every send, and none a prefix of another: SGLang refuses a rid it still
        # holds, and aborts every rid that starts with the one given. Job ids hold no ".", and the
        # random tail has a fixed length.
        rid = f"{job_id}.{attempt}.{secrets.token_hex(6)}"
        served, life = self.gate.served, self.gate.life
        tries.last_sent = sent = time.monotonic()
        try:
            answer = await self.gate.backend.answer(
                spec, rid, self.config.attempt_timeout(spec.max_new_tokens)
            )
        except asyncio.CancelledError:
            await self.gate.backend.abort(rid)
            raise
        except AttemptError as exc:
            metrics.attempt(time.monotonic() - sent, exc)
            if exc.status == 429:
                self.concurrency.rate_limited()
            tries.last = exc
            if exc.kind == "timeout":
                # In the background: an unreachable server would hold the job (and the gate's
                # verdict) for the abort's own timeout.
                self._abort(rid)
            ending = await self._judge(t, tries, exc, attempt, served, life, sent)
            if ending is not None:
                await self.fail(t, *ending, turn)
                return None
            tries.failures += 1
            self.retries += 1
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
                    **self.books.log_context(t),
                    "attempt": attempt,
                    "error": exc.kind,
                    "delay_s": round(tries.delay, 1),
                },
            )
            return RETRY
        took = time.monotonic() - sent
        metrics.attempt(took, None)
        known = spec.input_ids is not None  # its footprint counted as it started
        tokens = (answer.completion_tokens, answer.prompt_tokens, spec.max_new_tokens)
        self.concurrency.answered(took, *tokens, known)
        self.send_s = took if self.send_s is None else self.send_s + SEND_S_WEIGHT * (took - self.send_s)
        self.gate.served_one(sent)
        tries.attempt = attempt
        return answer

    def _abort(self, rid: str) -> None:
        abort = asyncio.create_task(self._tell(rid))
        self._aborts.add(abort)
        abort.add_done_callback(self._aborts.discard)

    async def _tell(self, rid: str) -> None:
        if await self.gate.backend.abort(rid):
            self._untold.discard(rid)
        else:
            self._untold.add(rid)

    def _tell_again(self) -> None:
        """The server is back: the aborts it never got are sent now (after a partition its half-open
        connections would keep it generating what nobody will read)."""
        for rid in list(self._untold):
            self._abort(rid)

    async def _judge(
        self, t: Taken, tries: Tries, exc: AttemptError, attempt: int, served: int, life: int, sent: float
    ) -> tuple[AttemptError, int] | None:
        """What a failed send costs (decision 7, docs/failures.md). Returns (error, attempts) when
        the job must end now, else None: retry, with the send charged or spared."""
        cost = exc.cost
        if self.gate.wrong_answer(t.job.id, exc, life, sent):
            # Wrong as every job's answer is: the server's configuration, not this prompt's fault.
            return await self._spare(t, exc, attempt, life)
        if exc.dropped:
            if await self.gate.backend.healthy():
                cost = Cost.ATTEMPT  # the server is fine: the drop was this request's
            elif self._stopping():
                # Stopped with its server (Ctrl-C, `systemctl stop`, a Slurm job's end): the
                # operator's doing, not a crash this prompt is suspect of; the drain puts it back.
                cost, exc.down = Cost.FREE, True
            else:
                return await self._crashed(t, tries, exc, attempt)
        elif exc.kind == "timeout" and not await self.gate.answered_through(life):
            # No answer, and the server was unreachable or hung (a partition, SIGSTOP) meanwhile:
            # whatever it answered others before, no fault of this prompt.
            exc.down = True
            return await self._spare(t, exc, attempt, life)
        if cost is Cost.FATAL:
            return exc, attempt
        if cost is Cost.ATTEMPT:
            return None
        if cost is Cost.SERVER and self.gate.served > served:
            # The server answered other jobs while this one was in flight: its failure is this
            # prompt's own (SGLang's "Request running timeout reached." for a long generation).
            return None
        if cost is Cost.SERVER and not exc.down and await self.gate.answered_through(life):
            # The server said it is up and worked on this prompt (a 503 after work), and nothing
            # else was answered to judge by (the run's last job): the server itself judges.
            # SGLang's /health runs a one-token generation and answers 200 once the scheduler
            # answers (python/sglang/srt/entrypoints/http_server.py, health_generate, 0.5.x);
            # vLLM's answers 200 while its engine lives (vllm/entrypoints/serve/instrumentator/
            # health.py), llama.cpp's once the model is loaded. Healthy: the prompt's own failure,
            # charged, so its sends stay bounded by --max-attempts, not --max-spared.
            return None
        if cost in (Cost.SERVER, Cost.REPLICA):
            return await self._spare(t, exc, attempt, life)
        await self.redis(self.books.spare, t.job.id, None)  # FREE or AUTH: no work was done
        if cost is Cost.AUTH:
            self.gate.refused_key(exc)
        elif exc.down:
            self.gate.note_failure(str(exc), life)
        return None

    async def _spare(
        self, t: Taken, exc: AttemptError, attempt: int, life: int
    ) -> tuple[AttemptError, int] | None:
        """A send the server failed: not charged, but counted, and bounded by --max-spared."""
        spared = await self.redis(self.books.spare, t.job.id, self.keys.spared)
        if exc.down:
            self.gate.note_failure(str(exc), life)
        if spared > self.config.max_spared:
            if exc.rule is not None:
                where = "while it answered every job wrongly this way"
            elif exc.cost is Cost.REPLICA:
                where = "on replicas SGLang's router could not reach"
            else:
                where = "while it served no other job of this worker"
            return AttemptError(
                exc.kind,
                f"{exc.message} (the server failed this prompt {spared} times {where}; "
                "--max-spared bounds that)",
                exc.status,
            ), attempt - 1
        return None

    async def _crashed(
        self, t: Taken, tries: Tries, exc: AttemptError, attempt: int
    ) -> tuple[AttemptError, int] | None:
        """The connection died and /health fails: the server crashed with this job in flight."""
        crashes = await self.redis(self.books.spare, t.job.id, self.keys.crashes)
        t.crashes = crashes
        tries.crash_lives.add(self.gate.life)
        self._suspects[t.job.id] = tries
        self.gate.note_failure(f"{exc}; /health fails", at_once=True)
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
        for other in self._in_flight():
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
            extra={**self.books.log_context(t), "error": "suspect_crash"},
        )
        message = (
            f"the server crashed {crashes} times with this prompt in flight (resent alone among the "
            f"jobs those crashes dropped); last: {exc.message}"
        )
        return AttemptError("suspect_crash", message, exc.status), attempt - 1

    async def _wait_to_retry(self, dataset: str, delay: float) -> None:
        """Back off (and wait for a server that is down): meanwhile the job counts as retrying."""
        self.retrying[dataset] += 1
        await self.redis(self.books.set_retrying, dataset, self.retrying[dataset])
        try:
            await asyncio.sleep(delay)
            await self.gate.wait_up()
        finally:
            self.retrying[dataset] -= 1
            await self.redis(self.books.set_retrying, dataset, self.retrying[dataset])

    async def fail(self, t: Taken, exc: AttemptError, attempts: int, turn: TurnOf = None) -> None:
        message = exc.message if turn is None else f"turn {turn[0] + 1} of {turn[1]}: {exc.message}"
        log.warning(
            "job %s (%s): failed for good after %d attempts: %s",
            t.job.id,
            t.spec.dataset,
            attempts,
            f"{exc.kind}: {message}",
            extra={**self.books.log_context(t), "attempt": attempts, "error": exc.kind},
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
        if t.spec.extends is not None:  # an extension's ending: its record on disk stands
            error["extends"] = t.spec.extends
        self._finish(t)
        await self.commits.finish(Finished(t, KIND_ERROR, error))
        metrics.finished(t.spec.dataset, None)
