"""`genq collect`."""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path

import click
import redis

from collector.drain import Collector, LeaseHeld
from genq.keys import Keys
from genq.logs import setup_logging
from genq.settings import connect, option, redis_options

log = logging.getLogger("genq.collector")
SWEEP_EVERY_S = 30.0


@click.command("collect")
@option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Output folder: OUT/<dataset>/raw_responses.jsonl and errors.jsonl.",
)
@option("--batch", type=click.IntRange(min=1), default=500, help="Stream entries per write and fsync.")
@option("--burst", is_flag=True, help="Exit once queues, in-flight jobs and the stream are all empty.")
@option("--log-level", default="INFO", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))
@redis_options
def collect_command(out, batch, burst, log_level, redis_url, namespace):
    """Drain results into deduplicated JSONL: write, fsync, then acknowledge.

    One collector per namespace (a lease in Redis). SIGTERM finishes the batch in hand and exits 0.
    """
    setup_logging(log_level)
    collector = Collector(connect(redis_url), Keys(namespace), out, batch=batch)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    try:
        collector.start()
    except LeaseHeld as exc:
        raise click.ClickException(str(exc)) from exc
    log.info("collector %s: draining namespace %r into %s", collector.lease_id, namespace, out)
    try:
        run(collector, burst, stop)
    except LeaseHeld as exc:
        log.error("%s", exc)
        sys.exit(2)
    finally:
        collector.close()
    with_redis(collector.release_lease, stop=[])
    log.info(
        "collector: stopped (%d written, %d duplicates dropped)", collector.written, collector.duplicates
    )


def run(collector: Collector, burst: bool, stop: list) -> None:
    last_sweep = 0.0
    while not stop:

        def step() -> bool:
            collector.renew_lease()
            items = collector.read(block_ms=1000)
            if items:
                collector.write(items)
                return True
            return False

        if with_redis(step, stop, recover=collector.reconcile):
            continue
        nothing_left = burst and with_redis(collector.work_left, stop) == 0
        if nothing_left or time.monotonic() - last_sweep > SWEEP_EVERY_S:
            with_redis(
                lambda: collector.write(collector.failed_without_error()), stop, recover=collector.reconcile
            )
            last_sweep = time.monotonic()
        if nothing_left and with_redis(collector.work_left, stop) == 0:
            log.info("collector: burst: nothing queued, in flight or in the stream")
            return


def with_redis(fn, stop: list, recover=None):
    """Call ``fn``, riding out Redis being unreachable. After a failure, ``recover`` runs first:
    lines may be on disk whose ids did not get marked, and they must be before anything else."""
    delay = 0.5
    failed = False
    while True:
        try:
            if failed and recover is not None:
                recover()
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if stop and failed:
                raise
            log.warning("Redis unreachable (%s); retrying in %.1f s", exc, delay)
            failed = True
            time.sleep(delay)
            delay = min(delay * 2, 30.0)
