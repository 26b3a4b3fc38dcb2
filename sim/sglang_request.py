"""Parsing and validating a /generate body with SGLang's rules and messages.

A client that passes here passes the real server, and one that is rejected here is rejected
there, with the status and body shape of the release the simulator imitates (sim/versions.py).
Paths in comments are under ``sglang/srt/`` in the wheel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from genq.sim import model
from genq.sim.errors import internal_error, schema_error, validation_error, value_error
from genq.sim.versions import Quirks

# The fields of SGLang 0.5.23's SamplingParams, in the order its schema gate lists them in "unknown
# field" errors (entrypoints/api_contract.py, checked against the real server).
SAMPLING_KEYS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)
# The schema gate's type of each field, as serde names it in "invalid type: ..., expected X".
_I64, _F64, _BOOL, _STR = "i64", "f64", "a boolean", "a string"
_STRING_OR_LIST = "a value or an array of values for StringOrList"
SCHEMA_TYPES = {
    **dict.fromkeys(("max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed"), _I64),
    **dict.fromkeys(("stream_interval", "beam_width"), _I64),
    **dict.fromkeys(("temperature", "top_p", "min_p", "repetition_penalty"), _F64),
    **dict.fromkeys(("frequency_penalty", "presence_penalty"), _F64),
    **dict.fromkeys(
        ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"), _BOOL
    ),
    **dict.fromkeys(("json_schema", "regex", "ebnf", "structural_tag"), _STR),
    **dict.fromkeys(("stop", "stop_regex"), _STRING_OR_LIST),
    "stop_token_ids": "a sequence",
    "logit_bias": "a map",
}
# `scheduler.py` init_req_max_new_tokens: an explicit null means "no limit" before clamping.
NO_LIMIT = 1 << 30


class RequestError(Exception):
    """A rejected request, answered in the body shape of the place SGLang rejects it:

    ``value`` 400 {"error": {"message"}} (a ValueError), ``validation`` 400 ErrorResponse (pydantic),
    ``schema`` 400 {"error": "..."} (0.5.22's schema gate), ``internal`` plain-text 500 (a TypeError
    nobody catches).
    """

    def __init__(self, message: str, *, kind: str = "value") -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind

    def response(self) -> web.Response:
        return {"value": value_error, "validation": validation_error, "schema": schema_error}.get(
            self.kind, internal_error
        )(self.message)


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A validated request: prompt ids, sampling params with max_new_tokens resolved, and rid."""

    rid: str | None
    input_ids: list[int]
    sampling_params: dict[str, Any]
    requested_max_new_tokens: int | None = None  # before the scheduler's clamp
    logprobs: int | None = None  # return_logprob: top_logprobs_num (0: only the sampled token's)

    @property
    def ids_in_vocab(self) -> bool:
        """SGLang never checks this (tokenizer_manager.py's check is not called): ids outside the
        vocabulary reach the embedding, and a GPU faults on them."""
        return all(0 <= i < model.VOCAB_SIZE for i in self.input_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.sampling_params["max_new_tokens"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_body(raw: bytes) -> dict[str, Any]:
    """Decode JSON; a non-object is a schema error, as in FastAPI."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"JSON decode error: {exc}", kind="validation") from exc
    if not isinstance(body, dict):
        raise RequestError("Input should be a valid dictionary or object", kind="validation")
    return body


def check_rid(body: dict[str, Any]) -> str | None:
    rid = body.get("rid")
    if isinstance(rid, list):
        raise RequestError("The simulator does not support batch requests (rid is a list).")
    if rid is not None and not isinstance(rid, str):
        raise RequestError("rid: Input should be a valid string", kind="validation")
    return rid


def _prompt_ids(body: dict[str, Any], skip_tokenizer_init: bool) -> list[int]:
    """io_struct.py: one of text/input_ids/input_embeds; with both text and input_ids, the ids win.
    Without a tokenizer, text is refused (tokenizer_manager.py _tokenize_one_request)."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if body.get("input_embeds") is not None:
        raise RequestError("The simulator does not support input_embeds.")
    if text is None and input_ids is None:
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    nested_ids = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
    if (input_ids is None and isinstance(text, list)) or nested_ids:
        raise RequestError("The simulator does not support batch requests (a list of prompts).")
    if input_ids is None:
        if not isinstance(text, str):
            raise RequestError("text: Input should be a valid string", kind="validation")
        if skip_tokenizer_init:
            raise RequestError(
                "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please "
                "provide input_ids or re-initialize the engine with skip_tokenizer_init=False."
            )
        return model.tokenize(text)
    if not isinstance(input_ids, list) or not all(_is_int(i) for i in input_ids):
        raise RequestError("input_ids: Input should be a valid list of integers", kind="validation")
    if not input_ids:
        raise RequestError("input_ids cannot be empty.")
    return list(input_ids)


def _serde_unexpected(value: Any) -> str:
    """How serde names a JSON value it did not expect."""
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value!r}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def _schema_type_error(key: str, value: Any) -> str | None:
    """The schema gate's (0.5.22 on) serde error for a value of the wrong JSON type, or None."""
    expected = SCHEMA_TYPES.get(key)
    if value is None or expected is None:
        return None
    if expected == _I64:
        ok = _is_int(value)
    elif expected == _F64:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif expected == _BOOL:
        ok = isinstance(value, bool)
    elif expected == _STR:
        ok = isinstance(value, str)
    elif expected == _STRING_OR_LIST:
        if isinstance(value, list):
            bad = next((v for v in value if not isinstance(v, str)), None)
            return None if bad is None else f"invalid type: {_serde_unexpected(bad)}, expected a string"
        ok = isinstance(value, str)
    elif expected == "a sequence":
        if isinstance(value, list):
            bad = next((v for v in value if not _is_int(v)), None)
            return None if bad is None else f"invalid type: {_serde_unexpected(bad)}, expected i64"
        ok = False
    else:
        ok = isinstance(value, dict)
    return None if ok else f"invalid type: {_serde_unexpected(value)}, expected {expected}"


def _check_types(params: dict[str, Any]) -> None:
    for key in ("max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed"):
        if params.get(key) is not None and not _is_int(params[key]):
            raise RequestError(f"{key} must be an integer, got {params[key]!r}.")
    floats = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
    for key in floats:
        if params.get(key) is not None and not _is_number(params[key]):
            raise RequestError(f"{key} must be a finite number, got {params[key]!r}.")
    for key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        if params.get(key) is not None and not isinstance(params[key], bool):
            raise RequestError(f"{key} must be a boolean, got {params[key]!r}.")
    stop = params.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise RequestError(f"stop must be a string or a list of strings, got {stop!r}.")
    stop_ids = params.get("stop_token_ids")
    if stop_ids is not None and not (isinstance(stop_ids, list) and all(_is_int(t) for t in stop_ids)):
        raise RequestError(f"stop_token_ids must be a list of integers, got {stop_ids!r}.")


def _verify(params: dict[str, Any]) -> None:
    """SGLang's SamplingParams.verify checks and messages."""
    temperature = params.get("temperature")
    top_p, min_p, top_k = params.get("top_p"), params.get("min_p"), params.get("top_k")
    if temperature is not None and temperature < 0.0:
        raise RequestError(f"temperature must be a non-negative finite number, got {temperature}.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}.")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {min_p}.")
    if top_k is not None and top_k < 1 and top_k != -1:
        raise RequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    for key in ("frequency_penalty", "presence_penalty"):
        if params.get(key) is not None and not -2.0 <= params[key] <= 2.0:
            raise RequestError(f"{key} must be in [-2, 2], got {params[key]}.")
    penalty = params.get("repetition_penalty")
    if penalty is not None and not 0.0 < penalty <= 2.0:
        raise RequestError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {penalty}.")
    max_new, min_new = params.get("max_new_tokens"), params.get("min_new_tokens") or 0
    if min_new < 0:
        raise RequestError(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    if max_new is not None:
        if max_new < 0:
            raise RequestError(f"max_new_tokens must be at least 0, got {max_new}.")
        if min_new > max_new:
            raise RequestError(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
    for token_id in params.get("logit_bias") or {}:
        if not str(token_id).lstrip("-").isdigit() or not 0 <= int(token_id) < model.VOCAB_SIZE:
            raise RequestError(f"logit_bias must has keys in [0, {model.VOCAB_SIZE - 1}], got {token_id}.")
    seed = params.get("sampling_seed")
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        raise RequestError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    if sum(params.get(k) is not None for k in ("json_schema", "regex", "ebnf", "structural_tag")) > 1:
        raise RequestError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    if params.get("n") not in (None, 1):
        raise RequestError("The simulator does not support n > 1; send n separate requests.")


def _needs_tokenizer(params: dict[str, Any]) -> None:
    """sampling_params.py raise_if_tokenizer_required (normalize, before verify), on a server started
    with --skip-tokenizer-init: what only its tokenizer could match or hold back."""
    stop, stop_regex = params.get("stop"), params.get("stop_regex")
    stops = [stop] if isinstance(stop, str) else stop
    regexes = [stop_regex] if isinstance(stop_regex, str) else stop_regex
    if stops:
        raise RequestError(
            f"stop={stops!r} is unavailable when skip_tokenizer_init=True "
            "(requires tokenizer to decode tokens to text for matching)."
        )
    if regexes:
        raise RequestError(
            f"stop_regex={regexes!r} is unavailable when skip_tokenizer_init=True "
            "(requires tokenizer to decode tokens to text for matching)."
        )
    if (params.get("min_new_tokens") or 0) > 0:
        raise RequestError(
            f"min_new_tokens={params['min_new_tokens']} is unavailable when skip_tokenizer_init=True "
            "(requires tokenizer for eos_token_id)."
        )


def _sampling_params(body: dict[str, Any], quirks: Quirks, skip_tokenizer_init: bool) -> dict[str, Any]:
    params = body.get("sampling_params")
    if params is None:
        return {}
    if isinstance(params, list):
        raise RequestError("The simulator does not support batch requests (sampling_params is a list).")
    if not isinstance(params, dict):
        raise RequestError("sampling_params: Input should be a valid dictionary", kind="validation")
    known = SAMPLING_KEYS if quirks.seed_field else tuple(k for k in SAMPLING_KEYS if k != "sampling_seed")
    if quirks.schema_gate:  # serde stops at the first field it cannot take, in the body's order
        for key, value in params.items():
            if key not in known:
                expected = ", ".join(f"`{k}`" for k in known)
                raise RequestError(f"unknown field `{key}`, expected one of {expected}", kind="schema")
            problem = _schema_type_error(key, value)
            if problem is not None:
                raise RequestError(problem, kind="schema")
    elif any(k not in known for k in params):  # SamplingParams(**params) -> TypeError, uncaught
        raise RequestError("Internal Server Error", kind="internal")
    _check_types(params)
    if skip_tokenizer_init:
        _needs_tokenizer(params)
    temperature = params.get("temperature")
    greedy = temperature is not None and 0 <= temperature < 1e-6
    # sampling_params.py normalizes greedy to temperature 1 with top_k 1 before verify() (so a top_k
    # of 0 passes there); the toy model samples from the params as sent.
    _verify({**params, "top_k": 1} if greedy else params)
    return dict(params)


def _fit_context(
    params: dict[str, Any], prompt_tokens: int, context: int, max_input_len: int, quirks: Quirks
) -> int | None:
    """SGLang's context rules in order; returns the max_new_tokens asked for (None: absent).

    tokenizer_manager.py: a prompt >= the context is refused, and prompt + max_new_tokens past it
    (only when max_new_tokens is given). scheduler.py: a prompt >= max_req_input_len is refused
    (utils.validate_input_length), then max_new_tokens is lowered silently to what the context
    leaves (init_req_max_new_tokens); finish_reason.length reports the lowered value.
    """
    if prompt_tokens >= context:
        raise RequestError(
            f"The input ({prompt_tokens} tokens) is longer than the model's context length "
            f"({context} tokens)."
        )
    requested = params.get("max_new_tokens")
    if requested is not None:
        total = prompt_tokens + requested
        if total > context or (total == context and not quirks.total_check_strict):
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                f"You requested a total of {total} tokens: {prompt_tokens} tokens from the input messages "
                f"and {requested} tokens for the completion. Please reduce the number of tokens in the "
                "input messages or the completion to fit within the limit."
            )
    if prompt_tokens >= max_input_len:
        raise RequestError(
            f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length ({max_input_len} "
            "tokens). Use a shorter input or enable --allow-auto-truncate."
        )
    return requested


def parse_generate(
    body: dict[str, Any],
    *,
    context: int,
    max_input_len: int,
    quirks: Quirks,
    max_new_tokens_limit: int | None = None,
    skip_tokenizer_init: bool = False,
) -> GenerateRequest:
    """Validate a decoded /generate body; raises RequestError with SGLang's message."""
    rid = check_rid(body)
    if body.get("stream"):
        raise RequestError("The simulator does not support stream=true; use non-streamed /generate.")
    input_ids = _prompt_ids(body, skip_tokenizer_init)
    params = _sampling_params(body, quirks, skip_tokenizer_init)
    absent = "max_new_tokens" not in params
    requested = _fit_context(params, len(input_ids), context, max_input_len, quirks)
    wanted = model.DEFAULT_MAX_NEW_TOKENS if absent else (NO_LIMIT if requested is None else requested)
    if max_new_tokens_limit is not None:
        wanted = min(wanted, max_new_tokens_limit)
    params["max_new_tokens"] = max(0, min(wanted, context - 2 - len(input_ids)))
    logprobs = int(body.get("top_logprobs_num") or 0) if body.get("return_logprob") else None
    return GenerateRequest(rid, input_ids, params, requested, logprobs)
