"""Re-open records that ended on ``length`` and continue them from their stored output
(``genq retry --truncated --continue-to N``): no token of what exists is generated again.

Each chosen record becomes a job again, continued in pieces (worker/pieces.py) from a checkpoint
made of its own output (genq/pieces.py), with ``extends`` set to its length. The job, its
checkpoint and its ``extending`` bit go into Redis in one MULTI; the collector appends the longer
record after the one it supersedes and clears the bit in the commit that marks it (the supersede
rule: genq/schema.py ``extends``). A record already re-opened (its bit set) is left alone, so the
command can be run again after a crash and re-opens only what it had not.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis
from rq.registry import FailedJobRegistry

from genq import rq_jobs
from genq.bitmaps import is_set, set_bits
from genq.datasets import DatasetSettings
from genq.keys import Keys
from genq.openai_batch import RECORD_KEY as BATCH_KEY
from genq.pieces import Progress, cannot_continue
from genq.queues import rq_queue
from genq.schema import ID_AT_START, JobSpec, bit_index, parse_record_id

BATCH = 500


class CannotExtend(Exception):
    """The dataset's records cannot be continued (its prompts are not token ids): one line."""


@dataclass
class Extended:
    """What one dataset's re-opening did: ``reopened`` jobs, and why each other record was not."""

    dataset: str
    reopened: int = 0
    left: Counter = field(default_factory=Counter)  # why -> records not re-opened
    unusable: list[str] = field(default_factory=list)  # file:line: why, of records that cannot be

    def line(self) -> str:
        why = ", ".join(f"{n:,} {reason}" for reason, n in sorted(self.left.items()))
        return f"{self.dataset}: re-opened {self.reopened:,}" + (f"; left as they are: {why}" if why else "")


def check(settings: DatasetSettings) -> None:
    """Refuse, in one line, a dataset whose outputs cannot go on as token ids."""
    prompting = settings.prompting
    why = cannot_continue(prompting.get("backend") == "openai-chat", prompting.get("turns"))
    if why is not None:
        raise CannotExtend(f"dataset {settings.name}: {why}")
    if prompting.get("logprobs") is not None:
        raise CannotExtend(
            f"dataset {settings.name}: its records' logprobs frames are not carried into an extension yet"
        )
    if settings.checked:
        raise CannotExtend(
            f"dataset {settings.name}: its records were judged by genq check as they were; a longer one "
            "would need judging again, which the check stage does not do yet"
        )


def extend(conn: redis.Redis, keys: Keys, settings: DatasetSettings, raw: Path, continue_to: int) -> Extended:
    """Re-open every record of ``raw`` (the dataset's raw file) that is its id's last, ended on
    ``length`` below ``continue_to`` and was not cut by a full context, as a job continuing it."""
    check(settings)
    name, samples = settings.name, settings.samples
    result = Extended(name)
    extending = conn.get(keys.extending(name)) or b""
    queue = rq_queue(conn, keys, name)
    failed = FailedJobRegistry(queue=queue, serializer="json")
    jobs: list[tuple[int, JobSpec, Progress]] = []
    enqueued = conn.strlen(keys.enqueued(name)) * 8
    for where, index, record in _last_records(raw, name, samples, enqueued):
        why = _not_extended(record, continue_to)
        if why is None and is_set(extending, index):
            why = "re-opened already"
        if why is not None:
            result.left[why] += 1
            continue
        try:
            spec, progress = _job(record, settings, continue_to)
        except (KeyError, TypeError, ValueError) as exc:
            result.left["unusable"] += 1
            result.unusable.append(f"{where}: {exc}")
            continue
        jobs.append((index, spec, progress))
        if len(jobs) >= BATCH:
            result.reopened += _push(conn, keys, queue, failed, jobs)
            jobs = []
    result.reopened += _push(conn, keys, queue, failed, jobs)
    return result


