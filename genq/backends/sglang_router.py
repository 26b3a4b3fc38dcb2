"""SGLang's router in front of SGLang replicas: how genq finds it and reaches the replicas.

The router is PyPI's ``sglang-router`` (0.3.x, also called sgl-model-gateway), a Rust binary;
data-parallel SGLang deployments put it in front of their replicas, and users often have only its
address. What it answers, seen running 0.3.2 in front of two servers (tests/test_sglang_router.py
runs it), and from its documentation (the smg repository's docs/concepts/reliability/retries.md):

- ``/server_info`` and ``/model_info`` are 404. ``/get_server_info`` is the router's own
  ``{"router_manager": true, "routers_count": n, "workers_count": n}``. ``/get_model_info``,
  ``/v1/models`` and ``/generate`` are forwarded to a replica, the body and its ``rid`` kept.
- ``/workers`` lists the replicas: ``{"workers": [{"url": ..., "is_healthy": ...}, ...]}``.
- ``/abort_request`` is 404: an abort must go to the replicas themselves.
- ``/health`` answers 200 while the router runs, whatever its replicas do; ``/readiness`` counts
  the replicas its own health checks (every 60 s by default) last found healthy.
- It sends a request again, to another replica, on 408, 429, 500, 502, 503 and 504 (5 times by
  default; ``--disable-retries`` turns that off). A replica that cannot be reached becomes, once
  those are spent, 500 ``{"error": {"code": "call_upstream_request_error", ...}}``.

So genq drives it as SGLang (:class:`genq.backends.sglang.SGLang`): the facts the probe needs come
from a replica, aborts go to every replica (a rid is unique and never a prefix of another, so an
abort meant for one replica touches nothing on the others), and health is asked of the replicas.
"""

from __future__ import annotations

from typing import Any

import orjson

from genq.backends.base import AttemptError, Http

ROUTER_FIELD = "router_manager"
UNREACHABLE = "call_upstream_request_error"  # the router's error code: no replica took the request
RETRIES_NOTE = (
    "the router's own retries (on by default) resend a request a replica failed to another one: "
    "they hide a dead replica from genq, and the work they repeat is not counted against "
    "--max-attempts"
)


def is_router(info: Any) -> bool:
    """``/get_server_info`` answered by SGLang's router rather than by an SGLang server."""
    return isinstance(info, dict) and info.get(ROUTER_FIELD) is True


def unreachable(raw: bytes) -> bool:
    """The router's error body when none of the replicas it tried took the request."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("code") == UNREACHABLE


async def replica_urls(http: Http) -> list[str]:
    """The replicas the router lists (``/workers``); only http(s) URLs are taken."""
    try:
        status, body = await http.get_json("/workers")
    except AttemptError:
        return []
    workers = body.get("workers") if status == 200 and isinstance(body, dict) else None
    urls = []
    for worker in workers if isinstance(workers, list) else []:
        url = worker.get("url") if isinstance(worker, dict) else None
        if isinstance(url, str) and url.startswith(("http://", "https://")):
            urls.append(url.rstrip("/"))
    return urls


async def ready_replicas(http: Http) -> int:
    """How many replicas the router's own health checks last found healthy (``/readiness``)."""
    try:
        status, body = await http.get_json("/readiness")
    except AttemptError:
        return 0
    count = body.get("healthy_workers") if status == 200 and isinstance(body, dict) else None
    return count if isinstance(count, int) else 0
