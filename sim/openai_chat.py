"""An OpenAI-style chat endpoint, as hosted APIs serve it: POST /v1/chat/completions.

Text in, text out: the server renders the conversation (here with ``model.render_chat``) and
returns no token ids. Hosted APIs are strict: a field outside the API is a 400 ("Unrecognized
request argument supplied"), omitted sampling fields take OpenAI's defaults (temperature 1,
top_p 1), and 429 with ``Retry-After`` is how they say "slow down" (``--fail-429``).
vLLM's own chat endpoint (sim/vllm.py) builds its answers with :func:`chat_body` below.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from genq.sim import model
from genq.sim.engine import Served, deliver, generate
from genq.sim.http import json_response
from genq.sim.state import SIM_STATE, SimState

# The request fields of OpenAI's chat completions API.
FIELDS = frozenset(
    {
        "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
        "stop", "seed", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs",
        "stream", "stream_options", "user", "logit_bias", "response_format", "tools",
        "tool_choice", "parallel_tool_calls", "reasoning_effort", "metadata", "store",
    }
)  # fmt: skip


def openai_error(
    status: int, message: str, kind: str, param: str | None = None, headers: Any = None
) -> web.Response:
    """OpenAI's error body, which vLLM copies (since 0.10.1): {"error": {message, type, param, code}}."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return json_response(body, status=status, headers=headers)


class ChatError(Exception):
    """A refused request; ``kind`` is the error type (None: the API's usual one for a 400)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def response(self) -> web.Response:
        return openai_error(self.status, self.message, self.kind or "invalid_request_error", self.param)


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty array.", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatError(
                f"Invalid value for 'messages[{i}]': expected an object with a role.", f"messages[{i}]"
            )
        if message.get("content") is not None and not isinstance(message["content"], str):
            raise ChatError(
                f"The simulator takes string content only (messages[{i}]).", f"messages[{i}].content"
            )
    return messages


def sampling(body: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The toy model's settings from OpenAI's fields; a field left out takes ``defaults``."""
    params: dict[str, Any] = {}
    for key in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
    ):
        value = body.get(key)
        params[key] = value if value is not None else defaults.get(key)
    if body.get("seed") is not None:
        params["sampling_seed"] = body["seed"]
    if body.get("stop"):
        params["stop"] = body["stop"]
    for ours, theirs in (
        ("stop_token_ids", "stop_token_ids"),
        ("ignore_eos", "ignore_eos"),
        ("min_new_tokens", "min_tokens"),
    ):
        if body.get(theirs) is not None:
            params[ours] = body[theirs]
    skip = body.get("skip_special_tokens")
    params["skip_special_tokens"] = skip if skip is not None else defaults.get("skip_special_tokens", True)
    return {k: v for k, v in params.items() if v is not None}


def split_reasoning(text: str) -> tuple[str | None, str]:
    """The simulated reasoning parser: the first third of the answer's words is the thought."""
    words = text.split()
    cut = len(words) // 3
    return (" ".join(words[:cut]) or None), " ".join(words[cut:])


def finish_of(served: Served) -> tuple[str, int | str | None]:
    """OpenAI's finish_reason, and vLLM's stop_reason (the stop id or string; None for EOS)."""
    if served.abort_message is not None:
        return "abort", None
    assert served.gen is not None
    finish = served.gen.finish_reason
    if finish["type"] == "length":
        return "length", None
    matched = finish.get("matched")
    return "stop", (None if matched == model.EOS_TOKEN_ID else matched)


def chat_body(
    state: SimState,
    served: Served,
    request_id: str,
    *,
    token_ids: bool,
    skip_special: bool = True,
    cached_tokens: bool = False,
) -> dict[str, Any]:
    """A chat.completion body for a finished (or aborted) generation."""
    output_ids = served.output_ids
    text = (
        model.detokenize(output_ids, skip_special, state.config.thinking)
        if served.abort_message
        else served.gen.text  # type: ignore[union-attr]
    )
    finish, stop_reason = finish_of(served)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if state.config.reasoning_parser:
        reasoning, content = split_reasoning(text)
        message = {"role": "assistant", "content": content, state.config.reasoning_field: reasoning}
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    body: dict[str, Any] = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model.MODEL_PATH,
        "choices": [choice],
        "usage": usage(served, len(output_ids), cached_tokens),
    }
    if token_ids:  # vLLM's return_token_ids: output ids on the choice, prompt ids at the top
        choice["stop_reason"] = stop_reason
        choice["token_ids"] = output_ids
        body["prompt_token_ids"] = served.input_ids
    return body


def usage(served: Served, completion: int, cached_tokens: bool) -> dict[str, Any]:
    prompt = len(served.input_ids)
    details = {"cached_tokens": served.cached_tokens} if cached_tokens else None
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": details,
    }


def max_tokens(body: dict[str, Any], prompt_len: int, context: int) -> int:
    """What is left of the context unless the client asked for less."""
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    room = context - prompt_len
    return room if asked is None else min(int(asked), room)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[SIM_STATE]
    state.stats.requests += 1
    if not state.healthy:
        state.stats.unhealthy += 1
        return openai_error(503, "The server is overloaded or not ready yet.", "server_error")
    try:
        body = orjson.loads(await request.read())
        if not isinstance(body, dict):
            raise ChatError("The request body must be a JSON object.")
        unknown = sorted(set(body) - FIELDS)
        if unknown:
            raise ChatError(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
        if body.get("stream") or (body.get("n") or 1) != 1:
            raise ChatError("The simulator serves n=1 without streaming.")
        ids = model.render_chat(parse_messages(body))
        context = state.config.context
        if len(ids) >= context:
            raise ChatError(
                f"This model's maximum context length is {context} tokens. However, your messages "
                f"resulted in {len(ids)} tokens. Please reduce the length of the messages.",
                "messages",
            )
        params = sampling(body, {})
        params["max_new_tokens"] = max_tokens(body, len(ids), context)
    except orjson.JSONDecodeError as exc:
        state.stats.rejected += 1
        return openai_error(
            400, f"We could not parse the JSON body of your request: {exc}", "invalid_request_error"
        )
    except ChatError as exc:
        state.stats.rejected += 1
        return exc.response()
    request_id = uuid.uuid4().hex
    served = await generate(request, state, request_id, ids, params)
    if served.error_status is not None:
        return refusal(served)
    if served.gone:
        return web.Response(status=499)
    return await deliver(
        request, state, served, orjson.dumps(chat_body(state, served, request_id, token_ids=False))
    )


def refusal(served: Served) -> web.Response:
    """An injected refusal or a full queue, as a hosted API answers them."""
    status = served.error_status or 500
    if status == 429:
        return openai_error(
            429, "Rate limit reached for requests (injected).", "requests", headers={"Retry-After": "1"}
        )
    if status == 503:
        return openai_error(503, "The server is overloaded or not ready yet.", "server_error")
    return openai_error(status, "The server had an error while processing your request.", "server_error")


async def models(request: web.Request) -> web.Response:
    card = {"id": model.MODEL_PATH, "object": "model", "created": 0, "owned_by": "sim"}
    return json_response({"object": "list", "data": [card]})


def guarded(path: str) -> bool:
    return True  # a hosted API wants the key everywhere


def unauthorized() -> web.Response:
    return openai_error(401, "Incorrect API key provided.", "invalid_request_error")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)  # hosted APIs have no /health: clients probe this
