"""The server gate (decision 7): may this worker send to its server now?

:class:`ServerGate` owns the server as this worker sees it: up or down, its lives (a crash or an
outage ends one), the generations it served, the probe that picks the backend before any job is
taken, the probing while it is down, a refused API key, and the /health watch. It is one object so
that every send and every take asks the same gate: the Worker before taking or starting a job,
:class:`~worker.attempts.Attempts` before sending and after a send failed or came back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from genq import backends, backoff
from genq.backends import Backend, Http, ServerInfo, ServerRefused
from genq.backends.base import AttemptError
from genq.terminal import duration
from genq.worker.config import WorkerConfig
from genq.worker.rq_worker import Bookkeeper

log = logging.getLogger("genq.worker")
HEALTH_EVERY_S = 10.0
# Answers of this many jobs in a row wrong the same way (Answer.check's rule), no right answer
# between: the server's configuration (SGLang started with --skip-tokenizer-init behind genq's
# back), not the jobs' fault. Three: one or two wrong answers are the jobs' own (charged, as any
# failed attempt); a third job's the same way, with none right between, is a pattern.
WRONG_IN_A_ROW = 3
# A hold for wrong answers waits this long before its first probe, doubling with each hold that
# follows without a right answer between (a probe that passes while the jobs' answers stay wrong
# must not reopen the gate at once, again and again).
WRONG_HOLD_S, WRONG_HOLD_MAX_S = 1.0, 60.0
# Exit status of a worker whose server cannot serve genq: the systemd unit does not restart it.
EXIT_REFUSED = 78


class ServerGate:
    """Up or down, and the server's lives and answers as seen by this worker.

    Closed after ``down_after`` failed connections in a row (at once after a crash or a refused
    key), or after WRONG_IN_A_ROW jobs' answers wrong the same way, it stays closed until the
    server is probed again and passes (its facts read anew: a restarted server may have other
    flags); each reopening starts a new life, so a failure of a send made in an earlier life
    cannot close it again.
    """

    def __init__(self, config: WorkerConfig, http: Http, books: Bookkeeper) -> None:
        self.config = config
        self.http = http
        self.books = books  # for its name and the log lines' context
        self.backend: Backend  # chosen by the probe (know_server)
        self._up = asyncio.Event()
        self._up.set()
        self._failures = 0
        self.served = 0  # generations the server returned to this worker
        self.life = 0  # the server's restarts seen by this worker (a crash ends a life)
        self._tasks: list[asyncio.Task] = []  # the probes until the server is up again
        self.held: str | None = None  # why the gate is closed, while it is (status shows it)
        # The jobs whose answers came back wrong the same way (rule) since the last right answer.
        self._wrong_rule: str | None = None
        self._wrong_jobs: set[str] = set()
        self._wrong_since = 0.0  # when the first send of the run of wrong answers was made
        self._wrong_holds = 0  # holds for wrong answers since the last right answer
        self._held_for: dict[int, str] = {}  # life -> the rule its answers were held for at its end
        self.on_up: list[Callable[[], None]] = []  # told each time the gate reopens

    async def know_server(self, stopping: asyncio.Event) -> ServerInfo | None:
        """Probe the server before taking any job (decision 13); wait while it is not up yet.

        A server genq cannot use (wrong engine or version, a refused key) ends the worker with
        one line and EXIT_REFUSED, before a single job has paid for it.
        """
        delays = backoff.doubling(1.0, 30.0)
        since = time.monotonic()
        while not stopping.is_set():
            delay = next(delays)
            # A server that hangs (its probe may wait out a 120 s deadline) must not hold up a
            # SIGTERM: the probe is given up the moment a stop is asked for.
            probe = asyncio.ensure_future(self._probe())
            stop = asyncio.ensure_future(stopping.wait())
            await asyncio.wait({probe, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not probe.done():
                probe.cancel()
                await asyncio.gather(probe, return_exceptions=True)
                return None
            try:
                return probe.result()
            except ServerRefused as exc:
                log.error("worker %s: %s", self.books.name, exc, extra=self.books.log_context())
                raise SystemExit(EXIT_REFUSED) from exc
            except AttemptError as exc:
                hint = "; is it running? check --server (GENQ_SERVER)" if exc.kind == "connection" else ""
                if exc.rule is not None:  # its probe's answer is wrong: every job's would be
                    hint = f": {self.backend.wrong_answers_hint(exc)}"
                log.warning(
                    "server %s not ready (%s), waited %s so far; probing again in %.0f s%s",
                    self.config.server,
                    exc,
                    duration(time.monotonic() - since),
                    delay,
                    hint,
                    extra={**self.books.log_context(), "server": self.config.server},
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), delay)
        return None

    async def _probe(self) -> ServerInfo:
        self.backend = await backends.choose(self.config.backend, self.http, self.config.model)
        return await self.backend.probe()

    def is_up(self) -> bool:
        return self._up.is_set()

    async def wait_up(self) -> None:
        await self._up.wait()

    def served_one(self, sent: float) -> None:
        """The server answered a send (made at ``sent``) rightly: it is serving, whatever failed
        before. A run of wrong answers ends only at a right answer to a send made after the run's
        first: one sent before says nothing of how the server answers now."""
        self.served += 1
        self._failures = 0
        if sent >= self._wrong_since:
            self._wrong_rule, self._wrong_holds = None, 0
            self._wrong_jobs.clear()

    def wrong_answer(self, job_id: str, exc: AttemptError, life: int, sent: float) -> bool:
        """An answer that is not one the engine could have given the job (``exc.rule`` says how).
        True: the server's doing, the send is not the job's to pay for: the answers of
        WRONG_IN_A_ROW jobs in a row were wrong this same way with no right one between (the gate
        holds the worker's jobs now, saying why once), or the send was made in a life that ended
        in such a hold. False: the job's own wrong answer, charged as any failed attempt."""
        if exc.rule is None:
            return False
        if self._held_for.get(life) == exc.rule:
            return True
        if life != self.life or not self._up.is_set():
            return False
        if exc.rule != self._wrong_rule:
            self._wrong_rule, self._wrong_jobs, self._wrong_since = exc.rule, set(), sent
        self._wrong_jobs.add(job_id)
        if len(self._wrong_jobs) < WRONG_IN_A_ROW:
            return False
        self._held_for[life] = exc.rule
        self._wrong_holds += 1
        first = min(WRONG_HOLD_MAX_S, WRONG_HOLD_S * 2 ** (self._wrong_holds - 1))
        why = (
            f"answered {len(self._wrong_jobs)} jobs in a row wrongly the same way ({exc.message}), none "
            f"right between: {self.backend.wrong_answers_hint(exc)}"
        )
        self.close(why, None, first)
        return True

    async def answered_through(self, life: int) -> bool:
        """The server answers /health now, and has not been down since ``life`` began (its gate did
        not close and reopen meanwhile: a health check that started during an outage may answer
        only once it is over)."""
        healthy = await self.backend.healthy()
        return healthy and self.life == life and self._up.is_set()

    def note_failure(self, why: str, life: int | None = None, at_once: bool = False) -> None:
        """Decision 7: a server that is down gets probed, not fed jobs (nor burns their attempts).
        A failure of a send made before the server was last seen coming back (``life``) belongs
        to the outage already over: it closes nothing, or the gate would flap."""
        if life is not None and life != self.life:
            return
        self._failures += 1
        if at_once or self._failures >= self.config.down_after:
            self.close(f"server looks down ({why})", self.backend.healthy)

    def close(self, why: str, check: Callable[[], Any] | None, first_delay: float = 0.0) -> None:
        """Take no jobs until ``check`` (cheap: /health) passes and the server's probe does."""
        if not self._up.is_set():
            return
        self._up.clear()
        self.held = why
        log.warning(
            "%s %s; taking no jobs, probing until it answers",
            self.config.server,
            why,
            extra={**self.books.log_context(), "server": self.config.server},
        )
        self._tasks.append(asyncio.create_task(self._probe_until_up(check, first_delay)))

    def refused_key(self, exc: AttemptError) -> None:
        """A 401/403: closed until the probe's generation passes with the key as it is then
        (GENQ_SERVER_API_KEY_FILE is read again, so fixing the file is enough)."""
        self.close(f"the server refused the API key ({exc})", None)

    async def _probe_until_up(self, check: Callable[[], Any] | None, first_delay: float) -> None:
        await asyncio.sleep(first_delay)
        delays = backoff.doubling(1.0, 30.0)
        said: set[str] = set()
        while not ((check is None or await check()) and await self._probes_again(said)):
            await asyncio.sleep(next(delays))
        log.info(
            "server %s is up again; resuming",
            self.config.server,
            extra={**self.books.log_context(), "server": self.config.server},
        )
        self.life += 1
        self._failures = 0
        self.held = None
        self._wrong_rule, self._wrong_jobs = None, set()  # a new life's answers are counted anew
        self._up.set()
        for told in self.on_up:
            told()

    async def _probes_again(self, said: set[str]) -> bool:
        """The server's facts read again and its probe's generation checked, as at start: a server
        that came back may have come back with other flags (--skip-tokenizer-init), another model
        or another key. Why it does not pass is said once per reason."""
        before = self.backend.info
        try:
            info = await self.backend.probe()
        except (ServerRefused, AttemptError) as exc:
            why = str(exc)
            if isinstance(exc, AttemptError) and exc.rule is not None:
                why += f": {self.backend.wrong_answers_hint(exc)}"
            if why not in said:
                said.add(why)
                log.warning(
                    "server %s answers again but does not pass genq's probe (%s); probing on",
                    self.config.server,
                    why,
                    extra={**self.books.log_context(), "server": self.config.server},
                )
            return False
        if before is None or info.summary() != before.summary():
            for note in info.notes:  # it came back otherwise than it was: said as at start
                log.warning(
                    "server %s came back as %s: %s",
                    self.config.server,
                    info.summary(),
                    note,
                    extra=self.books.log_context(),
                )
        return True

    async def watch_health(self) -> None:
        """Probe /health now and then, so a dead server is noticed even between requests."""
        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            if self._up.is_set() and not await self.backend.healthy():
                self.note_failure("/health failed")

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
