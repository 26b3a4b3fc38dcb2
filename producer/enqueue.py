"""Enqueue: one RQ job per prompt and sample, idempotent, in pipelined batches.

Each batch is one MULTI: the jobs and their bits in the dataset's ``enqueued`` bitmap land
together, so a killed enqueue never leaves a job without its bit (which would enqueue it
twice on the next run) or a bit without its job.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from rq import Queue, Retry

from genq import datasets
from genq.bitmaps import is_set
from genq.keys import Keys
from genq.schema import ABANDON_REQUEUES, JOB_FUNC, JobSpec, bit_index, record_id
from producer.context import check_fits
from producer.readers import Rejected, Row, read_files

BATCH = 1000
RESULT_TTL_S = 60  # the record travels through the stream; RQ keeps only a tiny return value


@dataclass
class Summary:
    read: int = 0
    enqueued: int = 0
    skipped: int = 0
    rejected: list[Rejected] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "read": self.read,
            "enqueued": self.enqueued,
            "skipped": self.skipped,
            "rejected": len(self.rejected),
        }


def enqueue_rows(
    conn: redis.Redis,
    keys: Keys,
    settings: datasets.DatasetSettings,
    rows: Iterable[Row | Rejected],
    context_length: int | None = None,
) -> Summary:
    """Enqueue every usable row not already enqueued (or done), ``settings.samples`` jobs each.

    With ``context_length``, rows whose prompt cannot fit with ``max_new_tokens`` are rejected.
    """
    name, samples = settings.name, settings.samples
    known = conn.get(keys.enqueued(name)) or b""
    done = conn.get(keys.done(name)) or b""
    queue = Queue(keys.queue_name(name), connection=conn, serializer="json")
    summary = Summary()
    batch: list[tuple[int, Any]] = []
    for item in rows:
        summary.read += 1
        if context_length is not None and isinstance(item, Row):
            item = check_fits(item, int(settings.sampling_params["max_new_tokens"]), context_length)
        if isinstance(item, Rejected):
            summary.rejected.append(item)
            continue
        for sample in range(samples):
            index = bit_index(item.row, sample, samples)
            if is_set(known, index) or is_set(done, index):
                summary.skipped += 1
                continue
            batch.append((index, _job_data(queue, keys, settings, item, sample)))
            if len(batch) >= BATCH:
                summary.enqueued += _push(conn, keys, queue, name, batch)
                batch = []
    if batch:
        summary.enqueued += _push(conn, keys, queue, name, batch)
    return summary


def _job_data(queue: Queue, keys: Keys, settings: datasets.DatasetSettings, item: Row, sample: int) -> Any:
    params = dict(settings.sampling_params)
    if settings.samples > 1:
        params["sampling_seed"] = params.get("sampling_seed", 0) + sample
    spec = JobSpec(
        dataset=settings.name,
        row=item.row,
        sample=sample,
        id=record_id(settings.name, item.row, sample, settings.samples),
        sampling_params=params,
        input_ids=item.prompt.input_ids,
        text=item.prompt.text,
        source_id=item.prompt.source_id,
    )
    return queue.prepare_data(
        JOB_FUNC,
        kwargs=spec.to_kwargs(),
        job_id=keys.job_id(spec.id),
        description=f"{settings.name} row {item.row}" + (f" sample {sample}" if settings.samples > 1 else ""),
        timeout=-1,  # the worker enforces deadlines that follow max_new_tokens (decision 8)
        result_ttl=RESULT_TTL_S,
        retry=Retry(max=ABANDON_REQUEUES),
    )


def _push(conn: redis.Redis, keys: Keys, queue: Queue, dataset: str, batch: list[tuple[int, Any]]) -> int:
    with conn.pipeline(transaction=True) as pipe:
        queue.enqueue_many([data for _, data in batch], pipeline=pipe)
        for index, _ in batch:
            pipe.setbit(keys.enqueued(dataset), index, 1)
        pipe.execute()
    return len(batch)


def enqueue_files(
    conn: redis.Redis,
    keys: Keys,
    paths: list[Path],
    dataset: str,
    sampling_params: dict[str, Any],
    samples: int,
    replace_settings: bool = False,
    context_length: int | None = None,
) -> Summary:
    """Register the dataset's settings (decision 12), then enqueue its files."""
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
    wanted = datasets.settings_for(dataset, paths, sampling_params, samples)
    settings = datasets.register(conn, keys, wanted, replace=replace_settings)
    return enqueue_rows(conn, keys, settings, read_files(paths), context_length)
