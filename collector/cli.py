"""`genq collect`."""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click
import redis

from collector import metrics
from collector.checkpoint import Stale
from collector.drain import Collector, LeaseHeld, WriteFailed
from genq.connection import connect, wait_for_redis
from genq.keys import Keys, validate_name
from genq.logs import logging_options, setup_logging
from genq.metrics import metrics_options, serve
from genq.reaper import reap
from genq.settings import option, redis_options

log = logging.getLogger("genq.collector")
T = TypeVar("T")
SWEEP_EVERY_S = 30.0
REAP_EVERY_S = 15
# How often a collector looks for datasets to take: new ones, and ones whose holder is gone.
CLAIM_EVERY_S = 2.0
# After a batch smaller than --batch, wait this long before reading again: the next batch gathers
# meanwhile, so a record costs fewer fsyncs and round trips, and reaches disk at most this late.
# (Not when --burst finds nothing left: it exits at once.)
LINGER_S = 0.05


@click.command("collect")
@option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Output folder: OUT/<dataset>/raw_responses.jsonl and errors.jsonl.",
)
@option("--batch", type=click.IntRange(min=1), default=500, help="Stream entries per write and fsync.")
@option(
    "--give-up-after",
    type=click.FloatRange(min=1),
    default=600.0,
    help="Exit non-zero when the disk has refused every write for this many seconds.",
)
@option(
    "--dataset",
    "only",
    multiple=True,
    env="GENQ_COLLECT_DATASET",
    help="Collect only this dataset (repeatable; GENQ_COLLECT_DATASET: names separated by spaces). "
    "Default: every dataset of the namespace, including ones enqueued later.",
)
@option("--burst", is_flag=True, help="Exit once queues, in-flight jobs and the streams are all empty.")
@logging_options
@metrics_options
@redis_options
def collect_command(
    out,
    batch,
    give_up_after,
    only,
    burst,
    log_level,
    log_format,
    metrics_port,
    metrics_bind,
    redis_url,
    namespace,
):
    """Drain results into deduplicated JSONL: write, fsync, then acknowledge.

    One collector per dataset at a time (a lease in Redis per dataset): start several, each
    with its own --dataset names or all with the same ones, and the datasets are shared out; a
    collector whose datasets are all held waits as a standby and takes over any whose holder dies.
    SIGTERM finishes the batch in hand and exits 0. A disk that refuses writes is retried with
    backoff (nothing is acknowledged meanwhile); after --give-up-after seconds without progress the
    collector exits with status 3.
    """
    setup_logging(log_level, log_format)
    keys = Keys(namespace)
    for name in only:
        validate_name(name)
    collector = Collector(connect(redis_url), keys, out, batch=batch, datasets=only or None)
    wait_for_redis(collector.conn, redis_url)
    metrics.watch(collector.conn, collector.keys)
    serve(metrics_port, metrics_bind, metrics.REGISTRY)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    which = ", ".join(only) if only else "every dataset"
    log.info("collector %s: draining %s of namespace %r into %s", collector.lease_id, which, namespace, out)
    try:
        Loop(collector, stop, give_up_after).run(burst)
    except LeaseHeld as exc:
        log.error("%s", exc)
        sys.exit(2)
    except WriteFailed as exc:
        log.critical(
            "%s; giving up after %.0f s without progress: nothing unwritten was acknowledged",
            exc,
            give_up_after,
        )
        sys.exit(3)
    finally:
        collector.close()
    Loop(collector, [], give_up_after).call(collector.release_leases)
    log.info(
        "collector: stopped (%d written, %d duplicates dropped)", collector.written, collector.duplicates
    )


class Loop:
    """The collector's main loop, riding out Redis restarts and a disk that refuses writes."""

    def __init__(self, collector: Collector, stop: list[int], give_up_after: float):
        self.collector = collector
        self.stop = stop
        self.give_up_after = give_up_after
        self._last_reap = 0.0
        self._standby_said = False

    def run(self, burst: bool) -> None:
        c = self.collector
        last_sweep = last_claim = 0.0
        # --burst looks for the end often: it exits within a tenth of a second of the last record.
        block_ms = 100 if burst else 1000
        while not self.stop:
            if time.monotonic() - last_claim > CLAIM_EVERY_S:
                held = set(c.held)
                self.call(c.claim)
                last_claim = time.monotonic()
                if not c.held and not held:
                    self._say_standby()
            written = self.call(lambda: self._step(block_ms))
            if written and not (burst and written < c.batch and self.call(c.work_left) == 0):
                if written < c.batch:
                    time.sleep(LINGER_S)
                continue
            if time.monotonic() - self._last_reap > REAP_EVERY_S:
                self.call(lambda: reap(c.conn, c.keys, REAP_EVERY_S))
                self._last_reap = time.monotonic()
            nothing_left = burst and self.call(c.work_left) == 0
            if nothing_left or time.monotonic() - last_sweep > SWEEP_EVERY_S:
                self.call(lambda: c.write(c.failed_without_error()))
                last_sweep = time.monotonic()
            if nothing_left and self.call(c.work_left) == 0:
                log.info("collector: burst: nothing queued, in flight or in the stream")
                return

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
        delay = 0.5
        failing_since: float | None = None
        while True:
            try:
                if failing_since is not None:
                    self.collector.reconcile()
                return fn()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if self.stop and failing_since is not None:
                    raise
                log.warning("Redis unreachable (%s); retrying in %.1f s", exc, delay)
            except Stale as exc:  # Redis kept losing writes while the files were re-read
                log.warning("%s; re-reading the files again in %.1f s", exc, delay)
            except (WriteFailed, OSError) as exc:
                log.error("%s; nothing of it was acknowledged, retrying in %.1f s", exc, delay)
                if failing_since is not None and time.monotonic() - failing_since > self.give_up_after:
                    raise
            failing_since = failing_since if failing_since is not None else time.monotonic()
            time.sleep(delay)
            delay = min(delay * 2, 30.0)
