"""Prometheus metrics of the collector (served with ``--metrics-port``)."""

from __future__ import annotations

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from genq.keys import Keys
from genq.metrics import safely
from genq.progress import stream_lag
from genq.token_counts import countable

# Its own registry: a process serves only its role's metrics (both roles' modules get imported).
REGISTRY = CollectorRegistry()
WRITTEN = Counter(
    "genq_collector_written",
    "Lines written to disk, by kind (record, error)",
    ["dataset", "kind"],
    registry=REGISTRY,
)
TOKENS = Counter(
    "genq_collector_tokens",
    "Tokens of the records written (prompt, completion)",
    ["dataset", "kind"],
    registry=REGISTRY,
)
DUPLICATES = Counter(
    "genq_collector_duplicates", "Replayed results dropped because their id is on disk", registry=REGISTRY
)
WRITE_SECONDS = Histogram(
    "genq_collector_write_seconds",
    "One batch: append, fsync, acknowledge",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, float("inf")),
    registry=REGISTRY,
)
STREAM_LENGTH = Gauge("genq_stream_length", "Results in the stream, not yet on disk", registry=REGISTRY)
STREAM_OLDEST = Gauge(
    "genq_stream_oldest_pending_seconds", "Age of the oldest result not yet on disk", registry=REGISTRY
)


def watch(conn: redis.Redis, keys: Keys) -> None:
    """Stream lag read from Redis at scrape time (NaN while Redis is unreachable)."""
    STREAM_LENGTH.set_function(safely(lambda: stream_lag(conn, keys)["length"]))
    STREAM_OLDEST.set_function(safely(lambda: stream_lag(conn, keys)["oldest_pending_s"]))


def written(
    lines: list[tuple[str, bytes]], records: dict[str, list[dict]], duplicates: int, seconds: float
) -> None:
    """One batch on disk: ``lines`` (dataset, kind) written, ``records`` by dataset."""
    for dataset, kind in lines:
        WRITTEN.labels(dataset, kind.decode()).inc()
    for dataset, items in records.items():
        counted = [r for r in items if countable(r)]
        for name in ("prompt", "completion"):
            TOKENS.labels(dataset, name).inc(sum(r[f"{name}_tokens"] for r in counted))
    DUPLICATES.inc(duplicates)
    WRITE_SECONDS.observe(seconds)
