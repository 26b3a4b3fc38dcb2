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

from genq.schema import ABANDON_REQUEUES, JOB_FUNC


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


# What genq's enqueues write: the worker enforces deadlines that follow max_new_tokens (decision 8),
# the record travels through the stream (RQ keeps the finished job a minute), an abandoned job is
# requeued this many times.
JOBS = JobOptions(timeout=-1, result_ttl=60, retries=ABANDON_REQUEUES)


def push(pipe: Pipeline, queue: Queue, jobs: list[Job], options: JobOptions) -> None:
    """Queue ``jobs`` (id, the function's kwargs, description) at the back of ``queue``."""
    shared = shared_fields(queue, options)
    pipe.sadd(queue.redis_queues_keys, queue.key)
    for job_id, kwargs, description in jobs:
        pipe.hset(job_key(queue, job_id), mapping=job_fields(shared, kwargs, description))
    pipe.rpush(queue.key, *(job_id for job_id, _, _ in jobs))


def shared_fields(queue: Queue, options: JobOptions) -> dict[str, Any]:
    """The fields of a job hash every job queued now on ``queue`` shares."""
    stamp = utcformat(now())
    return {
        "created_at": stamp,
        "enqueued_at": stamp,
        "origin": queue.name,
        "status": JobStatus.QUEUED.value,
        "timeout": options.timeout,
        "result_ttl": options.result_ttl,
        "retries_left": options.retries,
        "retry_intervals": f"[{options.retry_interval}]",
    }


def job_fields(shared: dict[str, Any], kwargs: dict[str, Any], description: str) -> dict[str, Any]:
    """One job's hash: RQ's payload, the JSON serializer's (func, instance, args, kwargs),
    zlib-compressed as RQ does unless it is too short to gain (RQ reads a payload that is not zlib
    as is)."""
    data = orjson.dumps([JOB_FUNC, None, [], kwargs])
    if len(data) >= COMPRESS_FROM:
        data = zlib.compress(data, 1)
    return {**shared, "data": data, "description": description}


def job_key(queue: Queue, job_id: str) -> str:
    return f"{queue.job_class.redis_job_namespace_prefix}{job_id}"
