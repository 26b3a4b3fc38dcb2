"""A small client for SGLang's native API over aiohttp (decision 3: its CPU cost per request
stays flat at hundreds in flight, where httpx's own pool does not).

Every failure comes out as an :class:`~worker.errors.AttemptError` with its class, so the
caller decides about retries in one place.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from worker.errors import AttemptError, from_status

# SGLang's server closes idle keep-alive connections after 5 s; close ours sooner so a pooled
# connection is never reused just as the server drops it.
KEEPALIVE_S = 4.0


class SGLangClient:
    def __init__(self, base_url: str, max_connections: int):
        self.base_url = base_url.rstrip("/")
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SGLangClient:
        connector = aiohttp.TCPConnector(
            limit=self._max_connections, keepalive_timeout=KEEPALIVE_S, force_close=False
        )
        # No pool or read timeout here: the caller bounds each attempt (decision 8).
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=15),
            json_serialize=lambda o: orjson.dumps(o).decode(),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "use SGLangClient as an async context manager"
        return self._session

    async def generate(self, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """POST /generate; return the parsed, checked response or raise AttemptError."""
        try:
            async with asyncio.timeout(timeout):
                async with self.session.post(
                    f"{self.base_url}/generate",
                    data=orjson.dumps(body),
                    headers={"Content-Type": "application/json"},
                ) as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        raise from_status(resp.status, _error_message(raw), _retry_after(resp.headers))
        except TimeoutError as exc:
            raise AttemptError("timeout", f"no response within {timeout:.0f} s") from exc
        except aiohttp.ClientConnectorError as exc:
            raise AttemptError("connection", str(exc), unavailable=True) from exc
        except aiohttp.ClientPayloadError as exc:
            raise AttemptError("bad_response", f"truncated body: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise AttemptError("connection", f"{type(exc).__name__}: {exc}") from exc
        return check_response(raw)

    async def abort(self, rid: str) -> None:
        """Ask the server to stop working on ``rid`` (best effort: the GPU time is what matters)."""
        try:
            async with asyncio.timeout(10):
                async with self.session.post(f"{self.base_url}/abort_request", json={"rid": rid}) as resp:
                    await resp.read()
        except (TimeoutError, aiohttp.ClientError):
            pass

    async def healthy(self) -> bool:
        try:
            async with asyncio.timeout(10):
                async with self.session.get(f"{self.base_url}/health") as resp:
                    await resp.read()
                    return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False


def check_response(raw: bytes) -> dict[str, Any]:
    """The parsed body of a 200, or AttemptError if it is not a finished generation."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise AttemptError("bad_response", f"body is not JSON ({len(raw)} bytes): {exc}") from exc
    meta = data.get("meta_info") if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        raise AttemptError("bad_response", "response has no meta_info")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind == "abort":
        raise AttemptError("aborted", str(finish.get("message") or "request aborted by the server"), 200)
    if kind not in ("stop", "length"):
        raise AttemptError("bad_response", f"unexpected finish_reason {finish!r}")
    if not isinstance(data.get("output_ids"), list):
        raise AttemptError("bad_response", "response has no output_ids")
    for name in ("prompt_tokens", "completion_tokens"):
        if not isinstance(meta.get(name), int):
            raise AttemptError("bad_response", f"meta_info.{name} missing or not an integer")
    return data


def _error_message(raw: bytes) -> str:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw[:2000].decode("utf-8", "replace") or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in data:
            return str(data["message"])
        if isinstance(err, str):
            return err
    return raw[:2000].decode("utf-8", "replace")


def _retry_after(headers: Any) -> float | None:
    value = headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
