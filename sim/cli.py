"""`sim-server`: run the simulator from a shell or a test.

It prints one line, `sim-server listening on http://HOST:PORT`, once the socket is bound, so a
parent process can read the URL (needed with --port 0). SIGTERM and SIGINT stop it with exit 0.
Every option can also come from GENQ_SIM_<NAME>, e.g. GENQ_SIM_FAIL_500=0.1.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable
from typing import Any

import click
from aiohttp import web

from genq.sim import model, versions
from genq.sim.config import SimConfig
from genq.sim.faults import FaultRates
from genq.sim.server import make_app

RATE = click.FloatRange(0.0, 1.0)


def _option(flag: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A click option whose env var is GENQ_SIM_ plus the flag's name."""
    # An on/off pair ("--x/--no-x") is one variable, named after its first half.
    envvar = "GENQ_SIM_" + flag.split("/")[0].lstrip("-").replace("-", "_").upper()
    return click.option(flag, envvar=envvar, show_envvar=True, show_default=True, **kwargs)


def _thinking(think_ids: str | None) -> model.Thinking | None:
    if think_ids is None:
        return None
    try:
        start, end = (int(i) for i in think_ids.split(","))
    except ValueError:
        raise click.BadParameter(
            f"{think_ids!r}: give two ids, START,END", param_hint="--think-ids"
        ) from None
    return model.Thinking(start, end)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _serve(config: SimConfig, host: str, port: int) -> None:
    runner = web.AppRunner(
        make_app(config), keepalive_timeout=config.keepalive_s, shutdown_timeout=2.0, access_log=None
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = runner.addresses[0][1]
        click.echo(f"sim-server listening on {_url(host, bound_port)}")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


@click.command("sim-server")
@_option("--host", default="127.0.0.1", help="Address to bind.")
@_option("--port", default=30000, type=click.IntRange(0, 65535), help="Port; 0 picks a free one.")
@_option(
    "--context-length",
    default=None,
    type=click.IntRange(8),
    help="SGLang's --context-length: enforced and shown in /server_info (null there when not given).",
)
@_option(
    "--model-context-length",
    default=model.DEFAULT_CONTEXT_LENGTH,
    type=click.IntRange(8),
    help="The model's own context (config.json), used when --context-length is not given.",
)
@_option(
    "--api",
    default="sglang",
    type=click.Choice(["sglang", "vllm", "openai-chat"]),
    help="Which engine's API to speak: SGLang's /generate, vLLM's OpenAI-compatible server, or a "
    "hosted OpenAI-style chat endpoint.",
)
@_option("--vllm-version", default="0.33.0", help="vLLM release to imitate (return_token_ids from 0.10.2).")
@_option(
    "--generation-config",
    default='{"temperature": 0.6, "top_p": 0.95, "top_k": 20}',
    help="vLLM: the model's generation_config, applied to sampling fields a request leaves out.",
)
@_option(
    "--prompt-tokens-details/--no-prompt-tokens-details",
    default=False,
    help="vLLM --enable-prompt-tokens-details: usage carries cached_tokens.",
)
@_option("--reasoning-parser/--no-reasoning-parser", default=False, help="Chat: split a reasoning part off.")
@_option(
    "--reasoning-field",
    default="reasoning",
    type=click.Choice(["reasoning", "reasoning_content"]),
    help="Chat: the message field of the reasoning (vLLM >= 0.16: reasoning; SGLang: reasoning_content).",
)
@_option(
    "--sglang-version",
    default="0.5.23",
    help=f"SGLang release whose API to imitate (known: {', '.join(versions.KNOWN)}).",
)
@_option("--api-key", default=None, help="Require this Bearer key (SGLang --api-key); /health stays open.")
@_option(
    "--deterministic-inference/--no-deterministic-inference",
    default=True,
    help="Honour sampling_seed (SGLang's --enable-deterministic-inference); off: accept and ignore it.",
)
@_option(
    "--skip-tokenizer-init",
    is_flag=True,
    help="SGLang's flag: answers carry output_ids, no text; text prompts, stop, min_new_tokens refused.",
)
@_option(
    "--req-running-timeout",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="SGLANG_REQ_RUNNING_TIMEOUT: a request running longer gets 503 (realistic latency only).",
)
@_option(
    "--max-new-tokens-limit",
    default=None,
    type=click.IntRange(1),
    help="SGLANG_MAX_NEW_TOKENS_LIMIT: max_new_tokens lowered silently (finish_reason.length says so).",
)
@_option("--startup-s", default=0.0, type=click.FloatRange(0.0), help="/health answers 503 this long.")
@_option("--health-timeout", default=20.0, type=click.FloatRange(0.0), help="SGLANG_HEALTH_CHECK_TIMEOUT.")
@_option("--min-len", default=model.DEFAULT_MIN_LEN, type=click.IntRange(1), help="Shortest natural output.")
@_option("--max-len", default=model.DEFAULT_MAX_LEN, type=click.IntRange(1), help="Longest natural output.")
@_option(
    "--autoregressive",
    is_flag=True,
    help="Each token a function of every id before it: an output made in pieces equals the one-shot one.",
)
@_option(
    "--think-ids",
    default=None,
    metavar="START,END",
    help="A reasoning model: the ids of the prompts' tokenizer's think markers (Kimi-K2.5: 163606,163607); "
    "a prompt that leaves <think> open gets an answer that closes it partway.",
)
@_option(
    "--served-model-name",
    default=model.MODEL_PATH,
    help="The model id the server reports (SGLang's and vLLM's flag): two servers of two models.",
)
@_option("--latency", default="zero", type=click.Choice(["zero", "realistic"]), help="Latency model.")
@_option("--decode-step-ms", default=20.0, type=click.FloatRange(0.0), help="One decode step, batch of 1.")
@_option(
    "--batch-knee",
    default=64.0,
    type=click.FloatRange(min=0.0, min_open=True),
    help="Batch size that doubles a step.",
)
@_option(
    "--prefill-per-token-us", default=50.0, type=click.FloatRange(0.0), help="Prefill cost per prompt token."
)
@_option(
    "--tokens-per-tick",
    default=8,
    type=click.IntRange(1),
    help="Decode steps the scheduler may take at once.",
)
@_option(
    "--max-running-requests", default=256, type=click.IntRange(1), help="Batch slots; more requests queue."
)
@_option("--max-queued-requests", default=None, type=click.IntRange(0), help="Queue bound: 503 when full.")
@_option(
    "--kv-tokens",
    default=None,
    type=click.IntRange(1),
    help="KV-cache capacity in tokens (realistic latency): past it, running requests are retracted.",
)
@_option("--enable-metrics/--no-enable-metrics", default=False, help="SGLang: serve /metrics (Prometheus).")
@_option("--fail-500", default=0.0, type=RATE, help="Rate of HTTP 500 answers.")
@_option("--fail-503", default=0.0, type=RATE, help="Rate of HTTP 503 'The request queue is full.'.")
@_option("--fail-429", default=0.0, type=RATE, help="Rate of HTTP 429 with Retry-After: 1.")
@_option("--fail-reset", default=0.0, type=RATE, help="Rate of connections reset after generating.")
@_option("--fail-hang", default=0.0, type=RATE, help="Rate of requests never answered.")
@_option("--fail-abort", default=0.0, type=RATE, help="Rate of HTTP 200 answers with finish_reason abort.")
@_option("--fail-truncate", default=0.0, type=RATE, help="Rate of bodies cut off halfway.")
@_option("--fail-nan", default=0.0, type=RATE, help="Rate of finish_reason matched 'NaN happened'.")
@_option("--fail-duplicate", default=0.0, type=RATE, help="Rate of 400 'Duplicate request ID detected'.")
@_option(
    "--fail-wild-logprobs",
    default=0.0,
    type=RATE,
    help="Rate of answers whose logprobs hold a null, a -1e6 and a 1e6 (when asked for logprobs).",
)
@_option(
    "--fail-no-text",
    default=0.0,
    type=RATE,
    help="Rate of SGLang answers without text while /server_info says the server runs its tokenizer.",
)
@_option("--seed", default=0, type=int, help="Seed of the fault RNG.")
def sim_server(
    host: str,
    port: int,
    context_length: int | None,
    model_context_length: int,
    api: str,
    vllm_version: str,
    generation_config: str,
    prompt_tokens_details: bool,
    reasoning_parser: bool,
    reasoning_field: str,
    sglang_version: str,
    api_key: str | None,
    deterministic_inference: bool,
    skip_tokenizer_init: bool,
    req_running_timeout: float | None,
    max_new_tokens_limit: int | None,
    startup_s: float,
    health_timeout: float,
    min_len: int,
    max_len: int,
    autoregressive: bool,
    think_ids: str | None,
    served_model_name: str,
    latency: str,
    decode_step_ms: float,
    batch_knee: float,
    prefill_per_token_us: float,
    tokens_per_tick: int,
    max_running_requests: int,
    max_queued_requests: int | None,
    kv_tokens: int | None,
    enable_metrics: bool,
    fail_500: float,
    fail_503: float,
    fail_429: float,
    fail_reset: float,
    fail_hang: float,
    fail_abort: float,
    fail_truncate: float,
    fail_nan: float,
    fail_duplicate: float,
    fail_wild_logprobs: float,
    fail_no_text: float,
    seed: int,
) -> None:
    """Run a simulator of an inference server's HTTP API (no GPU needed): SGLang's /generate, vLLM's
    OpenAI-compatible server, or a hosted chat endpoint, with a latency model and faults."""
    model.MODEL_PATH = served_model_name  # one server per process: what every endpoint reports
    try:
        faults = FaultRates(
            error_500=fail_500,
            error_503=fail_503,
            error_429=fail_429,
            reset=fail_reset,
            hang=fail_hang,
            abort=fail_abort,
            truncate=fail_truncate,
            nan=fail_nan,
            duplicate=fail_duplicate,
            wild_logprobs=fail_wild_logprobs,
            no_text=fail_no_text,
        )
        versions.parse(sglang_version)
        versions.parse(vllm_version)
        defaults = json.loads(generation_config)
        if not isinstance(defaults, dict):
            raise ValueError("--generation-config must be a JSON object")
        config = SimConfig(
            context_length=context_length,
            model_context_length=model_context_length,
            api=api,
            vllm_version=vllm_version,
            generation_config=defaults,
            prompt_tokens_details=prompt_tokens_details,
            reasoning_parser=reasoning_parser,
            reasoning_field=reasoning_field,
            version=sglang_version,
            api_key=api_key,
            deterministic=deterministic_inference,
            skip_tokenizer_init=skip_tokenizer_init,
            req_running_timeout_s=req_running_timeout,
            max_new_tokens_limit=max_new_tokens_limit,
            startup_s=startup_s,
            health_timeout_s=health_timeout,
            min_len=min_len,
            max_len=max_len,
            autoregressive=autoregressive,
            thinking=_thinking(think_ids),
            latency=latency,
            decode_step_s=decode_step_ms / 1000.0,
            batch_knee=batch_knee,
            prefill_per_token_s=prefill_per_token_us / 1e6,
            tokens_per_tick=tokens_per_tick,
            max_running_requests=max_running_requests,
            max_queued_requests=max_queued_requests,
            kv_tokens=kv_tokens,
            enable_metrics=enable_metrics,
            faults=faults,
            seed=seed,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    asyncio.run(_serve(config, host, port))
