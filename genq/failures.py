"""Terminal failures, for operators: list them grouped by reason, put them back.

The failed jobs are RQ's own failed registries (one per dataset queue); their reason is the
failure RQ recorded (the worker's error class and the server's words, or RQ's abandoned-job
note). Only failures already in ``errors.jsonl`` are retried, so the collector never writes an
error for a job that is back in the queue.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import redis
from rq.registry import FailedJobRegistry

from genq import datasets
from genq.bitmaps import is_set
from genq.keys import Keys
from genq.queues import GenqJob, rq_queue
from genq.schema import ABANDON_REQUEUES, bit_index, parse_record_id

CLASS_RE = re.compile(r"^([a-z_]+): (.*)$", re.S)


@dataclass
class Failure:
    job_id: str  # RQ's
    id: str  # the record id, as in errors.jsonl
    dataset: str
    error: str
    message: str
    on_disk: bool


@dataclass
class Group:
    error: str
    message: str
    ids: list[str] = field(default_factory=list)


def reason_of(exc_string: str | None) -> tuple[str, str]:
    """(error class, message) from what RQ recorded for a failed job."""
    text = (exc_string or "").strip()
    match = CLASS_RE.match(text)
    if match:
        return match.group(1), match.group(2).strip()
    if "AbandonedJobError" in text:
        return "abandoned", "its workers died or stopped heartbeating too many times"
    last = text.splitlines()[-1] if text else "no reason recorded"
    return "failed", last


def failures(conn: redis.Redis, keys: Keys, dataset: str | None = None) -> list[Failure]:
    out = []
    for name, settings in datasets.load_all(conn, keys).items():
        if dataset and name != dataset:
            continue
        queue = rq_queue(conn, keys, name)
        ids = FailedJobRegistry(queue=queue, serializer="json").get_job_ids()
        failed_bits = conn.get(keys.failed(name)) or b""
        for job_id, job in zip(ids, GenqJob.fetch_many(ids, conn, serializer="json"), strict=True):
            result = job.latest_result() if job is not None else None
            error, message = reason_of(result.exc_string if result is not None else None)
            rid = keys.record_id(job_id) or job_id
            parsed = parse_record_id(rid, name, settings.samples)
            on_disk = parsed is not None and is_set(failed_bits, bit_index(*parsed, settings.samples))
            out.append(Failure(job_id, rid, name, error, message, on_disk))
    return out


def group(items: list[Failure]) -> list[Group]:
    """Failures with the same class and message (numbers aside) together, largest group first."""
    groups: dict[tuple[str, str], Group] = {}
    for f in items:
        key = (f.error, re.sub(r"\d+", "N", f.message))
        groups.setdefault(key, Group(f.error, f.message)).ids.append(f.id)
    return sorted(groups.values(), key=lambda g: -len(g.ids))


def retry(conn: redis.Redis, keys: Keys, items: list[Failure]) -> tuple[int, int]:
    """Put failures back at the front of their queues with a fresh attempt budget.

    Returns (retried, waiting): failures whose error is not on disk yet are left alone.
    """
    retried = waiting = 0
    by_dataset: dict[str, list[Failure]] = defaultdict(list)
    for f in items:
        by_dataset[f.dataset].append(f)
    all_settings = datasets.load_all(conn, keys)
    for name, group_items in by_dataset.items():
        samples = all_settings[name].samples
        queue = rq_queue(conn, keys, name)
        registry = FailedJobRegistry(queue=queue, serializer="json")
        for f in group_items:
            if not f.on_disk:
                waiting += 1
                continue
            job = GenqJob.fetch(f.job_id, connection=conn, serializer="json")
            row, sample = parse_record_id(f.id, name, samples) or (None, None)
            with conn.pipeline() as pipe:
                pipe.zrem(registry.key, job.id)
                job.started_at = job.ended_at = None
                job.retries_left = ABANDON_REQUEUES
                job.meta = {}
                job.save(pipeline=pipe)
                queue._enqueue_job(job, pipeline=pipe, at_front=True)
                for counter in keys.job_state:
                    pipe.hdel(counter, job.id)
                if row is not None:
                    pipe.setbit(keys.failed(name), bit_index(row, sample, samples), 0)
                    # A checked dataset's: its ending will be judged again (decision 20). Its
                    # prompt drew a replacement for it already, so an acceptance past K is surplus.
                    pipe.setbit(keys.checked(name), bit_index(row, sample, samples), 0)
                pipe.execute()
            retried += 1
    return retried, waiting
