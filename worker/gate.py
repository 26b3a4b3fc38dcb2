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
from worker.config import WorkerConfig
from worker.rq_worker import Bookkeeper

log = logging.getLogger("genq.worker")
HEALTH_EVERY_S = 10.0
# Exit status of a worker whose server cannot serve genq: the systemd unit does not restart it.
EXIT_REFUSED = 78


class ServerGate:
    """Up or down, and the server's lives and answers as seen by this worker.

    Closed after ``down_after`` failed connections in a row (at once after a crash or a refused
    key), it stays closed until the server answers again; each reopening starts a new life, so a
    failure of a send made in an earlier life cannot close it again.
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
                log.warning(
                    "server %s not ready (%s), waited %s so far; probing again in %.0f s%s",
                    self.config.server,
                    exc,
                    duration(time.monotonic() - since),
                    delay,
                    "; is it running? check --server (GENQ_SERVER)" if exc.kind == "connection" else "",
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

    def served_one(self) -> None:
        """The server answered a send: it is serving, whatever failed before."""
        self.served += 1
        self._failures = 0

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

    def close(self, why: str, check: Callable[[], Any]) -> None:
        if not self._up.is_set():
            return
        self._up.clear()
        log.warning(
            "%s %s; taking no jobs, probing until it answers",
            self.config.server,
            why,
            extra={**self.books.log_context(), "server": self.config.server},
        )
        self._tasks.append(asyncio.create_task(self._probe_until_up(check)))

    def refused_key(self, exc: AttemptError) -> None:
        """A 401/403: closed until the probe's generation passes with the key as it is then."""
        self.close(f"the server refused the API key ({exc})", self._auth_works)

    async def _probe_until_up(self, check: Callable[[], Any]) -> None:
        delays = backoff.doubling(1.0, 30.0)
        while not await check():
            await asyncio.sleep(next(delays))
        log.info(
            "server %s is up again; resuming",
            self.config.server,
            extra={**self.books.log_context(), "server": self.config.server},
        )
        self.life += 1
        self._failures = 0
        self._up.set()

    async def _auth_works(self) -> bool:
        """The gate's check after a 401/403: the probe's tiny generation, with the key as it is now
        (GENQ_SERVER_API_KEY_FILE is read again, so fixing the file is enough)."""
        try:
            await self.backend.probe()
        except (ServerRefused, AttemptError):
            return False
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
