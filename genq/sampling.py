"""The sampling flags (SGLang's own keys), shared by `genq enqueue` and `genq run`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from genq.settings import option

DEFAULT_MAX_NEW_TOKENS = 2048


def _int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if not value:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from exc


def sampling_options(func: Callable) -> Callable:
    decorators = [
        option(
            "--max-new-tokens",
            type=click.IntRange(min=1),
            default=DEFAULT_MAX_NEW_TOKENS,
            help="Tokens to generate at most (explicit: SGLang's own silent default is 128).",
        ),
        option("--temperature", type=click.FloatRange(min=0), default=None, help="Sampling temperature."),
        option("--top-p", type=click.FloatRange(0, 1), default=None, help="Nucleus sampling."),
        option("--top-k", type=int, default=None, help="Top-k sampling (-1: off)."),
        option("--stop-token-ids", callback=_int_list, default=None, help="Comma-separated stop token ids."),
        option(
            "--samples", type=click.IntRange(min=1), default=1, help="Jobs per prompt, each its own seed."
        ),
        option("--seed", type=int, default=None, help="sampling_seed of sample 0 (sample k gets seed + k)."),
    ]
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


def sampling_params(
    max_new_tokens: int,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    stop_token_ids: list[int] | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """SGLang sampling_params with only the keys the user set (max_new_tokens always)."""
    params = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "stop_token_ids": stop_token_ids,
        "sampling_seed": seed,
    }
    return {k: v for k, v in params.items() if v is not None}


def sampling_argv(max_new_tokens, temperature, top_p, top_k, stop_token_ids, samples, seed) -> list[str]:
    """The same settings as `genq enqueue` flags."""
    argv = ["--max-new-tokens", str(max_new_tokens), "--samples", str(samples)]
    for flag, value in (
        ("--temperature", temperature),
        ("--top-p", top_p),
        ("--top-k", top_k),
        ("--seed", seed),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if stop_token_ids:
        argv += ["--stop-token-ids", ",".join(map(str, stop_token_ids))]
    return argv
