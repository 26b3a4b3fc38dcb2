"""Build the record (docs/design.md schema) from a backend's normalized answer."""

from __future__ import annotations

from typing import Any

from genq.backends import Answer
from genq.logprobs import FILE as LOGPROBS_FILE
from genq.openai_batch import RECORD_KEY as BATCH_KEY
from genq.schema import SCHEMA_VERSION, JobSpec, now_iso
from genq.worker.reasoning import split


def build_record(
    spec: JobSpec,
    answer: Answer,
    *,
    attempts: int,
    latency_s: float,
    server: str,
    worker: str,
    backend: str,
) -> dict[str, Any]:
    reasoning, content = None, answer.text
    extra: dict[str, Any] = {}
    if answer.content is not None or answer.reasoning is not None:
        reasoning, content = answer.reasoning, answer.content  # the server split it
    elif spec.think and answer.output_ids is not None:
        parts = split(spec.think, answer.output_ids, answer.text, spec.input_ids, spec.text)
        reasoning, content = parts.reasoning, parts.content
        extra["reasoning_tokens"] = parts.reasoning_tokens
    if spec.keep_prompt:  # what exports need: the prompt ids (eagle3) and conversation (sharegpt)
        extra["input_ids"] = spec.input_ids if spec.input_ids is not None else answer.prompt_ids
        extra["messages"] = spec.messages or ([{"role": "user", "content": spec.text}] if spec.text else None)
    if spec.batch is not None:  # an OpenAI Batch request: its export answers in the request's shape
        extra[BATCH_KEY] = spec.batch
    if spec.fields is not None:  # the row's fields a checker compares with (enqueue --keep-field)
        extra["fields"] = spec.fields
    if spec.parent is not None:  # a stage's record: the record its prompt was made from
        extra["parent"] = spec.parent
    if spec.tools is not None:  # the functions the model was offered: part of the prompt, for exports
        extra["tools"] = spec.tools
    if answer.finish_length is not None:
        extra["finish_length"] = answer.finish_length  # where the server cut max_new_tokens
    if not answer.token_exact:
        extra["token_exact"] = False
    if answer.logprobs is not None:  # the numbers themselves go to logprobs.bin (genq/logprobs.py)
        extra["logprobs"] = {
            "file": LOGPROBS_FILE,
            "k": answer.logprobs.k,
            "tokens": len(answer.logprobs.token),
        }
    return {
        "id": spec.id,
        "dataset": spec.dataset,
        "row": spec.row,
        "source_id": spec.source_id,
        "sample": spec.sample,
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "cached_tokens": answer.cached_tokens,
        "output_ids": answer.output_ids,
        "text": answer.text,
        "reasoning": reasoning,
        "content": content,
        "finish_reason": answer.finish_reason,
        "matched_stop": answer.matched_stop,
        "latency_s": round(latency_s, 4),
        "attempts": attempts,
        "server": server,
        "worker": worker,
        "sampling_params": spec.sampling_params,
        "finished_at": now_iso(),
        "schema": SCHEMA_VERSION,
        "backend": backend,
        **extra,
    }
