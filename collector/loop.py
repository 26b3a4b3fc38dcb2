"""The collector's main loop (``Loop``), out of collector/cli.py: cli.py parses the options and
says what happened; this module owns when to claim, read and write, sweep and reap, and how Redis
outages and a disk that refuses writes are ridden out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from genq import backoff
from genq.collector.checkpoint import Stale
from genq.collector.writer import Collector, WriteFailed
from genq.reaper import reap
from genq.redis_errors import Outage

log = logging.getLogger("genq.collector")
T = TypeVar("T")
SWEEP_EVERY_S = 30.0
PROVENANCE_EVERY_S = 30.0  # OUT/<dataset>/provenance.json rewritten (genq/provenance.py)
REAP_EVERY_S = 15
# How often a collector looks for datasets to take: new ones, and ones whose holder is gone.
CLAIM_EVERY_S = 2.0
# After a batch smaller than --batch, wait this long before reading again: the next batch gathers
# meanwhile, so a record costs fewer fsyncs and round trips, and reaches disk at most this late.
# Waiting costs no GPU work (the records are safe in the stream), and the step's fixed cost (the
# commit script, the file's fsync, the dataset's state read) is what CPU per record is made of at
# a hundred records a second: 0.43 ms of collector CPU per job with 0.05 s, 0.32 with 0.25 s
# (bench/real_engine.py, llama.cpp, 16 in flight, start-up included).
LINGER_S = 0.25


class Stopped(Exception):
    """SIGTERM came while a call waited out a failure (Redis, the disk): nothing unwritten was
    acknowledged, so the collector may exit at once; the message says what it was waiting for."""


class Loop:
    """The collector's main loop, riding out Redis restarts, a Redis that refuses commands for a
    while (out of memory, its disk full, ...) and a disk that refuses writes."""

    def __init__(self, collector: Collector, stop: list[int], give_up_after: float):
        self.collector = collector
        self.stop = stop
        self.give_up_after = give_up_after
        self._last_reap = 0.0
        self._standby_said = False
        self.outage = Outage(log, collector.conn, collector.keys)

    def run(self, burst: bool) -> None:
        c = self.collector
        last_sweep = last_claim = last_provenance = 0.0
        # --burst looks for the end often: it exits within a tenth of a second of the last record.
        block_ms = 100 if burst else 1000
        while not self.stop:
            if time.monotonic() - last_claim > CLAIM_EVERY_S:
                held = set(c.held)
                self.call(c.claim)
                last_claim = time.monotonic()
                if not c.held and not held:
                    self._say_standby()
            if time.monotonic() - last_provenance > PROVENANCE_EVERY_S:
                self.call(c.write_provenance)  # busy or idle: a run that never idles keeps it current
                last_provenance = time.monotonic()
            written = self.call(lambda: self._step(block_ms))
            if written:
                # Even under --burst: the next read finds the stream empty when the run is over,
                # and only then is the work left counted (a query over every dataset's queues).
                if written < c.batch:
                    self._linger()
                continue
            # Idle: a file removed or cut by hand, or grown by a collector that lost its lease and
            # resumed late, is reconciled now, not when its dataset's next result comes.
            self.call(c.check_files)
            if time.monotonic() - self._last_reap > REAP_EVERY_S:
                self.call(lambda: reap(c.conn, c.keys, REAP_EVERY_S))
                self._last_reap = time.monotonic()
            nothing_left = burst and self.call(c.work_left) == 0
            if nothing_left or time.monotonic() - last_sweep > SWEEP_EVERY_S:
                self.call(lambda: c.write(c.failed_without_error()))
                last_sweep = time.monotonic()
            if nothing_left and self.call(c.work_left) == 0:
                self.call(c.write_provenance)
                log.info("collector: burst: nothing queued, in flight or in the stream")
                return

    def _linger(self) -> None:
        """Let the next batch gather (LINGER_S), unless a stop is asked for meanwhile."""
        deadline = time.monotonic() + LINGER_S
        while not self.stop and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(0.05, left))

    def _say_standby(self) -> None:
        if not self._standby_said:
            self._standby_said = True
            log.info(
                "collector: standing by: its datasets are held by other collectors, or none is enqueued yet"
            )

    def _step(self, block_ms: int) -> int:
        """One batch read and written; how many entries it held."""
        c = self.collector
        c.renew_leases()
        items = c.read(block_ms)
        if items:
            c.write(items)
        return len(items)

    def call(self, fn: Callable[[], T]) -> T:
        """Call ``fn`` until it works. After a failure the files are reconciled first: lines may
        be on disk whose ids were not marked in Redis, and they must be before anything else."""
        failing_since: float | None = None
        for delay in backoff.doubling(0.5, 30.0):
            try:
                if failing_since is not None:
                    self.collector.reconcile()
                result = fn()
                if failing_since is not None:
                    self.outage.over()
                return result
            except redis.RedisError as exc:  # unreachable, or refusing for now (genq/redis_errors.py)
                why = self.outage.refused(exc)
                if why is None:
                    raise
            except Stale as exc:  # Redis kept losing writes while the files were re-read
                why = str(exc)
                log.warning("%s; re-reading the files again in %.1f s", exc, delay)
            except (WriteFailed, OSError) as exc:
                why = str(exc)
                log.error("%s; nothing of it was acknowledged, retrying in %.1f s", exc, delay)
                if failing_since is not None and time.monotonic() - failing_since > self.give_up_after:
                    raise
            failing_since = failing_since if failing_since is not None else time.monotonic()
            self._sleep(delay, why)

    def _sleep(self, seconds: float, why: str) -> None:
        """Wait before the next try, but raise Stopped as soon as a stop is asked for."""
        deadline = time.monotonic() + seconds
        while True:
            if self.stop:
                raise Stopped(why)
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.2, left))
