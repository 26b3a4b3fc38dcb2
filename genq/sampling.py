"""The sampling flags (SGLang's own keys), shared by `genq enqueue` and `genq run`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import click

from genq.settings import option

DEFAULT_MAX_NEW_TOKENS = 2048


INT64 = (-(2**63), 2**63 - 1)


def _top_k(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    """SGLang's SamplingParams.verify: -1 (off) or at least 1."""
    if value is not None and value != -1 and value < 1:
        raise click.BadParameter(f"must be -1 (off) or at least 1, got {value}")
    return value


def _int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if not value:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from exc


@dataclass(frozen=True)
class Sampling:
    """The sampling flags of one command line."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    samples: int = 1
    seed: int | None = None

    def params(self) -> dict[str, Any]:
        """SGLang sampling_params with only the keys the user set (max_new_tokens always)."""
        params = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop_token_ids": self.stop_token_ids,
            "sampling_seed": self.seed,
        }
        return {k: v for k, v in params.items() if v is not None}

    def argv(self) -> list[str]:
        """The same settings as command-line flags (for `genq run` to hand to `genq enqueue`)."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                flag = "--" + f.name.replace("_", "-")
                out += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
        return out


def sampling_options(func: Callable) -> Callable:
    """Add the sampling flags; the command receives them as one ``sampling`` argument."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        values = {f.name: kwargs.pop(f.name) for f in fields(Sampling)}
        if values["seed"] is not None and values["seed"] + values["samples"] - 1 > INT64[1]:
            raise click.BadParameter("seed + samples - 1 must stay a 64-bit integer", param_hint="--seed")
        return func(*args, sampling=Sampling(**values), **kwargs)

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
        option("--top-k", type=int, default=None, callback=_top_k, help="Top-k sampling (-1: off)."),
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
    ]
    for decorator in reversed(decorators):
        wrapper = decorator(wrapper)
    return wrapper
