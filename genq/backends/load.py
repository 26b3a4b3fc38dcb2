"""The server's own load, as one small dataclass, and the two formats engines publish it in.

Each backend's ``load()`` reads its engine's endpoint (SGLang /v1/loads or /metrics, vLLM /metrics,
llama.cpp /slots or /metrics; the table is docs/engines.md) and answers a :class:`Load`, None
fields where the engine does not say; ``None`` instead of a Load where it says nothing at all.
``--concurrency auto`` (worker/concurrency.py) steers by it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# Short: a load reading that takes longer is stale anyway; the next one comes a second later.
LOAD_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Load:
    """One reading of a server's load; None where the engine does not publish it."""

    source: str  # the endpoint read, e.g. "/v1/loads"
    running: int | None = None  # requests in the running batch
    waiting: int | None = None  # requests queued for admission
    kv_usage: float | None = None  # KV cache in use, 0..1
    preempted: int | None = None  # retractions (SGLang) / preemptions (vLLM) since the server started
    max_running: int | None = None  # the batch's slot count (SGLang max_running_requests, llama.cpp slots)
    kv_tokens: int | None = None  # KV cache capacity in tokens


# One sample line of the Prometheus text format: name{labels} value [timestamp]
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def prometheus(text: str, names: Iterable[str]) -> dict[str, float]:
    """Each wanted metric summed over its samples (DP ranks, engines), per-priority breakdowns
    skipped: SGLang writes the total under the default labels and one sample per priority too
    (``observability/metrics_collector.py`` _log_gauge_queue_count)."""
    wanted, found = set(names), {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) not in wanted:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        if labels.get("priority"):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            found[match.group(1)] = found.get(match.group(1), 0.0) + value
    return found


def info_labels(text: str, name: str) -> list[dict[str, str]]:
    """The labels of each sample of an info metric (its value is 1, its facts are its labels), e.g.
    vLLM's ``vllm:cache_config_info``: one dict per engine."""
    found = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is not None and match.group(1) == name:
            found.append(dict(_LABEL.findall(match.group(2) or "")))
    return found


def count(value: Any) -> int | None:
    """An integer count from JSON or a Prometheus float; None if absent or not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return int(value)


def fraction(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return min(1.0, max(0.0, float(value)))


def total(values: Iterable[int | None]) -> int | None:
    """Sum of the known values; None if none is known."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def summed(loads: list[Load]) -> Load | None:
    """Several batches as one (DP ranks, replicas behind a router): counts and capacities added,
    the fullest KV cache's usage (the first to retract); None when there is none."""
    if not loads:
        return None
    usages = [load.kv_usage for load in loads if load.kv_usage is not None]
    return Load(
        source="+".join(dict.fromkeys(load.source for load in loads)),
        running=total(load.running for load in loads),
        waiting=total(load.waiting for load in loads),
        kv_usage=max(usages) if usages else None,
        preempted=total(load.preempted for load in loads),
        max_running=total(load.max_running for load in loads),
        kv_tokens=total(load.kv_tokens for load in loads),
    )
