"""What vLLM's completions and every OpenAI-style chat endpoint share: the model list, the POST of a
generation (its request id header, its errors), genq's sampling keys in OpenAI's and vLLM's names,
``choices[0]``, finish reasons, the matched stop and usage.

Facts from vLLM 0.33's source (``vllm/entrypoints/openai/``; see sim/vllm.py for the list): every
omitted sampling field falls back to the model's generation_config, and unknown fields are dropped
without a word, so genq sends each field by name from the fixed tables below, never a dict as is.
"""

from __future__ import annotations

from typing import Any

from genq.backends.base import AttemptError, Cost, Http, ServerRefused, error_message, parse_json, wrong

# genq's sampling keys (SGLang's names, the dataset's recipe) -> OpenAI's chat API.
OPENAI_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "sampling_seed": "seed",
    "stop": "stop",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "logit_bias": "logit_bias",
}
# -> vLLM's extra sampling fields (CompletionRequest and ChatCompletionRequest alike).
VLLM_KEYS = {
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "min_new_tokens": "min_tokens",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "include_stop_str_in_output",
}
# What genq sends for a field the dataset left out: the neutral value (SGLang's default), so the
# server's generation_config never decides it.
NEUTRAL = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "skip_special_tokens": True,
}
# Structured output: genq's (SGLang's) keys -> vLLM's structured_outputs keys.
STRUCTURED = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}


def map_sampling(params: dict[str, Any], *, extras: bool, explicit: bool) -> dict[str, Any]:
    """OpenAI (and with ``extras`` vLLM) fields for genq's sampling params; ``explicit`` fills
    what the dataset left out with the neutral values. A key with no equivalent is an error.
    max_new_tokens is left to the caller: completions and chat name it differently."""
    allowed = {**OPENAI_KEYS, **(VLLM_KEYS if extras else {})}
    out: dict[str, Any] = {}
    structured: dict[str, Any] = {}
    for key, value in params.items():
        if key == "max_new_tokens":
            continue
        if extras and key in STRUCTURED:
            structured[STRUCTURED[key]] = value
        elif key in allowed:
            out[allowed[key]] = value
        else:
            where = "vLLM" if extras else "the OpenAI chat API"
            raise AttemptError(
                "bad_request", f"sampling key {key!r} has no equivalent in {where}", cost=Cost.FATAL
            )
    if structured:
        out["structured_outputs"] = structured
    if explicit:
        for key, value in NEUTRAL.items():
            if key in allowed:
                out.setdefault(allowed[key], value)
    return out


async def post(http: Http, path: str, body: dict[str, Any], rid: str, timeout: float) -> Any:
    """One generation sent to ``path`` as request ``rid``: the answer's JSON, or the failed
    attempt classified."""
    # vLLM takes the request id from this header over the body's request_id.
    status, raw, headers = await http.call("POST", path, body, timeout=timeout, headers={"X-Request-Id": rid})
    if status != 200:
        raise classify(status, raw, headers)
    return parse_json(raw)


def first_choice(data: Any) -> dict[str, Any]:
    """The answer's ``choices[0]`` (genq asks for n=1)."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise wrong("choices", "response has no choices")
    return choices[0]


def matched_stop(choice: dict[str, Any], reason: str, output_ids: list[int] | None) -> Any:
    """The stop that ended the answer: vLLM's ``stop_reason`` (SGLang's ``matched_stop``), else on
    a stop the last output id: the model's own EOS, which vLLM leaves unnamed."""
    matched = choice.get("stop_reason", choice.get("matched_stop"))
    if matched is None and reason == "stop" and output_ids:
        matched = output_ids[-1]
    return matched


async def model_card(http: Http, wanted: str | None) -> dict[str, Any]:
    """``/v1/models``' card of model ``wanted`` (``genq worker --model``), else its first one;
    ServerRefused on a refused key or a model the server does not serve."""
    status, cards = await http.get_json("/v1/models")
    if status in (401, 403):
        raise ServerRefused(
            f"{http.base_url} refused genq's API key on /v1/models ({status}): set GENQ_SERVER_API_KEY "
            "or GENQ_SERVER_API_KEY_FILE to the server's --api-key"
        )
    if status >= 500 or status == 0:
        raise AttemptError("unavailable", f"/v1/models answered {status}", status, cost=Cost.FREE, down=True)
    data = cards.get("data") if isinstance(cards, dict) else None
    if status != 200 or not isinstance(data, list) or not data:
        raise ServerRefused(f"{http.base_url} does not list its models on /v1/models (HTTP {status})")
    card = next((c for c in data if c.get("id") == wanted), None) if wanted else data[0]
    if card is None:
        names = ", ".join(str(c.get("id")) for c in data)
        raise ServerRefused(f"{http.base_url} does not serve the model {wanted!r} (it serves {names})")
    return card


async def server_version(http: Http) -> str | None:
    """vLLM's ``/version``; None where the server has none (hosted APIs, SGLang)."""
    try:
        status, data = await http.get_json("/version", timeout=15)
    except AttemptError:
        return None
    return str(data["version"]) if status == 200 and isinstance(data, dict) and "version" in data else None


def classify(status: int, raw: bytes, headers: Any) -> AttemptError:
    from genq.backends.base import from_status

    exc = from_status(status, raw, headers)
    message = exc.message
    if status == 503 and ("busy" in message or "backlog" in message or "overloaded" in message):
        # vLLM --max-num-queued-reqs/-tokens, or a hosted API full: refused before any work.
        exc.kind, exc.cost, exc.down = "overloaded", Cost.FREE, False
    elif status == 400 and "already running" in message:
        exc.kind, exc.cost = "duplicate_rid", Cost.ATTEMPT  # vLLM <= 0.13 with a reused request id
    return exc


def usage_counts(data: dict[str, Any]) -> tuple[int, int, int | None]:
    """(prompt, completion, cached) tokens; cached is None unless the server reports it."""
    usage = data.get("usage")
    if not isinstance(usage, dict):
        raise wrong("counts", "response has no usage")
    counts = [usage.get("prompt_tokens"), usage.get("completion_tokens")]
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        raise wrong("counts", "usage.prompt_tokens/completion_tokens missing or not integers")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return counts[0], counts[1], cached if isinstance(cached, int) else None


def finish(choice: dict[str, Any]) -> str:
    """stop or length; an abort (HTTP 200, partial output) is a failed attempt."""
    reason = choice.get("finish_reason")
    if reason == "abort":
        raise AttemptError("aborted", "the server aborted the request (finish_reason abort)", 200)
    if reason == "repetition":  # vLLM's repetition detection (0.20 on): a stop the client asked for
        return "stop"
    if reason in ("stop", "length"):
        return reason
    if reason == "content_filter":
        raise AttemptError(
            "content_filter",
            "the server filtered the answer (finish_reason content_filter)",
            200,
            cost=Cost.FATAL,
        )
    raise wrong("finish_reason", f"unexpected finish_reason {reason!r}")


def refused_probe(url: str, what: str, status: int, raw: bytes) -> ServerRefused:
    return ServerRefused(f"{url} refused a 1-token {what} ({status}): {error_message(raw)}")


CHAT_KEYS = frozenset({"max_new_tokens", *OPENAI_KEYS})
VLLM_SAMPLING_KEYS = frozenset({*CHAT_KEYS, *VLLM_KEYS, *STRUCTURED})
