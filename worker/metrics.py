"""Prometheus metrics of one worker process (served with ``--metrics-port``)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from genq.backends.base import AttemptError, Cost

# Its own registry: a process serves only its role's metrics (both roles' modules get imported).
REGISTRY = CollectorRegistry()
REQUESTS = Counter(
    "genq_worker_requests",
    "/generate attempts by outcome (ok, error) and error class",
    ["outcome", "error"],
    registry=REGISTRY,
)
RETRIES = Counter(
    "genq_worker_retries",
    "Failed attempts that will be retried, by error class",
    ["error"],
    registry=REGISTRY,
)
JOBS = Counter(
    "genq_worker_jobs",
    "Jobs finished by this worker, by outcome (done, failed)",
    ["dataset", "outcome"],
    registry=REGISTRY,
)
TOKENS = Counter(
    "genq_worker_tokens",
    "Tokens of this worker's records (prompt, completion)",
    ["dataset", "kind"],
    registry=REGISTRY,
)
LATENCY = Histogram(
    "genq_worker_request_seconds",
    "Duration of one /generate attempt",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, float("inf")),
    registry=REGISTRY,
)
IN_FLIGHT = Gauge(
    "genq_worker_in_flight", "Jobs this worker holds (running or waiting to retry)", registry=REGISTRY
)
RETRYING = Gauge("genq_worker_retrying", "Jobs waiting between attempts", registry=REGISTRY)
SERVER_UP = Gauge(
    "genq_worker_server_up", "1 while jobs go to the server, 0 while it is probed as down", registry=REGISTRY
)


def watch(in_flight: Callable[[], int], retrying: Callable[[], int], server_up: Callable[[], bool]) -> None:
    """Gauges read from the live worker at scrape time."""
    IN_FLIGHT.set_function(in_flight)
    RETRYING.set_function(retrying)
    SERVER_UP.set_function(lambda: float(server_up()))


def attempt(seconds: float, error: AttemptError | None) -> None:
    LATENCY.observe(seconds)
    if error is None:
        REQUESTS.labels("ok", "").inc()
        return
    REQUESTS.labels("error", error.kind).inc()
    if error.cost is not Cost.FATAL:
        RETRIES.labels(error.kind).inc()


def finished(dataset: str, record: dict | None) -> None:
    """A job handed to the collector: its record, or None for a terminal failure."""
    if record is None:
        JOBS.labels(dataset, "failed").inc()
        return
    JOBS.labels(dataset, "done").inc()
    TOKENS.labels(dataset, "prompt").inc(record["prompt_tokens"])
    TOKENS.labels(dataset, "completion").inc(record["completion_tokens"])
