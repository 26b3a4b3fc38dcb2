"""Each backend's load() against the simulator's load endpoints, over real HTTP.

The simulator serves SGLang's /v1/loads (and /metrics with --enable-metrics) and vLLM's /metrics
in the engines' formats (sim/loads.py); the real engines' answers are checked for the same shape
in tests/test_real_sglang.py, test_real_vllm.py and test_real_engine.py (llama.cpp).
"""

from __future__ import annotations

import asyncio

import pytest

from genq.backends import BACKENDS, Http
from genq.backends.load import Load
from tests.helpers import server_load, sim_post, sim_stats, wait_until

pytestmark = pytest.mark.timeout(120)


async def _send(url: str, n: int, max_new: int) -> None:
    """n /generate requests with distinct prompts, all at once (nothing cached)."""
    async with Http(url, max_connections=n) as http:
        bodies = [
            {"input_ids": [i + 1, 2, 3, 4, 5, 6, 7, 8], "sampling_params": {"max_new_tokens": max_new}}
            for i in range(n)
        ]
        await asyncio.gather(*(http.call("POST", "/generate", b, timeout=60) for b in bodies))


def test_sglang_load_reads_v1_loads_and_metrics_counts_retractions(start_sim):
    flags = ("--latency", "realistic", "--max-running-requests", "4", "--min-len", "40", "--max-len", "40")
    url = start_sim(*flags, "--decode-step-ms", "5", "--kv-tokens", "150", "--enable-metrics")
    idle = server_load(url, "sglang")
    assert idle == Load(
        source="/v1/loads+/metrics",
        running=0,
        waiting=0,
        kv_usage=0.0,
        preempted=0,
        max_running=4,
        kv_tokens=150,
    )
    asyncio.run(_send(url, 12, 40))
    stats = sim_stats(url)
    assert stats["retracted"] > 0, "150 KV tokens cannot hold 4 sequences of 8 + 40 tokens"
    assert server_load(url, "sglang").preempted == stats["retracted"]


def test_sglang_load_sees_running_and_waiting(start_sim):
    url = start_sim("--latency", "realistic", "--max-running-requests", "2", "--decode-step-ms", "50")

    async def busy_then_read() -> Load | None:
        sending = asyncio.ensure_future(_send(url, 6, 200))
        await asyncio.to_thread(wait_until, lambda: sim_stats(url)["queued"] == 4, 30, "4 queued")
        async with Http(url) as http:
            load = await BACKENDS["sglang"](http).load()
        sending.cancel()
        return load

    load = asyncio.run(busy_then_read())
    assert load is not None and load.source == "/v1/loads", "no /metrics without --enable-metrics"
    assert (load.running, load.waiting, load.max_running, load.preempted) == (2, 4, 2, None)


def test_vllm_load_reads_metrics(start_sim):
    url = start_sim("--api", "vllm", "--latency", "realistic", "--kv-tokens", "1000")
    assert server_load(url, "vllm") == Load(
        source="/metrics", running=0, waiting=0, kv_usage=0.0, preempted=0, kv_tokens=1000 // 16 * 16
    )  # vllm:cache_config_info: whole blocks of 16 tokens


def test_hosted_chat_api_has_no_load(start_sim):
    assert server_load(start_sim("--api", "openai-chat"), "openai-chat") is None


def test_kv_capacity_changes_at_runtime(start_sim):
    url = start_sim("--latency", "realistic", "--kv-tokens", "1000")
    assert sim_post(url, "/sim/kv-tokens", {"kv_tokens": 500}) == {"kv_tokens": 500}
    assert server_load(url, "sglang").kv_tokens == 500
