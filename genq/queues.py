"""A dataset's RQ queue, built one way everywhere: its name from genq's keys, the JSON serializer.

RQ keeps each dataset's jobs in a queue of its own (``Keys.queue_name``); every reader and writer
of those queues (enqueue, the reaper, failures, progress, verify, the collector) opens it here, so
none can open one without the JSON serializer (decision 2: never pickle), nor read a job as
anything but a :class:`GenqJob`. Its jobs not finished are counted here too, one way for status and
for the worker's and the collector's --burst.
"""

from __future__ import annotations

import logging

import redis
from redis.client import Pipeline
from rq import Queue
from rq.job import Job, JobStatus

from genq.keys import Keys

SERIALIZER = "json"
log = logging.getLogger("genq.queues")


class GenqJob(Job):
    """RQ's job without its outbound calls. RQ 3 POSTs to each of a job's ``webhooks`` (URLs kept in
    the job's hash, rq/job.py ``Job.send_webhooks``) when it finishes or fails: in genq a job hash
    is Redis content, and nothing read from Redis may make a host call a URL (docs/security.md).
    genq sets none; one found is named in a warning, never called."""

    def send_webhooks(self, status: str | JobStatus, *, exc_string: str | None = None) -> None:
        urls = sorted({str(getattr(hook, "url", "?")) for hook in getattr(self, "webhooks", None) or []})
        if urls:
            log.warning(
                "job %s carries webhooks %s: not called (genq calls no URL read from Redis)", self.id, urls
            )


def rq_queue(conn: redis.Redis, keys: Keys, dataset: str) -> Queue:
    """The RQ queue of ``dataset`` in this namespace."""
    return Queue(keys.queue_name(dataset), connection=conn, serializer=SERIALIZER, job_class=GenqJob)


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