def _last_records(raw: Path, name: str, samples: int, jobs: int) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(file:line, bit index, record) of each id's last line (the supersede rule), for ``jobs`` ids
    at most (the enqueued bitmap's size). Two passes: the first reads each line's id off its start
    (an array of 8 bytes per job: 80 MB for 10M), the second parses the lines kept."""
    last = array("q", bytes(8 * jobs))  # index -> its last line's number; 0: none
    with raw.open("rb") as fh:
        for line_no, line in enumerate(fh, start=1):
            match = ID_AT_START.match(line)
            parsed = parse_record_id(match.group(1).decode(), name, samples) if match else None
            index = bit_index(*parsed, samples) if parsed is not None else jobs
            if index < jobs:
                last[index] = line_no
    wanted = {line_no: index for index, line_no in enumerate(last) if line_no}
    with raw.open("rb") as fh:
        for line_no, line in enumerate(fh, start=1):
            if line_no in wanted:
                try:
                    yield f"{raw}:{line_no}", wanted[line_no], orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # not a record: verify says so; nothing to continue


def _not_extended(record: dict[str, Any], continue_to: int) -> str | None:
    """Why this record is left as it is, or None: it goes on."""
    if record.get("finish_reason") != "length":
        return "not cut at the cap"
    if record.get("context_full"):
        return "filling the server's context"
    done = record.get("output_ids")
    if not isinstance(done, list) or not isinstance(record.get("input_ids"), list):
        return "without their token ids (enqueued with --no-keep-prompt)"
    if len(done) >= continue_to:
        return f"at {continue_to} tokens or more"
    return None


def _job(record: dict[str, Any], settings: DatasetSettings, continue_to: int) -> tuple[JobSpec, Progress]:
    """The job that continues ``record``, and its checkpoint: the record's own output. Checked as a
    worker checks a payload (JobSpec.from_kwargs): ValueError names what is wrong."""
    kwargs = {
        "dataset": settings.name,
        "row": record["row"],
        "sample": record["sample"],
        "id": record["id"],
        "sampling_params": record["sampling_params"],
        "input_ids": record["input_ids"],
        "source_id": record.get("source_id"),
        "messages": record.get("messages"),
        "think": settings.prompting.get("think"),
        "keep_prompt": True,
        "batch": record.get(BATCH_KEY),
        "tools": record.get("tools"),
        "continue_to": continue_to,
        "extends": len(record["output_ids"]),
    }
    spec = JobSpec.from_kwargs({k: v for k, v in kwargs.items() if v is not None})
    if spec.continue_to is not None and spec.continue_to <= spec.sampling_params["max_new_tokens"]:
        raise ValueError(f"--continue-to {continue_to} is not above its max_new_tokens")
    progress = Progress.from_record(record)
    Progress.from_json(progress.to_json(), spec)  # what a worker will read back
    return spec, progress


def _push(
    conn: redis.Redis,
    keys: Keys,
    queue: Any,
    failed: FailedJobRegistry,
    jobs: list[tuple[int, JobSpec, Progress]],
) -> int:
    """Queue the jobs with their checkpoints and extending bits, all or none (one MULTI)."""
    if not jobs:
        return 0
    name = jobs[0][1].dataset
    with conn.pipeline(transaction=True) as pipe:
        batch = []
        for _, spec, progress in jobs:
            job_id = keys.job_id(spec.id)
            pipe.delete(f"{queue.job_class.redis_job_namespace_prefix}{job_id}")  # the finished job's hash
            pipe.zrem(failed.key, job_id)  # an extension that failed before: its turn again
            for state in keys.job_state:
                pipe.hdel(state, job_id)
            pipe.hset(keys.pieces, job_id, progress.to_json())
            batch.append((job_id, spec.to_kwargs(), f"{spec.id}: continued to {spec.continue_to}"))
        rq_jobs.push(pipe, queue, batch, rq_jobs.JOBS)
        set_bits(pipe, keys.extending(name), [index for index, _, _ in jobs])
        pipe.execute()
    return len(jobs)
