"""The simulated inference server: make_app(config) wires one engine API into an aiohttp application.

``config.api`` picks the API (sim/sglang.py, sim/vllm.py, sim/openai_chat.py); all of them share
the toy model, the latency model and the faults (sim/engine.py). Besides the API's endpoints it
serves /sim/* controls so tests can read counters, change fault rates, flip health and rotate
the API key while the server runs.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from genq.sim import openai_chat, sglang, vllm
from genq.sim.config import SimConfig
from genq.sim.errors import validation_error
from genq.sim.faults import FaultRates
from genq.sim.http import json_body, json_response
from genq.sim.state import SIM_STATE, SimState

__all__ = ["SIM_STATE", "SimConfig", "make_app"]


async def sim_stats(request: web.Request) -> web.Response:
    state = request.app[SIM_STATE]
    scheduler = state.scheduler
    return json_response(
        {
            **state.stats.snapshot(),
            "running": scheduler.running if scheduler else 0,
            "queued": scheduler.queued if scheduler else 0,
            "retracted": scheduler.retracted if scheduler else 0,
            "recomputed_tokens": scheduler.recomputed_tokens if scheduler else 0,
            "healthy": state.healthy,
        }
    )


async def sim_faults(request: web.Request) -> web.Response:
    """GET shows the fault rates; POST {kind: rate, ...} changes the given ones."""
    state = request.app[SIM_STATE]
    if request.method == "POST":
        try:
            state.faults.rates = FaultRates.from_mapping(await json_body(request), base=state.faults.rates)
        except (TypeError, ValueError) as exc:
            return validation_error(str(exc))
    return json_response(state.faults.rates.as_dict())


async def sim_health(request: web.Request) -> web.Response:
    """POST {"healthy": bool}: simulate a server going unhealthy or recovering."""
    state = request.app[SIM_STATE]
    healthy = (await json_body(request)).get("healthy")
    if not isinstance(healthy, bool):
        return validation_error("healthy must be a boolean")
    state.healthy = healthy
    return json_response({"healthy": healthy})


async def sim_rids(request: web.Request) -> web.Response:
    """Every rid received so far, in order (tests check that none repeats or prefixes another)."""
    return json_response(request.app[SIM_STATE].rids)


async def sim_kv_tokens(request: web.Request) -> web.Response:
    """POST {"kv_tokens": int}: change the KV-cache capacity while the server runs (realistic latency)."""
    state = request.app[SIM_STATE]
    tokens = (await json_body(request)).get("kv_tokens")
    if state.scheduler is None or not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        return validation_error("kv_tokens must be a positive integer, under --latency realistic")
    state.scheduler.set_kv_tokens(tokens)
    return json_response({"kv_tokens": tokens})


async def sim_api_key(request: web.Request) -> web.Response:
    """POST {"api_key": str | null}: rotate the key while the server runs."""
    state = request.app[SIM_STATE]
    key = (await json_body(request)).get("api_key")
    if key is not None and not isinstance(key, str):
        return validation_error("api_key must be a string or null")
    state.api_key = key
    return json_response({"api_key_set": key is not None})


APIS = {"sglang": sglang, "vllm": vllm, "openai-chat": openai_chat}


@web.middleware
async def _api_key(request: web.Request, handler):  # type: ignore[no-untyped-def]
    """--api-key, on the paths the imitated server guards (each API module says which)."""
    state = request.app[SIM_STATE]
    api = APIS[state.config.api]
    guarded = not request.path.startswith("/sim/") and api.guarded(request.path)
    if state.api_key and guarded and request.headers.get("Authorization") != f"Bearer {state.api_key}":
        state.stats.unauthorized += 1
        return api.unauthorized()
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
    APIS[state.config.api].add_routes(app)
    router = app.router
    router.add_get("/sim/stats", sim_stats)
    router.add_route("GET", "/sim/faults", sim_faults)
    router.add_route("POST", "/sim/faults", sim_faults)
    router.add_post("/sim/health", sim_health)
    router.add_get("/sim/rids", sim_rids)
    router.add_post("/sim/api-key", sim_api_key)
    router.add_post("/sim/kv-tokens", sim_kv_tokens)
    app.on_startup.append(_on_startup)
    app.on_shutdown.append(_on_shutdown)
    return app
