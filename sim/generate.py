"""POST /generate: validation, the toy model, the latency model, and the injected faults.

Faults that refuse a request (500, 503, 429, abort, hang) happen before any work; reset and
truncate happen after the generation, so the work is done and lost, as when a connection dies
while the answer is on its way.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from sim import model
from sim.errors import http_error, json_response
from sim.request import GenerateRequest, RequestError, check_rid, parse_body, parse_generate
from sim.scheduler import QueueFull
from sim.state import SIM_STATE, Flight, SimState

_REFUSALS: dict[str, tuple[int, str, dict[str, str] | None]] = {
    "error_500": (500, "Internal server error (injected)", None),
    "error_503": (503, "The request queue is full.", None),
    "error_429": (429, "Too many requests (injected)", {"Retry-After": "1"}),
}


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _reset_connection(request: web.Request) -> None:
    """Close with an RST (SO_LINGER 0), so the client sees 'connection reset by peer'."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def _send_truncated(request: web.Request, payload: bytes) -> web.StreamResponse:
    """Headers promise the whole body; half of it is sent before the connection closes."""
    response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
    response.content_length = len(payload)
    with contextlib.suppress(ConnectionError):
        await response.prepare(request)
        await response.write(payload[: len(payload) // 2])
    if request.transport is not None:
        request.transport.close()
    return response


class _Answer:
    """Builds SGLang's response body for one request."""

    def __init__(self, rid: str, req: GenerateRequest, cached_tokens: int, started: float) -> None:
        self.rid, self.req, self.cached_tokens, self.started = rid, req, cached_tokens, started

    def body(self, output_ids: list[int], text: str, finish_reason: dict[str, Any]) -> dict[str, Any]:
        return {
            "text": text,
            "output_ids": output_ids,
            "meta_info": {
                "id": self.rid,
                "finish_reason": finish_reason,
                "prompt_tokens": len(self.req.input_ids),
                "weight_version": "default",
                "completion_tokens": len(output_ids),
                "cached_tokens": self.cached_tokens,
                "e2e_latency": time.monotonic() - self.started,
            },
        }

    def aborted(self, output_ids: list[int], message: str) -> web.Response:
        skip = bool(self.req.sampling_params.get("skip_special_tokens", True))
        text = model.detokenize(output_ids, skip)
        return json_response(self.body(output_ids, text, {"type": "abort", "message": message}))


async def handle_generate(request: web.Request) -> web.StreamResponse:
    """Admit a request like SGLang's tokenizer manager, then serve it."""
    state = request.app[SIM_STATE]
    started = time.monotonic()
    state.stats.requests += 1
    if not state.healthy:
        state.stats.unhealthy += 1
        return http_error(503, "The server is not healthy (simulated).")
    try:
        body = parse_body(await request.read())
        rid = check_rid(body)
        if rid is not None and rid in state.in_flight:
            raise RequestError(f"Duplicate request ID detected: {rid}")
        req = parse_generate(body, context_length=state.config.context_length)
    except RequestError as exc:
        state.stats.rejected += 1
        return exc.response()
    rid = req.rid if req.rid is not None else uuid.uuid4().hex
    flight = Flight(rid)
    state.in_flight[rid] = flight
    state.stats.enter()
    try:
        return await _serve(request, state, req, flight, started)
    finally:
        state.in_flight.pop(rid, None)
        state.stats.leave()


async def _serve(
    request: web.Request, state: SimState, req: GenerateRequest, flight: Flight, started: float
) -> web.StreamResponse:
    fault = state.faults.pick()
    if fault is not None:
        state.stats.faults[fault] += 1
    if fault in _REFUSALS:
        status, message, headers = _REFUSALS[fault]
        return http_error(status, message, headers)
    answer = _Answer(flight.rid, req, state.cache.lookup(req.input_ids), started)
    if fault == "abort":
        state.stats.aborted += 1
        return answer.aborted([], "Abort (injected)")
    if fault == "hang":
        return await _hang(request, state, flight, answer)

    gen = model.generate(
        req.input_ids, req.sampling_params, min_len=state.config.min_len, max_len=state.config.max_len
    )
    done = gen.completion_tokens
    if state.scheduler is not None:
        try:
            seq = state.scheduler.submit(len(req.input_ids) - answer.cached_tokens, gen.completion_tokens)
        except QueueFull:
            state.stats.queue_full += 1
            return http_error(503, "The request queue is full.")
        flight.seq = seq
        while not seq.finished:
            await asyncio.wait({seq.future}, timeout=state.config.disconnect_check_s)
            if not seq.finished and _client_gone(request):
                state.scheduler.abort(seq, "Client disconnected.")
        done = seq.done
        state.stats.tokens_generated += done
        if seq.abort_message is not None:
            if _client_gone(request):
                state.stats.disconnected += 1
                return web.Response(status=499)
            state.stats.aborted += 1
            return answer.aborted(gen.output_ids[:done], seq.abort_message)
    else:
        state.stats.tokens_generated += done
    state.stats.generations += 1

    payload = orjson.dumps(answer.body(gen.output_ids, gen.text, gen.finish_reason))
    if fault == "reset":
        _reset_connection(request)
        return web.Response(status=500)  # never sent: the connection is gone
    if fault == "truncate":
        return await _send_truncated(request, payload)
    if _client_gone(request):
        state.stats.disconnected += 1
        return web.Response(status=499)
    state.stats.completed += 1
    state.stats.tokens_delivered += gen.completion_tokens
    return web.Response(body=payload, content_type="application/json")


async def _hang(request: web.Request, state: SimState, flight: Flight, answer: _Answer) -> web.StreamResponse:
    """Never answer; /abort_request ends it with an abort, a gone client or shutdown ends it silently."""
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(flight.wake.wait(), state.config.disconnect_check_s)
        if flight.closing:
            if request.transport is not None:
                request.transport.close()
            return web.Response(status=503)
        if flight.abort_message is not None:
            state.stats.aborted += 1
            return answer.aborted([], flight.abort_message)
        if _client_gone(request):
            state.stats.disconnected += 1
            return web.Response(status=499)
