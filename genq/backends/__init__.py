"""Engine backends (decision 13): one module per engine API, behind :class:`Backend`.

The worker sends through them; ``genq enqueue --server`` probes through them for the context
length and the vocabulary. They live in the shared contract because both roles need them.
``auto`` asks the server what it is (:func:`detect`).
"""

from __future__ import annotations

import asyncio

from genq.backends.base import (
    MAX_BODY_MB,
    Answer,
    AttemptError,
    Backend,
    Cost,
    Http,
    ServerInfo,
    ServerRefused,
    split_credentials,
)
from genq.backends.llamacpp import LlamaCpp
from genq.backends.openai_chat import OpenAIChat
from genq.backends.openai_compat import VLLM_SAMPLING_KEYS
from genq.backends.sglang import SGLang
from genq.backends.sglang_router import is_router
from genq.backends.vllm import VLLM

BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (SGLang, VLLM, LlamaCpp, OpenAIChat)}
NAMES = ("auto", *BACKENDS)

__all__ = [
    "BACKENDS",
    "MAX_BODY_MB",
    "NAMES",
    "VLLM_SAMPLING_KEYS",
    "Answer",
    "AttemptError",
    "Backend",
    "Cost",
    "Http",
    "ServerInfo",
    "ServerRefused",
    "choose",
    "detect",
    "probe",
    "split_credentials",
]


async def detect(http: Http) -> type[Backend]:
    """What the server answers: SGLang's /server_info (or /get_server_info, which SGLang's router
    answers too) says sglang, vLLM's /version says vllm, llama.cpp's /props says llamacpp, a bare
    /v1/models says an OpenAI-compatible chat endpoint."""
    status, info = await http.get_json("/server_info")
    if status == 404:
        status, info = await http.get_json("/get_server_info")
    if status == 200 and (is_router(info) or isinstance(info, dict) and "max_req_input_len" in info):
        return SGLang  # an SGLang server, or SGLang's router in front of some (sglang_router.py)
    failing = [status] if status >= 500 else []  # an engine that could not say now what it is
    status, version = await http.get_json("/version")
    if status == 200 and isinstance(version, dict) and "version" in version:
        return VLLM
    failing += [status] if status >= 500 else []
    status, props = await http.get_json("/props")
    if status == 200 and isinstance(props, dict) and "default_generation_settings" in props:
        return LlamaCpp
    failing += [status] if status >= 500 else []
    status, models = await http.get_json("/v1/models")
    if failing:  # SGLang and vLLM serve /v1/models too: only a server that said what it is not is "chat"
        raise AttemptError(
            "unavailable", f"{http.base_url} answers {failing[0]} while genq asks what it is", failing[0],
            cost=Cost.FREE, down=True,
        )  # fmt: skip
    if status == 200 and isinstance(models, dict) and models.get("data"):
        return OpenAIChat
    if status in (401, 403):
        raise ServerRefused(
            f"{http.base_url} refused genq's API key ({status}): set GENQ_SERVER_API_KEY or "
            "GENQ_SERVER_API_KEY_FILE to the server's --api-key"
        )
    if status >= 500:
        raise AttemptError(
            "unavailable", f"{http.base_url} answers {status}", status, cost=Cost.FREE, down=True
        )
    raise ServerRefused(
        f"{http.base_url} answers neither SGLang's /server_info, vLLM's /version nor /v1/models: "
        f"name its engine with --backend ({', '.join(BACKENDS)})"
    )


async def choose(name: str, http: Http, model: str | None = None) -> Backend:
    """The backend ``name`` (or the detected one for ``auto``) on ``http``, not yet probed."""
    if name == "auto":
        return (await detect(http))(http, model)
    try:
        return BACKENDS[name](http, model)
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(NAMES)}") from None


def probe(url: str, name: str = "auto", model: str | None = None) -> ServerInfo:
    """What a server says about itself (blocking; for commands that are not async)."""

    async def run() -> ServerInfo:
        async with Http(url) as http:
            return await (await choose(name, http, model)).probe()

    return asyncio.run(run())
