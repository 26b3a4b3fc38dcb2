"""One generation, whatever API asked for it: faults, the toy model, the latency model, delivery.

Every API module (sim/sglang.py, sim/vllm.py, sim/openai_chat.py) validates its own request,
calls :func:`generate` with the prompt ids and the sampling settings it resolved, renders the
:class:`Served` outcome in its own body shape, and hands the bytes to :func:`deliver`.

Faults that refuse a request (500, 503, 429, abort, hang, duplicate) happen before any work;
reset and truncate happen after the generation, so the work is done and lost, as when a
connection dies while the answer is on its way.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from genq.sim import model
from genq.sim.scheduler import QueueFull
from genq.sim.state import Flight, SimState

REFUSALS = ("error_500", "error_503", "error_429", "duplicate")


@dataclass
class Served:
    """How one request ended, for its API to render."""

    rid: str
    input_ids: list[int]
    cached_tokens: int
    fault: str | None = None
    gen: model.Generation | None = None  # the finished generation (None: refused or aborted first)
    done: int = 0  # tokens generated (fewer than gen's when aborted)
    abort_message: str | None = None  # 200 with an abort finish reason, in every API here
    error_status: int | None = None  # an HTTP error instead (injected refusals, timeouts, full queue)
    error_message: str | None = None
    gone: bool = False  # the client left; nothing is sent

    @property
    def output_ids(self) -> list[int]:
        assert self.gen is not None
        return self.gen.output_ids[: self.done] if self.abort_message else self.gen.output_ids


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def generate(
    request: web.Request,
    state: SimState,
    rid: str | None,
    input_ids: list[int],
    params: dict[str, Any],
    client_rid: str | None = None,
) -> Served:
    """Run one generation of ``input_ids`` with resolved ``params`` (max_new_tokens set), the way
    the server's scheduler would, under the configured faults and latency. ``client_rid`` is the id
    the client chose, when the server derives its own ``rid`` from it (vLLM)."""
    if not all(0 <= i < model.VOCAB_SIZE for i in input_ids):
        # No engine here checks (SGLang never does): ids outside the vocabulary reach the
        # embedding, and a GPU faults on them.
        state.crash(f"input ids outside the vocabulary [0, {model.VOCAB_SIZE}) reached the embedding")
    await state.started.wait()
    rid = rid if rid is not None else uuid.uuid4().hex
    state.note_rid(client_rid or rid)
    flight = Flight(rid)
    state.in_flight[rid] = flight
    state.stats.enter()
    try:
        return await _run(request, state, flight, input_ids, params)
    finally:
        if state.in_flight.get(rid) is flight:
            del state.in_flight[rid]
        state.stats.leave()


async def _run(
    request: web.Request, state: SimState, flight: Flight, input_ids: list[int], params: dict[str, Any]
) -> Served:
    fault = state.faults.pick()
    if fault is not None:
        state.stats.faults[fault] += 1
    served = Served(flight.rid, input_ids, state.cache.lookup(input_ids), fault)
    if fault in REFUSALS:
        served.error_status = {"error_500": 500, "error_503": 503, "error_429": 429, "duplicate": 400}[fault]
        return served
    if fault == "abort":
        state.stats.aborted += 1
        served.gen, served.abort_message = (
            model.generate(input_ids, {"max_new_tokens": 0}),
            "Abort (injected)",
        )
        return served
    if fault == "hang":
        return await _hang(request, state, flight, served)
    if not state.config.deterministic:  # accepted and ignored, as without deterministic inference
        params = {k: v for k, v in params.items() if k != "sampling_seed"}
    config = state.config
    lengths = {"min_len": config.min_len, "max_len": config.max_len}
    gen = model.generate(
        input_ids, params, **lengths, autoregressive=config.autoregressive, thinking=config.thinking
    )
    served.gen, served.done = gen, gen.completion_tokens
    if state.scheduler is None:
        state.stats.tokens_generated += gen.completion_tokens
    else:
        try:
            seq = state.scheduler.submit(len(input_ids) - served.cached_tokens, gen.completion_tokens)
        except QueueFull:
            state.stats.queue_full += 1
            served.error_status, served.error_message = 503, "queue full"
            return served
        flight.seq = seq
        while not seq.finished:
            await asyncio.wait({seq.future}, timeout=state.config.disconnect_check_s)
            if not seq.finished and client_gone(request):
                state.scheduler.abort(seq, "Client disconnected.")
        served.done = seq.done
        state.stats.tokens_generated += seq.done
        if seq.abort_message is not None:
            if client_gone(request):
                state.stats.disconnected += 1
                served.gone = True
            elif seq.abort_status is not None:
                state.stats.timed_out += 1
                served.error_status, served.error_message = seq.abort_status, seq.abort_message
            else:
                state.stats.aborted += 1
                served.abort_message = seq.abort_message
            return served
    state.stats.generations += 1
    return served


async def _hang(request: web.Request, state: SimState, flight: Flight, served: Served) -> Served:
    """Never answer; an abort ends it with an abort, a gone client or shutdown ends it silently."""
    served.gen = model.generate(served.input_ids, {"max_new_tokens": 0})
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(flight.wake.wait(), state.config.disconnect_check_s)
        if flight.closing:
            if request.transport is not None:
                request.transport.close()
            served.gone = True
            return served
        if flight.abort_message is not None:
            state.stats.aborted += 1
            served.abort_message = flight.abort_message
            return served
        if client_gone(request):
            state.stats.disconnected += 1
            served.gone = True
            return served


async def deliver(
    request: web.Request, state: SimState, served: Served, payload: bytes
) -> web.StreamResponse:
    """Send a finished generation's JSON body, or lose it as the fault says."""
    if served.gone:
        return web.Response(status=499)
    if served.fault == "reset":
        _reset_connection(request)
        return web.Response(status=500)  # never sent: the connection is gone
    if served.fault == "truncate":
        return await _send_truncated(request, payload)
    if client_gone(request):
        state.stats.disconnected += 1
        return web.Response(status=499)
    if served.abort_message is None:
        state.stats.completed += 1
        state.stats.tokens_delivered += served.done
    return web.Response(body=payload, content_type="application/json")


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
