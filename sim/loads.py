"""The server's load as the engines publish it: SGLang's /v1/loads and /metrics, vLLM's /metrics.

One snapshot of the batch scheduler (:class:`Snapshot`), rendered in each engine's own format so
clients that read load (genq's ``--concurrency auto``) see here what they see on the real server:

- SGLang 0.5.23 ``entrypoints/v1_loads.py`` GET /v1/loads: ``{"timestamp", "version",
  "accelerator", "num_accelerators", "loads": [one dict per DP rank]}``, each rank's dict the
  scalar fields of ``managers/load_snapshot.py`` LoadSnapshot plus the ``queues`` section
  (``retracted`` there counts the last logging interval's retractions, not a total).
- SGLang ``observability/metrics_collector.py`` (only with ``--enable-metrics``):
  ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``,
  ``sglang:max_total_num_tokens``, the counter ``sglang:num_retracted_requests_total``.
- vLLM ``v1/metrics/loggers.py`` (always on): ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a fraction, 1.0 = full) and the
  counter ``vllm:num_preemptions_total``, labelled by model_name and engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from aiohttp import web

from genq.sim import model
from genq.sim.http import json_response
from genq.sim.state import SIM_STATE, SimState

BLOCK = 16  # vLLM's default block size in tokens (CacheConfig.block_size)
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Snapshot:
    running: int
    waiting: int
    kv_used: int
    kv_capacity: int
    max_running: int
    retracted: int  # since start

    @property
    def usage(self) -> float:
        return min(1.0, self.kv_used / self.kv_capacity) if self.kv_capacity else 0.0


def snapshot(state: SimState) -> Snapshot:
    config, scheduler = state.config, state.scheduler
    if scheduler is None:  # zero latency: whatever is in flight runs, nothing waits
        running, waiting, used, retracted = state.stats.in_flight, 0, 0, 0
    else:
        running, waiting = scheduler.running, scheduler.queued
        used, retracted = scheduler.kv_used, scheduler.retracted
    capacity = scheduler.params.kv_tokens if scheduler and scheduler.params.kv_tokens else None
    return Snapshot(
        running,
        waiting,
        used,
        capacity or config.max_total_num_tokens,
        config.max_running_requests,
        retracted,
    )


async def sglang_loads(request: web.Request) -> web.Response:
    state = request.app[SIM_STATE]
    now = snapshot(state)
    load = {
        "timestamp": time.time(),
        "dp_rank": 0,
        "num_running_reqs": now.running,
        "num_waiting_reqs": now.waiting,
        "num_waiting_uncached_tokens": 0,
        "num_used_tokens": now.kv_used,
        "num_total_tokens": now.kv_used,
        "num_active_tokens": now.kv_used,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": now.kv_capacity,
        "max_running_requests": now.max_running,
        "token_usage": round(now.usage, 2),
        "gen_throughput": 0.0,
        "cache_hit_rate": 0.0,
        "utilization": 0.0,
        "total_prefill_uncached_tokens": 0,
        "total_prefill_busy_us": 0,
        "decode_moments": None,
        "queues": {"waiting": now.waiting, "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0},
    }
    return json_response(
        {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": state.config.version,
            "accelerator": None,
            "num_accelerators": 1,
            "loads": [load],
        }
    )


async def sglang_metrics(request: web.Request) -> web.Response:
    now = snapshot(request.app[SIM_STATE])
    labels = {"model_name": model.MODEL_PATH}
    # SGLang's metrics live in prometheus_client's multiprocess mode, which shows a counter only
    # once it has counted: the real 0.5.23 has no line for it until a retraction.
    retracted = [("sglang:num_retracted_requests_total", "counter", labels, now.retracted)]
    return _prometheus(
        [
            ("sglang:num_running_reqs", "gauge", labels, now.running),
            ("sglang:num_queue_reqs", "gauge", labels, now.waiting),
            ("sglang:token_usage", "gauge", labels, round(now.usage, 2)),
            ("sglang:max_total_num_tokens", "gauge", labels, now.kv_capacity),
            *(retracted if now.retracted else []),
        ]
    )


async def vllm_metrics(request: web.Request) -> web.Response:
    now = snapshot(request.app[SIM_STATE])
    labels = {"engine": "0", "model_name": model.MODEL_PATH}
    return _prometheus(
        [
            ("vllm:num_requests_running", "gauge", labels, now.running),
            ("vllm:num_requests_waiting", "gauge", labels, now.waiting),
            ("vllm:kv_cache_usage_perc", "gauge", labels, now.usage),
            ("vllm:num_preemptions_total", "counter", labels, now.retracted),
            # The CacheConfig's fields as labels, value 1 (v1/metrics/loggers.py log_metrics_info).
            (
                "vllm:cache_config_info",
                "gauge",
                {**labels, "block_size": str(BLOCK), "num_gpu_blocks": str(now.kv_capacity // BLOCK)},
                1,
            ),
        ]
    )


def _prometheus(samples: list[tuple[str, str, dict[str, str], float]]) -> web.Response:
    """prometheus_client's text exposition: HELP and TYPE lines, then the sample (floats)."""
    lines = []
    for name, kind, labels, value in samples:
        rendered = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines += [f"# HELP {name} {name}", f"# TYPE {name} {kind}", f"{name}{{{rendered}}} {float(value)}"]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")
