"""A dataset's RQ queue, built one way everywhere: its name from genq's keys, the JSON serializer.

RQ keeps each dataset's jobs in a queue of its own (``Keys.queue_name``); every reader and writer
of those queues (enqueue, the reaper, failures, progress, verify, the collector) opens it here, so
none can open one without the JSON serializer (decision 2: never pickle). Its jobs not finished
are counted here too, one way for status and for the worker's and the collector's --burst.
"""

from __future__ import annotations

import redis
from redis.client import Pipeline
from rq import Queue

from genq.keys import Keys

SERIALIZER = "json"


def rq_queue(conn: redis.Redis, keys: Keys, dataset: str) -> Queue:
    """The RQ queue of ``dataset`` in this namespace."""
    return Queue(keys.queue_name(dataset), connection=conn, serializer=SERIALIZER)


def count_unfinished(pipe: Pipeline, queue: Queue, *, scheduled: bool = False) -> None:
    """Add to ``pipe``, in this order, the counts of ``queue``'s jobs not finished: waiting in the
    queue, on their way to a worker (RQ's intermediate list), started (its StartedJobRegistry: a dead
    worker's come back to the queue) and, with ``scheduled``, waiting for a retry (its
    ScheduledJobRegistry)."""
    pipe.llen(queue.key)
    pipe.llen(queue.intermediate_queue_key)
    pipe.zcard(queue.started_job_registry.key)
    if scheduled:
        pipe.zcard(queue.scheduled_job_registry.key)
