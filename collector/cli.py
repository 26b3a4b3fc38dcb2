"""`genq collect`: the command (its options, start-up and exit codes); the loop is collector/loop.py."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from pathlib import Path

import click
import redis

from genq.collector import metrics
from genq.collector.leases import LeaseHeld
from genq.collector.loop import Loop, Stopped
from genq.collector.writer import Collector, WriteFailed
from genq.connection import connect, wait_for_redis
from genq.keys import Keys, validate_name
from genq.logs import logging_options, setup_logging
from genq.metrics import metrics_options, serve
from genq.redis_errors import fatal
from genq.settings import option, redis_options

log = logging.getLogger("genq.collector")


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
    collector exits with status 3. A dataset whose files do not match their checkpoints is set
    aside with one error line, the others drain on, and the collector exits with status 5.
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
    except Stopped as exc:
        # Its leases lapse on their own: releasing them may wait on the very thing that failed.
        log.warning(
            "collector: stopped while waiting (%s): nothing unwritten was acknowledged, it waits in Redis",
            exc,
        )
        return
    except LeaseHeld as exc:
        log.error("%s", exc)
        sys.exit(2)
    except redis.RedisError as exc:  # not an outage (genq/redis_errors.py): a bug, said in one line
        log.critical("%s", fatal(exc))
        sys.exit(4)
    except WriteFailed as exc:
        log.critical(
            "%s; giving up after %.0f s without progress: nothing unwritten was acknowledged",
            exc,
            give_up_after,
        )
        sys.exit(3)
    finally:
        collector.close()
    with contextlib.suppress(redis.RedisError, OSError):  # once, as it stops: never a reason to wait
        collector.write_provenance()
    Loop(collector, [], give_up_after).call(collector.release_leases)
    aside = f"; set aside: {', '.join(sorted(collector.set_aside))}" if collector.set_aside else ""
    log.info(
        "collector: stopped (%d written, %d duplicates dropped%s)",
        collector.written,
        collector.duplicates,
        aside,
    )
    if collector.set_aside:
        sys.exit(5)  # a dataset's results wait in Redis: its files need a look
