"""``/metrics`` for Prometheus, served by a long-running process when asked (``--metrics-port``).

Each role defines its own metrics (worker/metrics.py, collector/metrics.py); this is the shared
switch. Off unless a port is given; bound to 127.0.0.1 unless ``--metrics-bind`` says otherwise,
since the numbers name datasets and hosts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import click
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

from genq.settings import option

log = logging.getLogger("genq.metrics")


def metrics_options(func: Callable) -> Callable:
    func = option(
        "--metrics-bind",
        default="127.0.0.1",
        help="Address /metrics listens on (0.0.0.0 for a Prometheus on another host).",
    )(func)
    return option(
        "--metrics-port",
        type=click.IntRange(min=0, max=65535),
        default=0,
        help="Serve Prometheus /metrics on this port (0: off). One port per process.",
    )(func)


def serve(port: int, bind: str, registry: CollectorRegistry) -> None:
    """Start the /metrics server thread for ``registry`` (plus process CPU and memory). A port already
    taken costs the metrics, never the job."""
    if not port:
        return
    ProcessCollector(registry=registry)
    try:
        start_http_server(port, addr=bind, registry=registry)
    except OSError as exc:
        log.error("metrics: cannot listen on %s:%d (%s); running without /metrics", bind, port, exc)
        return
    log.info("metrics: serving http://%s:%d/metrics", bind, port)


def safely(fn: Callable[[], float]) -> Callable[[], float]:
    """A gauge callback that reads Redis at scrape time: NaN while Redis is unreachable, not 0."""

    def read() -> float:
        try:
            return float(fn())
        except Exception:  # noqa: BLE001 - a scrape must answer; NaN says "unknown"
            return float("nan")

    return read
