"""The job and record schemas: what travels through RQ, the result stream and the files on disk."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, fields
from typing import Any

import orjson

SCHEMA_VERSION = 1

# The function name stored in every RQ job. Only `genq worker` runs these jobs; a plain
# `rq worker` that picks one up fails it loudly through genq.jobs.generate.
JOB_FUNC = "genq.jobs.generate"

# The two files of a dataset's folder (OUT/<dataset>/): the collector writes them, `genq export`
# and `genq verify` read them.
RAW = "raw_responses.jsonl"
ERRORS = "errors.jsonl"
# A checked dataset's records its checker did not accept (rejected, surplus, check_failed), each with
# its verdict under "check" (accepted ones are in RAW with theirs).
REJECTED_SAMPLES = "rejected_samples.jsonl"
# The rows `genq run`'s enqueue rejected, beside them (producer/rejects.py writes its lines).
REJECTS = "rejected.jsonl"
# The dataset's settings as enqueue recorded them (genq/datasets.py), copied beside its files by the
# collector that holds it, so the files alone say how they were made (`genq export` reads the
# tokenizer there).
SETTINGS = "dataset.json"
# What `genq export` writes beside them by default, per format; `genq stats` knows its own exports
# there and does not count their records twice (outputs/stats.py).
EXPORTS = {
    "eagle3": "tokenized_data.jsonl",
    "sharegpt": "sharegpt.jsonl",
    "messages": "messages.jsonl",
    "openai-batch": "batch_output.jsonl",
    "parquet": "records.parquet",  # shards records-00000-of-00002.parquet... (outputs/parquet.py)
}


def shard_name(stem: str, k: int, n: int) -> str:
    """The Parquet shard ``k`` of ``n`` of an export (Hugging Face's naming: the Hub and `datasets`
    load ``<stem>-*-of-*.parquet`` as one split)."""
    return f"{stem}-{k:05d}-of-{n:05d}.parquet"


def shard_glob(stem: str) -> str:
    """Every shard of an export named after ``stem``: what exports replace, cards and pushes list."""
    return f"{stem}-*-of-*.parquet"


# How often RQ may requeue a job whose worker died (its abandoned-job handling) before failing
# it. The real budget is the per-job attempt count workers keep in Redis (``--max-attempts``).
ABANDON_REQUEUES = 10

# Stream entry kinds.
KIND_RECORD = b"record"
KIND_ERROR = b"error"


def record_id(dataset: str, row: int, sample: int, samples: int) -> str:
    """``<dataset>-<row>`` or ``<dataset>-<row>-<sample>`` (decision 5): the same row gives the same id.

    This is the ``id`` in the output files. The RQ job id adds the namespace
    (:meth:`genq.keys.Keys.job_id`): RQ's job keys are global to a Redis.
    """
    return f"{dataset}-{row}-{sample}" if samples > 1 else f"{dataset}-{row}"


def bit_index(row: int, sample: int, samples: int) -> int:
    """Position of a job in its dataset's bitmaps."""
    return row * samples + sample


@dataclass
class JobSpec:
    """The payload of one RQ job: one prompt, one sample."""

    dataset: str
    row: int
    sample: int
    id: str  # the record id, <dataset>-<row>[-<sample>]
    sampling_params: dict[str, Any]
    input_ids: list[int] | None = None
    text: str | None = None
    source_id: str | None = None
    messages: list[dict[str, Any]] | None = None  # the prompt conversation, kept for exports
    think: dict[str, Any] | None = None  # think markers: start/end text and ids (worker/reasoning.py)
    keep_prompt: bool | None = None  # copy input_ids (and messages) into the record
    turns: str | None = None  # "all": a conversation, every user turn answered (genq/conversation.py)
    template: dict[str, Any] | None = None  # the chat template the worker renders later turns with
    logprobs: int | None = None  # top-K log-probabilities per output token, stored in logprobs.bin
    batch: dict[str, Any] | None = None  # an OpenAI Batch request's url and model (genq/openai_batch.py)
    tools: list[dict[str, Any]] | None = None  # the row's function declarations (OpenAI ``tools``)
    # A chat backend's template switches ({"thinking": false}), sent with the request: the server renders.
    chat_template_kwargs: dict[str, Any] | None = None
    # Continue an output cut at max_new_tokens up to this many tokens, a piece at a time (worker/pieces.py).
    continue_to: int | None = None
    # An extension (genq retry --truncated): the completion_tokens of the record it supersedes; its
    # output so far is the job's checkpoint in Redis (genq/pieces.py), put there with it.
    extends: int | None = None
    fields: dict[str, Any] | None = None  # the row's own fields kept for the check stage (--keep-field)
    parent: str | None = None  # a stage's job: the id of the record its row was made from
    extra: dict[str, Any] = field(default_factory=dict)

    def to_kwargs(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it deep-copies input_ids, a third of enqueue's time.
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in data.items() if v is not None and v != {}}

    @classmethod
    def from_kwargs(cls, kwargs: object) -> JobSpec:
        """The payload of a job read from Redis, checked where it enters the worker: ValueError
        names the field that is not what enqueue writes (a payload without ``max_new_tokens``
        would otherwise fail every send, and go back to its queue for ever)."""
        if not isinstance(kwargs, dict):
            raise ValueError(f"the job's kwargs are a {type(kwargs).__name__}, not an object")
        unknown = sorted(set(kwargs) - _SPEC_FIELDS)
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r}")
        for name, kind in _SPEC_TYPES.items():
            value = kwargs.get(name)
            if value is None and name not in _REQUIRED:
                continue
            if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0)):
                raise ValueError(f"field {name!r} is {_brief(value)}, not {_KIND_WORDS[kind]}")
        params = kwargs["sampling_params"]
        most = params.get("max_new_tokens")
        if not isinstance(most, int) or isinstance(most, bool) or most < 1:
            raise ValueError(
                f"sampling_params field 'max_new_tokens' is {_brief(most)}, not a whole number ≥ 1"
            )
        ids = kwargs.get("input_ids")
        # type(i) is int: not a bool (an int subclass); min in C, as this runs once per job taken.
        if ids is not None and not (all(type(i) is int for i in ids) and (not ids or min(ids) >= 0)):
            raise ValueError("field 'input_ids' holds something that is not a token id (a whole number ≥ 0)")
        if ids is None and kwargs.get("text") is None and kwargs.get("messages") is None:
            raise ValueError("no prompt: none of 'input_ids', 'text' or 'messages'")
        return cls(**kwargs)

    @property
    def max_new_tokens(self) -> int:
        return int(self.sampling_params["max_new_tokens"])

    @property
    def prompt_length(self) -> int | None:
        return len(self.input_ids) if self.input_ids is not None else None


