"""Jobs in RQ's failed registries that have no line in errors.jsonl.

A worker that dies with a job once too often leaves it failed in RQ with no error of its own in the
stream. This module finds those jobs for the datasets a collector holds and builds their error
lines (with the reason RQ kept, when it can be read), for the Collector to write like any other.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import redis
from rq.registry import FailedJobRegistry

from genq import datasets as datasets_mod
from genq.bitmaps import is_set
from genq.failures import reason_of
from genq.keys import Keys
from genq.queues import GenqJob, rq_queue
from genq.schema import bit_index, error_record, parse_record_id

log = logging.getLogger("genq.collector")


def errors(
    conn: redis.Redis,
    keys: Keys,
    held: Iterable[str],
    settings: Mapping[str, datasets_mod.DatasetSettings],
) -> list[tuple[str, dict]]:
    """(dataset, error line) for each job in the failed registry of a dataset ``held`` whose id is
    neither done nor failed, or is a re-opened record (``extending``) whose extension failed so: the
    collector then clears its bit, and its record stands. Call with the stream drained: a worker
    adds a job's error to the stream before RQ marks the job failed, so what is left has no error of
    its own."""
    found = []
    for name in held:
        samples = settings[name].samples
        queue = rq_queue(conn, keys, name)
        ids = FailedJobRegistry(queue=queue).get_job_ids()
        if not ids:
            continue
        done = conn.get(keys.done(name)) or b""
        failed = conn.get(keys.failed(name)) or b""
        # A job never enqueued (forged into the queue) gets no line: `genq failed` shows it.
        enqueued = conn.get(keys.enqueued(name)) or b""
        extending = conn.get(keys.extending(name)) or b""
        for job_id in ids:
            rid = keys.record_id(job_id)
            parsed = parse_record_id(rid, name, samples) if rid else None
            if parsed is None:
                continue
            index = bit_index(*parsed, samples)
            on_disk = is_set(done, index) and not is_set(extending, index)
            if on_disk or is_set(failed, index) or not is_set(enqueued, index):
                continue
            found.append((name, _error_of_failed(conn, keys, job_id, rid, name, *parsed)))
    return found


def _error_of_failed(
    conn: redis.Redis, keys: Keys, job_id: str, rid: str, name: str, row: int, sample: int
) -> dict:
    exc_string = source_id = extends = None
    try:
        job = GenqJob.fetch(job_id, connection=conn, serializer="json")
        source_id = (job.kwargs or {}).get("source_id")
        extends = (job.kwargs or {}).get("extends")
        result = job.latest_result()
        exc_string = result.exc_string if result is not None else None
    except Exception as exc:  # noqa: BLE001 - the reason is a nicety; the error line is not
        log.debug("job %s: could not read its failure (%s)", job_id, exc)
    error, message = reason_of(exc_string)
    attempts = conn.hget(keys.attempts, job_id)
    error = error_record(
        id=rid,
        dataset=name,
        row=row,
        sample=sample,
        source_id=source_id,
        error=error,
        message=message,
        status=None,
        attempts=int(attempts) if attempts is not None else None,
    )
    if type(extends) is int:  # a re-opened record's extension: the collector keeps the record
        error["extends"] = extends
    return error
