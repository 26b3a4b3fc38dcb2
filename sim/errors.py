"""SGLang's error bodies, so clients parse the simulator's errors exactly as the real server's.

SGLang's /generate answers a ValueError (bad ids, context overflow, duplicate rid, bad sampling
values) with 400 {"error": {"message": ...}}; a FastAPI HTTPException (e.g. 503 "The request queue
is full.") with {"object": "error", "message", "type": "<status>", "param": null, "code"}; and a
request that fails schema validation with the same shape and type "Bad Request".
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from genq.sim.http import json_response


def value_error(message: str) -> web.Response:
    """400 as SGLang's /generate returns for a ValueError raised while admitting a request."""
    return json_response({"error": {"message": message}}, status=400)


def http_error(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    """An HTTPException as SGLang's exception handler renders it."""
    body = {"object": "error", "message": message, "type": str(status), "param": None, "code": status}
    return json_response(body, status=status, headers=headers)


def validation_error(message: str) -> web.Response:
    """400 as SGLang renders a request that fails schema validation."""
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return json_response(body, status=400)


def schema_error(message: str) -> web.Response:
    """400 as SGLang 0.5.22+'s schema gate answers (entrypoints/api_contract.py): a plain string."""
    return json_response({"error": message}, status=400)


def internal_error(message: str = "Internal Server Error") -> web.Response:
    """Starlette's plain-text 500 for an exception nobody caught (e.g. SamplingParams' TypeError)."""
    return web.Response(status=500, text=message, content_type="text/plain")
