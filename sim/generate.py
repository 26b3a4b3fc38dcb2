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
from sim.errors import http_error, json_response, value_error
from sim.request import GenerateRequest, RequestError, check_rid, parse_body, parse_generate
from sim.scheduler import QueueFull
from sim.state import SIM_STATE, Flight, SimState
from sim.versions import Quirks

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
    """Builds SGLang's response body for one request, as the imitated release shapes it."""

    def __init__(
        self, rid: str, req: GenerateRequest, cached_tokens: int, started: float, quirks: Quirks
    ) -> None:
        self.rid, self.req, self.cached_tokens, self.started = rid, req, cached_tokens, started
        self.quirks = quirks

    def body(self, output_ids: list[int], text: str, finish_reason: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"text": text}
        if self.quirks.output_ids_lead_with_prompt:
            body["output_ids"] = self.req.input_ids[-5:] + output_ids
        elif self.quirks.output_ids:
            body["output_ids"] = output_ids
        body["meta_info"] = {
            "id": self.rid,
            "finish_reason": finish_reason,
            "prompt_tokens": len(self.req.input_ids),
            "weight_version": "default",
            "completion_tokens": len(output_ids),
            "cached_tokens": self.cached_tokens,
            "e2e_latency": time.monotonic() - self.started,
        }
        return body

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
    quirks, config = state.quirks, state.config
    try:
        body = parse_body(await request.read())
        rid = check_rid(body)
        if rid is not None and rid in state.in_flight and quirks.duplicate_rid_check:
            raise RequestError(f"Duplicate request ID detected: {rid}")
        req = parse_generate(
            body,
            context=config.context,
            max_input_len=config.max_req_input_len,
            quirks=quirks,
            max_new_tokens_limit=config.max_new_tokens_limit,
        )
    except RequestError as exc:
        state.stats.rejected += 1
        return exc.response()
    if not req.ids_in_vocab:
        state.crash(f"input ids outside the vocabulary [0, {model.VOCAB_SIZE}) reached the embedding")
    await state.started.wait()
    rid = req.rid if req.rid is not None else uuid.uuid4().hex
    state.note_rid(rid)
    flight = Flight(rid)
    state.in_flight[rid] = flight
    state.stats.enter()
    try:
        return await _serve(request, state, req, flight, started)
    finally:
        if state.in_flight.get(rid) is flight:
            del state.in_flight[rid]
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
    if fault == "duplicate":
        return value_error(f"Duplicate request ID detected: {flight.rid}")
    answer = _Answer(flight.rid, req, state.cache.lookup(req.input_ids), started, state.quirks)
    if fault == "abort":
        state.stats.aborted += 1
        return answer.aborted([], "Abort (injected)")
    if fault == "hang":
        return await _hang(request, state, flight, answer)

    params = req.sampling_params
    if not state.config.deterministic:  # accepted and ignored, as without --enable-deterministic-inference
        params = {k: v for k, v in params.items() if k != "sampling_seed"}
    gen = model.generate(req.input_ids, params, min_len=state.config.min_len, max_len=state.config.max_len)
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
        state.stats.tokens_generated += seq.done
        if seq.abort_message is not None:
            if _client_gone(request):
                state.stats.disconnected += 1
                return web.Response(status=499)
            state.stats.aborted += 1
            if seq.abort_status is not None and state.quirks.error_aborts:
                state.stats.timed_out += 1
                return http_error(seq.abort_status, seq.abort_message)
            return answer.aborted(gen.output_ids[: seq.done], seq.abort_message)
    else:
        state.stats.tokens_generated += gen.completion_tokens
    state.stats.generations += 1

    output_ids, finish_reason = gen.output_ids, gen.finish_reason
    if fault == "nan" and state.quirks.nan_check:
        # schedule_batch.py: the id sampled outside the vocabulary is replaced by EOS.
        output_ids = [*output_ids[:-1], model.EOS_TOKEN_ID]
        finish_reason = {"type": "stop", "matched": "NaN happened"}
    payload = orjson.dumps(answer.body(output_ids, gen.text, finish_reason))
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
