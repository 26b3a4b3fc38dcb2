"""Build the record (DESIGN.md schema) from a checked /generate response."""

from __future__ import annotations

from typing import Any

from genq.schema import SCHEMA_VERSION, JobSpec, now_iso
from worker.reasoning import split


def build_record(
    record_id: str,
    spec: JobSpec,
    response: dict[str, Any],
    *,
    attempts: int,
    latency_s: float,
    server: str,
    worker: str,
) -> dict[str, Any]:
    meta = response["meta_info"]
    finish = meta["finish_reason"]
    text = response.get("text")
    reasoning, content = None, text
    extra: dict[str, Any] = {}
    if spec.think:
        parts = split(spec.think, response["output_ids"], text, spec.input_ids, spec.text)
        reasoning, content = parts.reasoning, parts.content
        extra["reasoning_tokens"] = parts.reasoning_tokens
    if spec.keep_prompt:  # what exports need: the prompt ids (eagle3) and conversation (sharegpt)
        extra["input_ids"] = spec.input_ids
        extra["messages"] = spec.messages or ([{"role": "user", "content": spec.text}] if spec.text else None)
    return {
        "id": record_id,
        "dataset": spec.dataset,
        "row": spec.row,
        "source_id": spec.source_id,
        "sample": spec.sample,
        "prompt_tokens": meta["prompt_tokens"],
        "completion_tokens": meta["completion_tokens"],
        "cached_tokens": meta.get("cached_tokens"),
        "output_ids": response["output_ids"],
        "text": text,
        "reasoning": reasoning,
        "content": content,
        "finish_reason": finish["type"],
        "matched_stop": finish.get("matched"),
        "latency_s": round(latency_s, 4),
        "attempts": attempts,
        "server": server,
        "worker": worker,
        "sampling_params": spec.sampling_params,
        "finished_at": now_iso(),
        "schema": SCHEMA_VERSION,
        **extra,
    }
