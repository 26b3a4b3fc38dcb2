"""Sampling settings: the flags and ``--sampling-params JSON``, shared by `genq enqueue` and `genq run`.

genq's names are SGLang's (``sampling/sampling_params.py`` in its wheel), the recipe every
record keeps; each backend maps them to its engine's names and refuses the ones it lacks
(``Backend.sampling_keys``). Everything is checked here, before a single job is enqueued, with
SGLang's own rules (SamplingParams.verify): a misspelled key or a value the engine would refuse at
run time is a clear error naming it, never silently dropped.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

import click

from genq.settings import json_object, option

DEFAULT_MAX_NEW_TOKENS = 2048
INT64 = (-(2**63), 2**63 - 1)

_NUMBER = (int, float)
# SGLang's SamplingParams fields genq passes on, with the JSON types each takes. Not here: n (genq's
# --samples makes one job per sample), stream_interval and watermark (serving knobs, not recipes).
KEYS: dict[str, tuple[type, ...]] = {
    "max_new_tokens": (int,),
    "min_new_tokens": (int,),
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": (int,),
    "min_p": _NUMBER,
    "frequency_penalty": _NUMBER,
    "presence_penalty": _NUMBER,
    "repetition_penalty": _NUMBER,
    "stop": (str, list),
    "stop_token_ids": (list,),
    "stop_regex": (str, list),
    "ignore_eos": (bool,),
    "skip_special_tokens": (bool,),
    "spaces_between_special_tokens": (bool,),
    "no_stop_trim": (bool,),
    "sampling_seed": (int,),
    "json_schema": (str,),
    "regex": (str,),
    "ebnf": (str,),
    "structural_tag": (str,),
    "logit_bias": (dict,),
    "custom_params": (dict,),
}


# The settings with a flag of their own (--seed is sampling_seed); --sampling-params takes the rest.
FLAGGED = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "seed")


class SamplingError(ValueError):
    """A sampling setting an engine would refuse; the message names it."""


def check(params: dict[str, Any], allowed: Iterable[str] | None = None, backend: str | None = None) -> None:
    """SGLang's rules for every key and value; ``allowed`` narrows the keys to a backend's."""
    keys = set(KEYS) if allowed is None else set(allowed) & set(KEYS)
    for key, value in params.items():
        if key not in keys:
            where = f"the {backend} backend" if backend else "genq (SGLang's names)"
            near = difflib.get_close_matches(key, KEYS, n=1)
            hint = f"; did you mean {near[0]!r}?" if near and near[0] in keys else ""
            known = ", ".join(sorted(keys))
            raise SamplingError(f"unknown sampling key {key!r} for {where}{hint} (known: {known})")
        types = KEYS[key]
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise SamplingError(
                f"sampling key {key!r}: expected {' or '.join(t.__name__ for t in types)}, got {value!r}"
            )
    _verify(params, backend)


def _verify(p: dict[str, Any], backend: str | None = None) -> None:
    """SamplingParams.verify, message for message where it has one; and what only the backend's
    engine refuses."""

    def bad(message: str) -> SamplingError:
        return SamplingError(message)

    if p.get("temperature", 0) < 0:
        raise bad(f"temperature must be a non-negative finite number, got {p['temperature']}.")
    if backend == "vllm" and p.get("temperature", 0) > 2:
        # vLLM's sampling_params.py _verify_args (seen on the real 0.32): every job would be a 400
        raise bad(f"temperature must be in [0, 2] on vLLM, got {p['temperature']}.")
    if "top_p" in p and not 0 < p["top_p"] <= 1:
        raise bad(f"top_p must be in (0, 1], got {p['top_p']}.")
    if "min_p" in p and not 0 <= p["min_p"] <= 1:
        raise bad(f"min_p must be in [0, 1], got {p['min_p']}.")
    if "top_k" in p and p["top_k"] != -1 and p["top_k"] < 1:
        raise bad(f"top_k must be -1 (disable) or at least 1, got {p['top_k']}.")
    for key in ("frequency_penalty", "presence_penalty"):
        if key in p and not -2 <= p[key] <= 2:
            raise bad(f"{key} must be in [-2, 2], got {p[key]}.")
    if "repetition_penalty" in p and not 0 < p["repetition_penalty"] <= 2:
        raise bad(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {p['repetition_penalty']}.")
    max_new = p.get("max_new_tokens")
    if max_new is not None and max_new < 1:
        raise bad(f"max_new_tokens must be at least 1, got {max_new}.")
    min_new = p.get("min_new_tokens", 0)
    if not 0 <= min_new <= (max_new if max_new is not None else min_new):
        raise bad(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
    if "sampling_seed" in p and not INT64[0] <= p["sampling_seed"] <= INT64[1]:
        raise bad(f"sampling_seed must be in [-2**63, 2**63 - 1], got {p['sampling_seed']}.")
    stop = p.get("stop")
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise bad(f"stop must be a string or a list of strings, got {stop!r}.")
    ids = p.get("stop_token_ids")
    if ids is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise bad(f"stop_token_ids must be a list of token ids, got {ids!r}.")
    if sum(k in p for k in ("json_schema", "regex", "ebnf", "structural_tag")) > 1:
        raise bad("Only one of json_schema, regex, ebnf, or structural_tag can be set.")


def _int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if not value:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from exc


@dataclass(frozen=True)
class Sampling:
    """The sampling settings of one command line: the flags, and ``--sampling-params``."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    samples: int = 1
    seed: int | None = None
    sampling_params: dict[str, Any] | None = None

    def params(self) -> dict[str, Any]:
        """SGLang sampling_params with only the keys the user set (max_new_tokens always)."""
        flags = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop_token_ids": self.stop_token_ids,
            "sampling_seed": self.seed,
        }
        return {**(self.sampling_params or {}), **{k: v for k, v in flags.items() if v is not None}}


