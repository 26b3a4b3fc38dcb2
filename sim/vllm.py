"""vLLM's OpenAI-compatible server: /v1/completions (token ids in and out), /v1/chat/completions,
/v1/models, /version, /health. Facts from vLLM 0.33's source (paths under ``vllm/``):

- ``entrypoints/openai/completion/protocol.py``: ``prompt`` as a flat list of ints is one prompt,
  taken as is; ``max_tokens`` defaults to 16 (null too, 0.24 on); unknown fields are ignored
  (``extra="allow"``); ``return_token_ids`` (0.10.2 on) puts the output ids, stop token kept, in
  ``choices[0].token_ids`` and echoes ``prompt_token_ids``.
- ``config/model.py`` get_diff_sampling_param: omitted temperature, top_p, top_k, min_p, penalties
  and skip_special_tokens come from the model's generation_config, not OpenAI's defaults.
- ``renderers/params.py``: a prompt longer than max_model_len is a 400; prompt + max_tokens past
  it is clamped (0.32 on) and ends ``length``; ``renderers/base.py``: ids outside the vocabulary
  are a 400 "Token id N is out of vocabulary".
- ``serve/engine/serving.py``: the ``X-Request-Id`` header wins over the body's ``request_id``;
  duplicates are allowed (0.14 on). Abort: closing the connection; no abort route by default.
- ``v1/core/sched/utils.py``: ``stop_reason`` is the matched stop id or string, None for EOS;
  ``finish_reason`` "abort" comes as HTTP 200 with the partial output.
- Errors: ``{"error": {message, type, param, code}}`` from 0.10.1 (flat before); validation
  errors end with " (parameter=X, value=Y)". No 429 and no Retry-After, ever.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from genq.sim import loads, model
from genq.sim.engine import Served, deliver, generate
from genq.sim.http import json_response
from genq.sim.openai_chat import ChatError, chat_body, finish_of, parse_messages, sampling, usage
from genq.sim.state import SIM_STATE, SimState
from genq.sim.versions import parse
from genq.sim.vllm_request import parse_fields, verify

DEFAULT_MAX_TOKENS = 16


def _error(
    state: SimState, status: int, message: str, kind: str = "BadRequestError", param: str | None = None
) -> web.Response:
    if parse(state.config.vllm_version) < (0, 10, 1):  # flat before 0.10.1
        body: dict[str, Any] = {
            "object": "error",
            "message": message,
            "type": kind,
            "param": param,
            "code": status,
        }
    else:
        body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return json_response(body, status=status)


def _token_ids_supported(state: SimState) -> bool:
    return parse(state.config.vllm_version) >= (0, 10, 2)


def _request_id(request: web.Request, body: dict[str, Any]) -> str:
    return request.headers.get("X-Request-Id") or str(body.get("request_id") or uuid.uuid4().hex)


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise ChatError(
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", "prompt"
        )
    if prompt == "" or prompt == []:
        raise ChatError("You must pass at least one prompt")
    if isinstance(prompt, str):
        return model.tokenize(prompt)
    if isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        negative = next((i for i in prompt if i < 0), None)
        if negative is not None:  # pydantic: the prompt union's every branch fails (not compared)
            raise ChatError(
                f"4 validation errors:\n  Input should be greater than or equal to 0, got {negative}",
                "body.prompt.0",
                kind="Bad Request",
            )
        return list(prompt)
    if isinstance(prompt, list) and any(isinstance(i, float) for i in prompt):
        raise ChatError(
            "4 validation errors:\n  Input should be a valid integer, got a number with a fractional part",
            "body.prompt.0",
            kind="Bad Request",
        )
    raise ChatError("The simulator serves one prompt per request (a string or a flat list of ids).", "prompt")


def _check_prompt(ids: list[int], context: int, tokenized_here: bool) -> None:
    """renderers/params.py and renderers/base.py, in that order. A prompt the server tokenized itself
    was cut at the context + 1 tokens, so the message says "at least"."""
    if len(ids) > context:
        n = context + 1 if tokenized_here else len(ids)
        count = f"at least {n}" if tokenized_here else str(n)
        raise ChatError(
            f"This model's maximum context length is {context} tokens. However, your prompt contains "
            f"{count} input tokens, which exceeds this limit even without any output tokens. Please "
            f"reduce the length of the input prompt. (parameter=input_tokens, value={n})",
            "input_tokens",
        )
    outside = next((i for i in ids if i >= model.VOCAB_SIZE), None)
    if outside is not None:
        raise ChatError(f"Token id {outside} is out of vocabulary")


def _max_tokens(body: dict[str, Any], key: str, default: int | None, prompt_len: int, context: int) -> int:
    asked = body.get(key)
    asked = default if asked is None else int(asked)
    if asked is not None and asked > context:
        raise ChatError(
            f"{key}={asked} cannot be greater than max_model_len={context}. Please request fewer output "
            f"tokens. (parameter={key}, value={asked})",
            key,
        )
    room = context - prompt_len  # serve/utils/api_utils.py get_max_tokens: clamped, not refused
    out = room if asked is None else min(asked, room)
    if out < 1:
        raise ChatError(
            f"max_tokens must be at least 1, got {out}. (parameter=max_tokens, value={out})", "max_tokens"
        )
    return out


def _params(
    state: SimState, body: dict[str, Any], prompt_len: int, max_key: str, default_max: int | None
) -> dict[str, Any]:
    params = sampling(body, state.config.generation_config)
    params["max_new_tokens"] = _max_tokens(body, max_key, default_max, prompt_len, state.config.context)
    verify(body, params["max_new_tokens"])
    if body.get("include_stop_str_in_output"):
        params["no_stop_trim"] = True
    if (body.get("n") or 1) != 1 or body.get("stream"):
        raise ChatError("The simulator serves n=1 without streaming.")
    return params


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[SIM_STATE]
    state.stats.requests += 1
    if not state.healthy:
        state.stats.unhealthy += 1
        return _error(
            state, 500, "The server had an error while processing your request.", "InternalServerError"
        )
    try:
        body = parse_fields(_json(await request.read()), chat=False)
        _check_model(body)
        ids = _prompt_ids(body)
        _check_prompt(ids, state.config.context, isinstance(body["prompt"], str))
        params = _params(state, body, len(ids), "max_tokens", DEFAULT_MAX_TOKENS)
    except ChatError as exc:
        state.stats.rejected += 1
        return _error(state, exc.status, exc.message, exc.kind or "BadRequestError", exc.param)
    request_id = _request_id(request, body)
    # input_processor.py: the engine's own id adds 8 random characters, so duplicates are allowed.
    served = await generate(
        request, state, f"cmpl-{request_id}-0-{uuid.uuid4().hex[:8]}", ids, params, request_id
    )
    if served.error_status is not None or served.gone:
        return _refusal(state, served)
    token_ids = bool(body.get("return_token_ids")) and _token_ids_supported(state)
    output_ids = served.output_ids
    finish, stop_reason = finish_of(served)
    skip = params.get("skip_special_tokens", True)
    text = (
        served.gen.text  # type: ignore[union-attr]
        if served.abort_message is None
        else model.detokenize(output_ids, skip, state.config.thinking)
    )
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": stop_reason,
        "prompt_logprobs": None,
    }
    if _token_ids_supported(state):  # the keys are there (null) unless asked for
        choice["token_ids"] = output_ids if token_ids else None
        choice["prompt_token_ids"] = ids if token_ids else None
        choice["routed_experts"] = None
    if body.get("logprobs") is not None:  # completion/protocol.py: logprobs: K
        choice["logprobs"] = _logprobs(
            output_ids,
            int(body["logprobs"]),
            bool(body.get("return_tokens_as_token_ids")),
            served.fault == "wild_logprobs",
            len(ids) if state.config.autoregressive else 0,
        )
    result = {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model.MODEL_PATH,
        "choices": [choice],
        "usage": usage(served, len(output_ids), state.config.prompt_tokens_details),
    }
    return await deliver(request, state, served, orjson.dumps(_with_extras(state, result)))


def _check_model(body: dict[str, Any]) -> None:
    """serve/engine/serving.py: a model the server does not serve is a 404 (none named: the first)."""
    name = body.get("model")
    if name is not None and name != model.MODEL_PATH:
        raise ChatError(
            f"The model `{name}` does not exist. Valid aliases: {model.MODEL_PATH}.",
            "model",
            status=404,
            kind="NotFoundError",
        )


def _with_extras(state: SimState, body: dict[str, Any]) -> dict[str, Any]:
    """The fields 0.32's response models always carry, null when unused (checked against the real
    server by tests/test_real_vllm.py)."""
    body["usage"]["completion_tokens_details"] = None
    extras = {
        "service_tier": None,
        "system_fingerprint": f"vllm-{state.config.vllm_version}-sim",
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }
    return {**body, **extras}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """vLLM's chat: the server renders the conversation; its extras (return_token_ids, top_k, ...)
    are taken, unknown fields ignored."""
    state = request.app[SIM_STATE]
    state.stats.requests += 1
    if not state.healthy:
        state.stats.unhealthy += 1
        return _error(
            state, 500, "The server had an error while processing your request.", "InternalServerError"
        )
    try:
        body = parse_fields(_json(await request.read()), chat=True)
        _check_model(body)
        ids = model.render_chat(parse_messages(body))
        _check_prompt(ids, state.config.context, tokenized_here=True)
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        params = _params(state, body, len(ids), key, None)
    except ChatError as exc:
        state.stats.rejected += 1
        return _error(state, exc.status, exc.message, exc.kind or "BadRequestError", exc.param)
    request_id = _request_id(request, body)
    served = await generate(
        request, state, f"chatcmpl-{request_id}-{uuid.uuid4().hex[:8]}", ids, params, request_id
    )
    if served.error_status is not None or served.gone:
        return _refusal(state, served)
    token_ids = bool(body.get("return_token_ids")) and _token_ids_supported(state)
    result = chat_body(
        state,
        served,
        request_id,
        token_ids=token_ids,
        skip_special=params.get("skip_special_tokens", True),
        cached_tokens=state.config.prompt_tokens_details,
    )
    if _token_ids_supported(state):
        (choice,) = result["choices"]
        choice.setdefault("stop_reason", finish_of(served)[1])
        choice.setdefault("token_ids", None)
        choice["routed_experts"] = None
        result.setdefault("prompt_token_ids", None)
        result.update(prompt_logprobs=None, prompt_text=None)
        message = choice["message"]
        for key in ("refusal", "annotations", "audio", "function_call", "reasoning"):
            message.setdefault(key, None)
    return await deliver(request, state, served, orjson.dumps(_with_extras(state, result)))


def _logprobs(output_ids: list[int], k: int, as_ids: bool, wild: bool, offset: int) -> dict[str, Any]:
    """The completions logprobs object; tokens named "token_id:N" with return_tokens_as_token_ids."""

    def name(i: int) -> str:
        return f"token_id:{i}" if as_ids else model.detokenize([i], False)

    token, top = model.logprobs(output_ids, k, offset)
    if wild:
        model.wild(token, top)
    return {
        "text_offset": list(range(len(output_ids))),
        "token_logprobs": token,
        "tokens": [name(i) for i in output_ids],
        "top_logprobs": [{name(i): lp for i, lp in row} for row in top],
    }


def _json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ChatError(f"1 validation error:\n  JSON decode error: {exc}", kind="Bad Request") from exc
    if not isinstance(body, dict):
        raise ChatError("1 validation error:\n  Input should be a valid dictionary", kind="Bad Request")
    return body


def _refusal(state: SimState, served: Served) -> web.StreamResponse:
    if served.gone:
        return web.Response(status=499)
    status = served.error_status or 500
    if status == 503:  # --max-num-queued-reqs (0.29 on), or the injected fault
        message = (
            "The engine is currently busy and cannot accept new requests. Please try again later or on a "
            "different instance."
        )
        return _error(state, 503, message, "Service Unavailable")
    if status == 429:  # never from vLLM itself: an opt-in fault for hosted-API clients
        response = _error(state, 429, "Too many requests (injected)", "RateLimitError")
        response.headers["Retry-After"] = "1"
        return response
    if status == 400:  # the duplicate fault: vLLM <= 0.13 refused a request id still running
        return _error(state, 400, f"Request id {served.rid} already running.")
    return _error(state, 500, "Internal server error", "InternalServerError")


async def models(request: web.Request) -> web.Response:
    config = request.app[SIM_STATE].config
    card = {
        "id": model.MODEL_PATH,
        "object": "model",
        "created": 0,
        "owned_by": "vllm",
        "root": model.MODEL_PATH,
        "parent": None,
        "max_model_len": config.context,
        "permission": [],
    }
    return json_response({"object": "list", "data": [card]})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": request.app[SIM_STATE].config.vllm_version})


async def health(request: web.Request) -> web.Response:
    """serve/instrumentator/health.py: an empty 200; 503 when the engine is dead."""
    state = request.app[SIM_STATE]
    ok = state.started.is_set() and state.healthy and not state.shutting_down
    return web.Response(status=200 if ok else 503)


def guarded(path: str) -> bool:
    """serve/middleware/authenticate.py GUARDED_PREFIX: /health and /version stay open."""
    return path.startswith(("/v1", "/v2", "/inference"))


def unauthorized() -> web.Response:
    return json_response({"error": "Unauthorized"}, status=401)


def add_routes(app: web.Application) -> None:
    router = app.router
    router.add_post("/v1/completions", completions)
    router.add_post("/v1/chat/completions", chat_completions)
    router.add_get("/v1/models", models)
    router.add_get("/version", version)
    router.add_get("/health", health)
    router.add_get("/metrics", loads.vllm_metrics)
