"""JSON in and out over aiohttp, for every simulated API."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web


def json_response(
    payload: object, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    """orjson-encoded JSON response (SGLang uses ORJSONResponse)."""
    return web.Response(
        body=orjson.dumps(payload), status=status, headers=headers, content_type="application/json"
    )


async def json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read() or b"{}")
    except orjson.JSONDecodeError as exc:
        raise web.HTTPBadRequest(text=f"JSON decode error: {exc}") from exc
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="expected a JSON object")
    return body
