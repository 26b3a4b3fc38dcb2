"""OpenAI Batch API files, in and out: the request lines `genq enqueue` reads and the output lines
`genq export --format openai-batch` writes (the shapes of OpenAI's Batch API and vLLM's run-batch).

A request line is ``{"custom_id", "method", "url", "body"}``; its body's sampling fields are mapped
to genq's names (SGLang's) here, and nowhere else. An output line is ``{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}`` with a ``chat.completion`` or
``text_completion`` body, as the request's ``url`` asked. It sits in the contract because both
floors speak it: the producer reads requests, the collector's export writes answers; the record
carries the request's ``url`` and ``model`` between them (:data:`RECORD_KEY`).
"""

from __future__ import annotations

import calendar
import time
from dataclasses import dataclass
from typing import Any

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
# The record field keeping the request's url and model, for the export (worker/record.py copies it).
RECORD_KEY = "batch"

# Body fields -> genq's sampling names: OpenAI's, then the extensions vLLM's run-batch also reads.
SAMPLING = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "seed": "sampling_seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
}
# Body fields that change nothing genq sends, when they hold these values (None: any value).
HARMLESS: dict[str, Any] = {"model": None, "user": None, "n": 1, "stream": False}
PROMPT_FIELD = {CHAT_URL: "messages", COMPLETIONS_URL: "prompt"}


class BatchError(ValueError):
    """A request line genq cannot run as written; the message names the field."""


@dataclass
class Request:
    """One request line: where it goes, what it asks, and with which sampling (genq's names)."""

    custom_id: str
    url: str
    model: str | None
    body: dict[str, Any]
    sampling: dict[str, Any]

    @property
    def note(self) -> dict[str, Any]:
        """What the record keeps of the request (:data:`RECORD_KEY`)."""
        return {"url": self.url, "model": self.model}


def parse(data: dict[str, Any]) -> Request:
    """A request line, checked: its url, its body's prompt field present, every body field known."""
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchError(f"field 'custom_id': expected a non-empty string, got {custom_id!r}")
    method = data.get("method", "POST")
    if method != "POST":
        raise BatchError(f"field 'method': expected 'POST', got {method!r}")
    url = data.get("url")
    if url not in URLS:
        raise BatchError(f"field 'url': expected {' or '.join(map(repr, URLS))}, got {url!r}")
    body = data.get("body")
    if not isinstance(body, dict):
        raise BatchError(f"field 'body': expected an object, got {type(body).__name__}")
    prompt = PROMPT_FIELD[url]
    if prompt not in body:
        raise BatchError(f"field 'body.{prompt}': missing (url {url} needs it)")
    for key, value in body.items():
        if key == prompt or key in SAMPLING or (key == "tools" and url == CHAT_URL):
            continue  # tools: the function declarations, rendered with the conversation
        if key in HARMLESS and HARMLESS[key] in (None, value):
            continue
        if key in HARMLESS:
            raise BatchError(
                f"field 'body.{key}': genq takes only {HARMLESS[key]!r} here, got {value!r}"
                + (" (use --samples)" if key == "n" else "")
            )
        raise BatchError(
            f"field 'body.{key}': not a field genq maps (it maps {', '.join(SAMPLING)}; "
            f"{', '.join(HARMLESS)} change nothing); remove it from the rows or run them elsewhere"
        )
    model = body.get("model")
    return Request(custom_id, url, model if isinstance(model, str) else None, body, sampling(body))


def sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The body's sampling fields in genq's names (max_tokens and max_completion_tokens must agree)."""
    out: dict[str, Any] = {}
    for key, name in SAMPLING.items():
        if key not in body or body[key] is None:
            continue
        if name in out and out[name] != body[key]:
            raise BatchError(
                f"field 'body.{key}': {body[key]!r} differs from the other token limit {out[name]!r}"
            )
        out[name] = body[key]
    return out


# -- output -----------------------------------------------------------------------------------


def output_line(record: dict[str, Any], reasoning_content: bool = False) -> dict[str, Any]:
    """The Batch API's output line of one genq record: a chat.completion, or a text_completion when
    the request was a ``/v1/completions`` one."""
    note = record.get(RECORD_KEY) or {}
    rid = str(record.get("id"))
    model = note.get("model") or str(record.get("server") or "")
    created = _epoch(record.get("finished_at"))
    prompt, completion = record.get("prompt_tokens"), record.get("completion_tokens")
    total = prompt + completion if isinstance(prompt, int) and isinstance(completion, int) else None
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}
    finish = record.get("finish_reason")
    if note.get("url") == COMPLETIONS_URL:
        choice: dict[str, Any] = {
            "index": 0,
            "text": record.get("text"),
            "logprobs": None,
            "finish_reason": finish,
        }
        body = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model}
    else:
        message: dict[str, Any] = {"role": "assistant", "content": record.get("content")}
        if reasoning_content and record.get("reasoning") is not None:
            message["reasoning_content"] = record["reasoning"]
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        body = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": model}
    return {
        "id": f"batch_req_{rid}",
        "custom_id": record.get("source_id"),
        "response": {
            "status_code": 200,
            "request_id": rid,
            "body": {**body, "choices": [choice], "usage": usage},
        },
        "error": None,
    }


def error_line(error: dict[str, Any]) -> dict[str, Any]:
    """The Batch API's line of a request that failed for good (a line of errors.jsonl)."""
    return {
        "id": f"batch_req_{error.get('id')}",
        "custom_id": error.get("source_id"),
        "response": None,
        "error": {"code": error.get("error"), "message": error.get("message")},
    }


def _epoch(iso: Any) -> int | None:
    """Seconds since the epoch of genq's UTC time stamps (finished_at); None when the record has none."""
    try:
        return calendar.timegm(time.strptime(iso, "%Y-%m-%dT%H:%M:%SZ"))
    except (TypeError, ValueError):
        return None
