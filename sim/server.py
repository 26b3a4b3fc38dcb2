"""The simulated SGLang server: make_app(config) wires the endpoints into an aiohttp application.

Besides SGLang's native endpoints it serves /sim/* controls so tests can read counters, change
fault rates and flip health while the server runs.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from sim import model
from sim.config import SimConfig
from sim.errors import json_response, validation_error
from sim.faults import FaultRates
from sim.generate import handle_generate
from sim.state import SIM_STATE, SimState

__all__ = ["SIM_STATE", "SimConfig", "make_app"]


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read() or b"{}")
    except orjson.JSONDecodeError as exc:
        raise web.HTTPBadRequest(text=f"JSON decode error: {exc}") from exc
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="expected a JSON object")
    return body


async def abort_request(request: web.Request) -> web.Response:
    """Abort the in-flight request with this rid (or all); always 200, as in SGLang."""
    state = request.app[SIM_STATE]
    body = await _json_body(request)
    rid = body.get("rid")
    if body.get("abort_all"):
        targets = list(state.in_flight.values())
    else:
        flight = state.in_flight.get(rid) if isinstance(rid, str) and rid else None
        targets = [flight] if flight is not None else []
    for flight in targets:
        state.abort(flight, "Abort requested (abort_request).")
    return web.Response(status=200)


async def health(request: web.Request) -> web.Response:
    """200 with an empty body while healthy, 503 otherwise (SGLang: starting, draining, failed probe)."""
    return web.Response(status=200 if request.app[SIM_STATE].healthy else 503)


async def model_info(request: web.Request) -> web.Response:
    return json_response(
        {
            "model_path": model.MODEL_PATH,
            "tokenizer_path": model.MODEL_PATH,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }
    )


async def server_info(request: web.Request) -> web.Response:
    """The fields of SGLang's /server_info that clients read, plus the simulator's own settings."""
    state = request.app[SIM_STATE]
    config = state.config
    scheduler = state.scheduler
    return json_response(
        {
            "model_path": model.MODEL_PATH,
            "tokenizer_path": model.MODEL_PATH,
            "served_model_name": model.MODEL_PATH,
            "context_length": config.context_length,
            "max_req_input_len": config.context_length - 1,
            "max_total_num_tokens": config.context_length * config.max_running_requests,
            "max_running_requests": config.max_running_requests,
            "max_queued_requests": config.max_queued_requests,
            "vocab_size": model.VOCAB_SIZE,
            "eos_token_ids": [model.EOS_TOKEN_ID],
            "internal_states": [
                {
                    "#running_req": scheduler.running if scheduler else 0,
                    "#queue_req": scheduler.queued if scheduler else 0,
                }
            ],
            "version": "sim",
            "sim": {
                "latency": config.latency,
                "faults": state.faults.rates.as_dict(),
                "min_len": config.min_len,
                "max_len": config.max_len,
            },
        }
    )


async def sim_stats(request: web.Request) -> web.Response:
    state = request.app[SIM_STATE]
    scheduler = state.scheduler
    return json_response(
        {
            **state.stats.snapshot(),
            "running": scheduler.running if scheduler else 0,
            "queued": scheduler.queued if scheduler else 0,
            "healthy": state.healthy,
        }
    )


async def sim_faults(request: web.Request) -> web.Response:
    """GET shows the fault rates; POST {kind: rate, ...} changes the given ones."""
    state = request.app[SIM_STATE]
    if request.method == "POST":
        try:
            state.faults.rates = FaultRates.from_mapping(await _json_body(request), base=state.faults.rates)
        except (TypeError, ValueError) as exc:
            return validation_error(str(exc))
    return json_response(state.faults.rates.as_dict())


async def sim_health(request: web.Request) -> web.Response:
    """POST {"healthy": bool}: simulate a server going unhealthy or recovering."""
    state = request.app[SIM_STATE]
    healthy = (await _json_body(request)).get("healthy")
    if not isinstance(healthy, bool):
        return validation_error("healthy must be a boolean")
    state.healthy = healthy
    return json_response({"healthy": healthy})


async def _on_startup(app: web.Application) -> None:
    scheduler = app[SIM_STATE].scheduler
    if scheduler is not None:
        scheduler.start()


async def _on_shutdown(app: web.Application) -> None:
    await app[SIM_STATE].shutdown()


def make_app(config: SimConfig | None = None) -> web.Application:
    """Build the simulator application; run it with AppRunner/TCPSite (see sim.cli)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SIM_STATE] = SimState(config or SimConfig())
    router = app.router
    router.add_route("POST", "/generate", handle_generate)
    router.add_route("PUT", "/generate", handle_generate)
    router.add_post("/abort_request", abort_request)
    for path in ("/health", "/health_generate"):
        router.add_get(path, health)
    for path in ("/model_info", "/get_model_info"):
        router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        router.add_get(path, server_info)
    router.add_get("/sim/stats", sim_stats)
    router.add_route("GET", "/sim/faults", sim_faults)
    router.add_route("POST", "/sim/faults", sim_faults)
    router.add_post("/sim/health", sim_health)
    app.on_startup.append(_on_startup)
    app.on_shutdown.append(_on_shutdown)
    return app
