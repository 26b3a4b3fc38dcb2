"""Where every job is, read from Redis alone: the five states of DESIGN.md add up to the total.

- queued:    in the dataset's RQ queue (or RQ's intermediate list on its way to a worker)
- in_flight: started on a worker (RQ's StartedJobRegistry), or a result in the stream not yet on disk
- retrying:  scheduled by RQ for a later retry
- done:      record on disk (``done`` bitmap, set only after fsync)
- failed:    error on disk (``failed`` bitmap)
"""

from __future__ import annotations

from typing import Any

import redis
from rq import Queue

from genq import datasets
from genq.keys import Keys

STATES = ("queued", "in_flight", "retrying", "done", "failed")


def dataset_counts(conn: redis.Redis, keys: Keys) -> dict[str, dict[str, int]]:
    names = list(datasets.load_all(conn, keys))
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            queue = Queue(keys.queue_name(name), connection=conn, serializer="json")
            pipe.bitcount(keys.enqueued(name))
            pipe.llen(queue.key)
            pipe.llen(queue.intermediate_queue_key)
            pipe.zcard(queue.started_job_registry.key)
            pipe.hget(keys.in_stream, name)
            pipe.zcard(queue.scheduled_job_registry.key)
            pipe.bitcount(keys.done(name))
            pipe.bitcount(keys.failed(name))
        raw = pipe.execute()
    out: dict[str, dict[str, int]] = {}
    for i, name in enumerate(names):
        total, queued, moving, started, streamed, scheduled, done, failed = raw[i * 8 : i * 8 + 8]
        counts = {
            "total": total,
            "queued": queued + moving,
            "in_flight": started + int(streamed or 0),
            "retrying": scheduled,
            "done": done,
            "failed": failed,
        }
        counts["unaccounted"] = total - sum(counts[s] for s in STATES)
        out[name] = counts
    return out


def status(conn: redis.Redis, keys: Keys) -> dict[str, Any]:
    return {
        "namespace": keys.namespace,
        "datasets": dataset_counts(conn, keys),
        "stream": {"length": int(conn.xlen(keys.results)) if conn.exists(keys.results) else 0},
    }


def finished(counts: dict[str, dict[str, int]]) -> bool:
    """Every enqueued job is on disk, as a record or an error."""
    return all(c["done"] + c["failed"] >= c["total"] for c in counts.values())