_SPEC_FIELDS = frozenset(f.name for f in fields(JobSpec))
_REQUIRED = frozenset({"dataset", "row", "sample", "id", "sampling_params"})
# The type each field of a payload must have (a field not listed here is one of ``extra``'s).
_SPEC_TYPES: dict[str, type] = {
    "dataset": str, "row": int, "sample": int, "id": str, "sampling_params": dict, "input_ids": list,
    "text": str, "source_id": str, "messages": list, "think": dict, "keep_prompt": bool, "turns": str,
    "template": dict, "logprobs": int, "batch": dict, "tools": list, "chat_template_kwargs": dict,
    "continue_to": int, "extends": int, "fields": dict, "parent": str, "extra": dict,
}  # fmt: skip
_KIND_WORDS = {
    str: "a string",
    int: "a whole number ≥ 0",
    dict: "an object",
    list: "a list",
    bool: "true or false",
}


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "…"


def cut_short(record: dict[str, Any]) -> bool:
    """The server stopped it below the max_new_tokens asked for (SGLang lowers it silently to fit
    the context or its KV budget; llama.cpp truncates at the slot's context): ``finish_length``
    says where, and the output is not what the recipe asked for."""
    asked = (record.get("sampling_params") or {}).get("max_new_tokens")
    cut = record.get("finish_length")
    return (
        record.get("finish_reason") == "length"
        and isinstance(cut, int)
        and isinstance(asked, int)
        and cut < asked
    )


def extends(record: dict[str, Any]) -> int | None:
    """The ``completion_tokens`` of the record this one supersedes, or None: it supersedes none.

    The supersede rule: ``genq retry --truncated --continue-to N`` continues records that ended on
    ``length`` from their stored output, and the collector appends each longer record to the same
    raw file, after the one it extends, with ``extends`` set. An id's record is its last line in the
    file; every earlier one is superseded (exports, stats and verify count the last), and a line
    that extends one begins with the output of the one before it (`genq verify` checks it). A
    record judged again (:func:`rejudged`) supersedes the same way.
    """
    value = record.get("extends")
    return value if type(value) is int and value >= 0 else None


REJUDGED = "rejudged"  # the key of a record judged again (genq retry --check-failed): how many times


def rejudged(record: dict[str, Any]) -> int | None:
    """How many times this record was sent to be judged again, or None: it was judged once.

    A record the checker failed on is filed ``check_failed`` (in rejected_samples.jsonl); `genq
    retry --check-failed` sends it back to the check stage unchanged but for this count, and the
    collector appends it with its new verdict, to raw_responses.jsonl or rejected_samples.jsonl:
    it supersedes the id's earlier line (the supersede rule), its output and tokens the same.
    """
    value = record.get(REJUDGED)
    return value if type(value) is int and value >= 1 else None


def supersedes(record: dict[str, Any]) -> bool:
    """The record takes the place of its id's earlier line (an extension, or judged again)."""
    return extends(record) is not None or rejudged(record) is not None


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def error_record(
    *,
    id: str,
    dataset: str,
    row: int,
    sample: int,
    source_id: str | None,
    error: str,
    message: str,
    status: int | None,
    attempts: int | None,
) -> dict[str, Any]:
    """A line of ``errors.jsonl``: why a job failed for good, in the server's own words."""
    return {
        "id": id,
        "dataset": dataset,
        "row": row,
        "source_id": source_id,
        "sample": sample,
        "error": error,
        "message": message,
        "status": status,
        "attempts": attempts,
        "failed_at": now_iso(),
        "schema": SCHEMA_VERSION,
    }


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


# genq writes a record's id first (build_record, error_record): read off a line without a JSON parse.
ID_AT_START = re.compile(rb'^\{"id":"([^"]+)"')


def parse_record_id(rid: str, dataset: str, samples: int) -> tuple[int, int] | None:
    """(row, sample) of a record id of ``dataset``, or None if it is not one of its ids."""
    head = f"{dataset}-"
    if not rid.startswith(head):
        return None
    parts = rid[len(head) :].split("-")
    if len(parts) != (2 if samples > 1 else 1) or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), (int(parts[1]) if samples > 1 else 0)