def sampling_options(func: Callable) -> Callable:
    """Add the sampling flags; the command receives them as one checked ``sampling`` argument."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        values = {f.name: kwargs.pop(f.name) for f in fields(Sampling)}
        ctx = click.get_current_context()
        given = values["sampling_params"] or {}
        for name in FLAGGED:
            key = "sampling_seed" if name == "seed" else name
            explicit = ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT
            if key in given and explicit:
                raise click.BadParameter(f"{key} is given both as a flag and in --sampling-params")
            if key in given and name == "max_new_tokens":
                values[name] = given.pop(key)  # the JSON's, not the flag's default
        sampling = Sampling(**values)
        try:
            check(sampling.params())
        except SamplingError as exc:
            raise click.BadParameter(str(exc), param_hint="sampling") from exc
        if sampling.seed is not None and sampling.seed + sampling.samples - 1 > INT64[1]:
            raise click.BadParameter("seed + samples - 1 must stay a 64-bit integer", param_hint="--seed")
        return func(*args, sampling=sampling, **kwargs)

    decorators = [
        option(
            "--max-new-tokens",
            type=click.IntRange(min=1),
            default=DEFAULT_MAX_NEW_TOKENS,
            help="Tokens to generate at most (explicit: SGLang's own silent default is 128).",
        ),
        option("--temperature", type=click.FloatRange(min=0), default=None, help="Sampling temperature."),
        option(
            "--top-p",
            type=click.FloatRange(0, 1, min_open=True),
            default=None,
            help="Nucleus sampling, (0, 1].",
        ),
        option("--top-k", type=int, default=None, help="Top-k sampling (-1: off)."),
        option("--stop-token-ids", callback=_int_list, default=None, help="Comma-separated stop token ids."),
        option(
            "--samples", type=click.IntRange(min=1), default=1, help="Jobs per prompt, each its own seed."
        ),
        option(
            "--seed",
            type=click.IntRange(*INT64),
            default=None,
            help="sampling_seed of sample 0 (sample k gets seed + k); a 64-bit integer.",
        ),
        option(
            "--sampling-params",
            callback=json_object('{"repetition_penalty": 1.05}'),
            default=None,
            help="JSON object of any other sampling setting, in SGLang's names: "
            + ", ".join(k for k in KEYS if k not in FLAGGED and k != "sampling_seed")
            + ". Checked at enqueue; a misspelled key is an error.",
        ),
    ]
    for decorator in reversed(decorators):
        wrapper = decorator(wrapper)
    return wrapper
