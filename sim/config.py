"""The simulator's settings, shared by make_app and the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from genq.sim import model
from genq.sim.faults import FaultRates
from genq.sim.scheduler import LatencyParams


@dataclass
class SimConfig:
    """Everything that shapes the simulated server; defaults suit tests (instant, no faults)."""

    # SGLang's --context-length: None (the default) reports null in /server_info and uses the
    # model's own context, model_context_length.
    context_length: int | None = None
    model_context_length: int = model.DEFAULT_CONTEXT_LENGTH
    min_len: int = model.DEFAULT_MIN_LEN  # natural output length range of the toy model (EOS included)
    max_len: int = model.DEFAULT_MAX_LEN
    autoregressive: bool = False  # each token a function of every id before it (sim/model.py)
    thinking: model.Thinking | None = None  # a reasoning model's think markers (sim/model.py)
    latency: str = "zero"  # "zero": answer at once; "realistic": continuous-batching model
    decode_step_s: float = 0.020
    batch_knee: float = 64.0
    prefill_per_token_s: float = 50e-6
    tokens_per_tick: int = 8
    max_running_requests: int = 256
    max_queued_requests: int | None = None  # as SGLang: unbounded unless set, then 503 when full
    # KV-cache capacity in tokens (realistic latency): over-admission, then retraction/preemption.
    # None: context * max_running_requests, which never binds.
    kv_tokens: int | None = None
    enable_metrics: bool = False  # SGLang --enable-metrics: /metrics (vLLM always serves it)
    faults: FaultRates = field(default_factory=FaultRates)
    seed: int | None = 0  # fault RNG seed
    healthy: bool = True
    keepalive_s: float = 5.0  # SGLang's uvicorn keep-alive: idle pooled connections die after 5 s
    disconnect_check_s: float = 4.0  # like SGLang, a gone client is noticed only every few seconds
    prefix_cache_entries: int = 10000  # prompts remembered for cached_tokens; 0 turns it off
    api: str = "sglang"  # sglang | vllm | openai-chat (sim/server.py APIS)
    version: str = "0.5.23"  # the SGLang release whose API quirks to show (sim/versions.py)
    vllm_version: str = "0.33.0"  # the vLLM release: return_token_ids from 0.10.2, nested errors 0.10.1
    # vLLM fills omitted sampling fields from the model's generation_config.json; this one is
    # Qwen3's. Clients that leave a field out get these, not OpenAI's defaults.
    generation_config: dict[str, Any] = field(
        default_factory=lambda: {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    )
    prompt_tokens_details: bool = False  # vLLM --enable-prompt-tokens-details: usage.cached_tokens
    reasoning_parser: bool = False  # chat: split a reasoning part off the answer
    reasoning_field: str = "reasoning"  # vLLM >= 0.16: "reasoning"; SGLang, vLLM <= 0.11: "reasoning_content"
    api_key: str | None = None  # --api-key: /generate and the info routes answer 401 without it
    # --enable-deterministic-inference: sampling_seed changes the output. On by default here (the
    # toy model is deterministic anyway); off, seeds are accepted and ignored as in SGLang's default.
    deterministic: bool = True
    req_running_timeout_s: float | None = None  # SGLANG_REQ_RUNNING_TIMEOUT: 503 past it
    max_new_tokens_limit: int | None = None  # SGLANG_MAX_NEW_TOKENS_LIMIT: silent cap, length says
    # SGLang's --skip-tokenizer-init: answers carry ids and no text; text prompts, stop strings and
    # min_new_tokens are refused; /server_info says so.
    skip_tokenizer_init: bool = False
    startup_s: float = 0.0  # /health answers 503 "starting" this long; generations wait for it
    health_timeout_s: float = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT: /health's generation gives up

    def __post_init__(self) -> None:
        if self.api not in ("sglang", "vllm", "openai-chat"):
            raise ValueError(f"api must be sglang, vllm or openai-chat, got {self.api!r}")
        if self.reasoning_field not in ("reasoning", "reasoning_content"):
            raise ValueError(
                f"reasoning_field must be reasoning or reasoning_content, got {self.reasoning_field!r}"
            )
        if self.latency not in ("zero", "realistic"):
            raise ValueError(f"latency must be 'zero' or 'realistic', got {self.latency!r}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if min(self.context_length or 8, self.model_context_length) < 8:
            raise ValueError("context lengths must be at least 8")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError("kv_tokens must be positive")
        if self.batch_knee <= 0 or self.tokens_per_tick < 1 or self.max_running_requests < 1:
            raise ValueError("batch_knee, tokens_per_tick and max_running_requests must be positive")

    @property
    def context(self) -> int:
        """The context the server enforces: --context-length if given, else the model's."""
        return self.context_length or self.model_context_length

    @property
    def max_req_input_len(self) -> int:
        """SGLang: min(context - 1, KV capacity - 1) - 5; the KV pool is never the limit here."""
        return self.context - 6

    @property
    def max_total_num_tokens(self) -> int:
        """SGLang's KV pool size in tokens (/server_info, /v1/loads)."""
        return self.kv_tokens or self.context * self.max_running_requests

    def latency_params(self) -> LatencyParams:
        return LatencyParams(
            decode_step_s=self.decode_step_s,
            batch_knee=self.batch_knee,
            prefill_per_token_s=self.prefill_per_token_s,
            tokens_per_tick=self.tokens_per_tick,
            max_running=self.max_running_requests,
            max_queued=self.max_queued_requests,
            running_timeout_s=self.req_running_timeout_s,
            kv_tokens=self.kv_tokens,
        )
