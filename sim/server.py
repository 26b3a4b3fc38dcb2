"""The simulated SGLang server: make_app(config) wires the endpoints into an aiohttp application.

Besides SGLang's native endpoints it serves /sim/* controls so tests can read counters, change
fault rates and flip health while the server runs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from sim import model
from sim.config import SimConfig
from sim.errors import json_response, unauthorized, validation_error
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
    """Always 200 with an empty body, as in SGLang.

    tokenizer_manager.py drops a rid that is not an exact live one; scheduler.py then aborts every
    request whose rid *starts with* it (so no live rid should be a prefix of another).
    """
    state = request.app[SIM_STATE]
    body = await _json_body(request)
    rid = body.get("rid")
    if body.get("abort_all"):
        targets = list(state.in_flight.values())
    elif isinstance(rid, str) and rid in state.in_flight:
        targets = [f for r, f in state.in_flight.items() if r.startswith(rid)]
    else:
        targets = []
    for flight in targets:
        state.abort(flight, "Aborted")
    return web.Response(status=200)


async def health(request: web.Request) -> web.Response:
    """http_server.py health_generate (both /health and /health_generate, 0.5.1 on): 503 while
    starting or shutting down; else a 1-token generation, 200 once the scheduler makes progress,
    503 after SGLANG_HEALTH_CHECK_TIMEOUT. The body is empty."""
    state = request.app[SIM_STATE]
    if not state.started.is_set() or state.shutting_down or not state.healthy:
        return web.Response(status=503)
    if state.scheduler is not None:
        try:
            await asyncio.wait_for(state.scheduler.progress(), state.config.health_timeout_s)
        except TimeoutError:
            return web.Response(status=503)
    return web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    return json_response(
        {
            "model_path": model.MODEL_PATH,
            "served_model_name": model.MODEL_PATH,
            "tokenizer_path": model.MODEL_PATH,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }
    )


async def models(request: web.Request) -> web.Response:
    """The OpenAI-compatible model list SGLang serves beside its native API: max_model_len is the
    context the tokenizer manager enforces (entrypoints/openai/serving_models.py)."""
    config = request.app[SIM_STATE].config
    card = {"id": model.MODEL_PATH, "object": "model", "owned_by": "sglang", "max_model_len": config.context}
    return json_response({"object": "list", "data": [card]})


async def server_info(request: web.Request) -> web.Response:
    """What SGLang's /server_info holds that clients read (the resolved server args plus scheduler
    info), and the simulator's own settings under "sim". No vocabulary size: SGLang gives none."""
    state = request.app[SIM_STATE]
    config = state.config
    scheduler = state.scheduler
    return json_response(
        {
            "model_path": model.MODEL_PATH,
            "tokenizer_path": model.MODEL_PATH,
            "served_model_name": model.MODEL_PATH,
            "context_length": config.context_length,  # null unless --context-length was given
            "max_req_input_len": config.max_req_input_len,
            "max_total_num_tokens": config.context * config.max_running_requests,
            "max_running_requests": config.max_running_requests,
            "max_queued_requests": config.max_queued_requests,
            "enable_deterministic_inference": config.deterministic,
            "internal_states": [
                {
                    "#running_req": scheduler.running if scheduler else 0,
                    "#queue_req": scheduler.queued if scheduler else 0,
                }
            ],
            "version": config.version,
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


async def sim_rids(request: web.Request) -> web.Response:
    """Every rid received so far, in order (tests check that none repeats or prefixes another)."""
    return json_response(request.app[SIM_STATE].rids)


async def sim_api_key(request: web.Request) -> web.Response:
    """POST {"api_key": str | null}: rotate the key while the server runs."""
    state = request.app[SIM_STATE]
    key = (await _json_body(request)).get("api_key")
    if key is not None and not isinstance(key, str):
        return validation_error("api_key must be a string or null")
    state.api_key = key
    return json_response({"api_key_set": key is not None})


# utils/auth.py: these stay open whatever the key (and /sim/* are the simulator's own controls).
_OPEN_PREFIXES = ("/health", "/ready", "/metrics", "/sim/")


@web.middleware
async def _api_key(request: web.Request, handler):  # type: ignore[no-untyped-def]
    state = request.app[SIM_STATE]
    open_path = request.path.startswith(_OPEN_PREFIXES)
    if state.api_key and not open_path and request.headers.get("Authorization") != f"Bearer {state.api_key}":
        state.stats.unauthorized += 1
        return unauthorized()
    return await handler(request)


async def _on_startup(app: web.Application) -> None:
    state = app[SIM_STATE]
    if state.scheduler is not None:
        state.scheduler.start()
    loop = asyncio.get_running_loop()
    loop.call_later(state.config.startup_s, state.started.set)


async def _on_shutdown(app: web.Application) -> None:
    await app[SIM_STATE].shutdown()


def make_app(config: SimConfig | None = None) -> web.Application:
    """Build the simulator application; run it with AppRunner/TCPSite (see sim.cli)."""
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_api_key])
    state = SimState(config or SimConfig())
    app[SIM_STATE] = state
    quirks = state.quirks
    router = app.router
    router.add_route("POST", "/generate", handle_generate)
    router.add_route("PUT", "/generate", handle_generate)
    if quirks.abort_route:
        router.add_post("/abort_request", abort_request)
    for path in ("/health", "/health_generate"):
        router.add_get(path, health)
    router.add_get("/get_model_info", model_info)
    router.add_get("/get_server_info", server_info)
    if quirks.new_info_routes:
        router.add_get("/model_info", model_info)
        router.add_get("/server_info", server_info)
    router.add_get("/v1/models", models)
    router.add_get("/sim/stats", sim_stats)
    router.add_route("GET", "/sim/faults", sim_faults)
    router.add_route("POST", "/sim/faults", sim_faults)
    router.add_post("/sim/health", sim_health)
    router.add_get("/sim/rids", sim_rids)
    router.add_post("/sim/api-key", sim_api_key)
    app.on_startup.append(_on_startup)
    app.on_shutdown.append(_on_shutdown)
    return app
