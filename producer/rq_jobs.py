"""RQ job hashes written by genq, a batch per pipeline, as RQ's ``Queue.enqueue_many`` writes them.

``enqueue_many`` builds a Job object per prompt (five dates, a JSON dump, serializer lookups) and
queues four commands for it; that tops out near 8,000 prompts/s here. genq writes the same hash
itself (rq/job.py ``Job.to_dict``, rq 2.12 and 3), with the fields RQ leaves empty left out
(``Job.restore`` reads a missing field and an empty one alike, and an empty field costs a queued job
~60 bytes of Redis), then pushes the whole batch's ids with one RPUSH. tests/test_rq_contract.py
checks that RQ reads a job written here back as it reads its own.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import orjson
from redis.client import Pipeline
from rq import Queue
from rq.job import JobStatus
from rq.utils import now, utcformat

from genq.schema import JOB_FUNC


@dataclass(frozen=True)
class JobOptions:
    """What every job of an enqueue shares, in RQ's terms."""

    timeout: int  # -1: none (the worker enforces its own deadlines)
    result_ttl: int
    retries: int  # Retry(max=...): requeues of an abandoned job
    retry_interval: int = 0


# Shorter payloads are stored as they are: zlib saves them a few bytes for ~13 µs each.
COMPRESS_FROM = 256
Job = tuple[str, dict[str, Any], str]  # id, the function's kwargs, description


def push(pipe: Pipeline, queue: Queue, jobs: list[Job], options: JobOptions) -> None:
    """Queue ``jobs`` (id, the function's kwargs, description) at the back of ``queue``."""
    stamp = utcformat(now())
    shared = {
        "created_at": stamp,
        "enqueued_at": stamp,
        "origin": queue.name,
        "status": JobStatus.QUEUED.value,
        "timeout": options.timeout,
        "result_ttl": options.result_ttl,
        "retries_left": options.retries,
        "retry_intervals": f"[{options.retry_interval}]",
    }
    pipe.sadd(queue.redis_queues_keys, queue.key)
    for job_id, kwargs, description in jobs:
        # RQ's payload: the JSON serializer's (func, instance, args, kwargs), zlib-compressed
        # as RQ does, unless it is too short to gain (RQ reads a payload that is not zlib as is).
        data = orjson.dumps([JOB_FUNC, None, [], kwargs])
        if len(data) >= COMPRESS_FROM:
            data = zlib.compress(data, 1)
        pipe.hset(
            f"{queue.job_class.redis_job_namespace_prefix}{job_id}",
            mapping={**shared, "data": data, "description": description},
        )
    pipe.rpush(queue.key, *(job_id for job_id, _, _ in jobs))
