"""Any OpenAI-compatible ``POST /v1/chat/completions``: text in, text out.

For servers that render the chat template themselves and for hosted endpoints. The server turns
the row's messages into tokens, so the prompt ids are the server's, not genq's: records say
``token_exact: false``, and carry ``output_ids`` only when the server returned them (vLLM's
``return_token_ids``, sent only when ``/version`` says the server is vLLM: a hosted API refuses a
field it does not know).

- Reasoning: ``message.reasoning`` (vLLM 0.16 on) or ``message.reasoning_content`` (SGLang, vLLM
  up to 0.15), split by the server's reasoning parser.
- Token counts from ``usage``; ``cached_tokens`` from ``usage.prompt_tokens_details`` if there.
- Hosted APIs answer 429 with ``Retry-After``: retried without charging the job, after waiting.
- Sampling: OpenAI's fields; top_k, min_p, repetition_penalty and the other vLLM extras only
  when the server is vLLM (a job asking for one elsewhere fails at once, naming it). Against vLLM
  every field is sent explicitly, so its generation_config decides nothing.
"""

from __future__ import annotations

from typing import Any

from genq.backends import openai_compat as oai
from genq.backends.base import Answer, AttemptError, Backend, Cost, ServerInfo, wrong
from genq.schema import JobSpec


class OpenAIChat(Backend):
    name = "openai-chat"
    sampling_keys = oai.CHAT_KEYS  # a vLLM server takes vLLM's too (oai.VLLM_SAMPLING_KEYS)
    health_path = "/v1/models"  # hosted APIs have no /health
    sends = "messages"
    text_always = False  # content is null when the answer is a tool call, or reasoning only

    async def probe(self) -> ServerInfo:
        url = self.http.base_url
        card = await oai.model_card(self.http, self.model)
        self.model = str(card.get("id"))
        self.vllm_version = await oai.server_version(self.http)
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_completion_tokens": 1,
        }
        status, raw, _ = await self.http.call("POST", "/v1/chat/completions", body, timeout=120)
        if status >= 500 or status == 429:
            raise oai.classify(status, raw, None)
        if status != 200:
            raise oai.refused_probe(url, "/v1/chat/completions", status, raw)
        max_len = card.get("max_model_len")
        self.info = ServerInfo(
            backend=self.name,
            url=url,
            version=f"vllm {self.vllm_version}" if self.vllm_version else None,
            model=self.model,
            context_length=max_len if isinstance(max_len, int) else None,
            seeds=None,  # whatever the endpoint does with seed, it does not say
            token_exact=False,
            notes=["records are text in, text out (token_exact: false): the server renders the prompt"],
        )
        return self.info

    def body(self, spec: JobSpec) -> dict[str, Any]:
        messages = spec.messages or ([{"role": "user", "content": spec.text}] if spec.text else None)
        if messages is None:
            raise AttemptError(
                "bad_request",
                "the openai-chat backend sends messages: this job holds only token ids (enqueue the "
                "dataset's conversations with --backend openai-chat)",
                cost=Cost.FATAL,
            )
        vllm = self.vllm_version is not None
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            **oai.map_sampling(spec.sampling_params, extras=vllm, explicit=vllm),
            "max_completion_tokens": spec.max_new_tokens,
            "n": 1,
            "stream": False,
        }
        if vllm:
            body["return_token_ids"] = True
        if spec.tools is not None:
            body["tools"] = spec.tools
        if spec.chat_template_kwargs:  # vLLM and SGLang pass them to the template (a hosted API refuses)
            body["chat_template_kwargs"] = spec.chat_template_kwargs
        return body

    async def generate(self, spec: JobSpec, rid: str, timeout: float) -> Answer:
        return answer(await oai.post(self.http, "/v1/chat/completions", self.body(spec), rid, timeout), spec)


def answer(data: Any, spec: JobSpec) -> Answer:
    choice = oai.first_choice(data)
    reason = oai.finish(choice)
    message = choice.get("message")
    if not isinstance(message, dict):
        raise wrong("message", "response has no choices[0].message")
    content = message.get("content")
    reasoning = message.get("reasoning", message.get("reasoning_content"))
    prompt_tokens, completion_tokens, cached = oai.usage_counts(data)
    output_ids = choice.get("token_ids")
    output_ids = output_ids if isinstance(output_ids, list) else None
    asked = spec.max_new_tokens
    return Answer(
        output_ids=output_ids,
        text=content,
        finish_reason=reason,
        matched_stop=oai.matched_stop(choice, reason, output_ids),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached,
        finish_length=min(completion_tokens, asked) if reason == "length" else None,
        token_exact=False,
        reasoning=reasoning if isinstance(reasoning, str) else None,
        content=content,
        prompt_ids=data.get("prompt_token_ids") if isinstance(data.get("prompt_token_ids"), list) else None,
    )
