"""llama.cpp's ``llama-server``, ``POST /completion``: token ids in, token ids out.

Facts from the llama.cpp vendored in llama-cpp-python 0.3.36 (``vendor/llama.cpp/tools/server/``),
checked against the running server:

- ``server-common.cpp`` tokenize_input_subprompt: a prompt that is a list of numbers is taken as
  is (no BOS added). ``return_tokens: true`` puts the output ids in ``tokens``; on an end of
  sequence the EOS id is the last one (``server-context.cpp`` process_token appends before it
  tests for EOS), and on a stop word the token holding it is kept though ``content`` is cut.
- ``stop_type``: ``eos`` and ``word`` are stops, ``limit`` a length finish. With context shift off
  (the default) prompt + output never pass the slot's context: the answer is a 200 with
  ``truncated: true`` and fewer tokens, which genq records as cut (``finish_length``), never as a
  clean stop.
- Context per slot = ``-c`` / ``--parallel``, capped at the model's training context;
  ``/props`` → ``default_generation_settings.n_ctx``. A prompt of n_ctx tokens or more is a 400
  ``exceed_context_size_error``; ids outside [0, n_vocab) a 400 "Prompt contains invalid tokens"
  (but ids of 2^31 and more wrap around to valid ones: genq checks ids against ``n_vocab`` from
  ``/v1/models`` before sending).
- ``server-schema.cpp``: omitted sampling fields take the server's defaults (temperature 0.8,
  top_k 40, top_p 0.95, min_p 0.05, a random seed, ``n_predict`` −1 = until the context is
  full): genq sends each one. Unknown fields are ignored; out-of-range values clamped.
- ``/health`` 503 while loading. Abort = closing the connection, which a busy server notices
  only after a second without any result (``server-context.cpp`` HTTP_POLLING_SECONDS): genq
  always sends a bounded ``n_predict``.
- ``--api-key``: everything but ``/health`` answers 401 without it.
- Load (``--concurrency auto``): ``/slots`` (on unless ``--no-slots``; ``server-context.cpp``
  get_slots, ``server_slot::to_json``) lists each slot with ``is_processing``: busy slots are the
  running batch, the slot count its size; requests beyond it wait unseen. ``/metrics`` (only with
  ``--metrics``; ``server-task.cpp`` to_metrics) adds ``llamacpp:requests_processing`` and
  ``llamacpp:requests_deferred`` (the waiting ones). No KV usage, no preemption.
"""

from __future__ import annotations

from typing import Any

import orjson

from genq.backends.base import (
    PROBE_IDS,
    PROBE_SPEC,
    Answer,
    AttemptError,
    Backend,
    Cost,
    ServerInfo,
    ServerRefused,
    error_message,
    from_status,
    parse_json,
    wrong,
)
from genq.backends.load import Load, count, prometheus
from genq.schema import JobSpec

# genq's sampling keys -> /completion's, and the neutral value sent when the dataset set none.
KEYS = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "top_k": ("top_k", 0),  # <= 0: off
    "min_p": ("min_p", 0.0),
    "repetition_penalty": ("repeat_penalty", 1.0),
    "presence_penalty": ("presence_penalty", 0.0),
    "frequency_penalty": ("frequency_penalty", 0.0),
    "sampling_seed": ("seed", None),
    "stop": ("stop", None),
    "ignore_eos": ("ignore_eos", None),
}  # anything else (stop_token_ids, min_new_tokens, ...) has no equivalent: the job fails, naming it


class LlamaCpp(Backend):
    name = "llamacpp"
    sampling_keys = frozenset({"max_new_tokens", *KEYS})

    async def probe(self) -> ServerInfo:
        url = self.http.base_url
        status, props = await self.http.get_json("/props")
        if status in (401, 403):
            raise ServerRefused(
                f"{url} refused genq's API key on /props ({status}): set GENQ_SERVER_API_KEY or "
                "GENQ_SERVER_API_KEY_FILE to the server's --api-key"
            )
        if status == 503:
            raise from_status(status, b"loading", None)
        settings = props.get("default_generation_settings") if isinstance(props, dict) else None
        if status != 200 or not isinstance(settings, dict):
            raise ServerRefused(f"{url} does not answer /props like llama.cpp's llama-server (HTTP {status})")
        _, models = await self.http.get_json("/v1/models")
        card = models["data"][0] if isinstance(models, dict) and models.get("data") else {}
        meta = card.get("meta") if isinstance(card.get("meta"), dict) else {}
        body = {"prompt": PROBE_IDS, "n_predict": 1, "temperature": 0.0, "return_tokens": True}
        status, raw, _ = await self.http.call("POST", "/completion", body, timeout=120)
        if status >= 500:
            raise from_status(status, raw, None)
        if status != 200:
            raise ServerRefused(f"{url} refused a 1-token /completion ({status}): {error_message(raw)}")
        data = parse_json(raw)
        if not isinstance((data if isinstance(data, dict) else {}).get("tokens"), list):
            raise ServerRefused(f"{url} answers /completion without tokens: genq needs return_tokens")
        self.info = ServerInfo(
            backend=self.name,
            url=url,
            version=str(props.get("build_info") or "") or None,
            model=str(props.get("model_alias") or props.get("model_path") or "") or None,
            context_length=_int(settings.get("n_ctx")),
            max_input_len=_int(settings.get("n_ctx")),
            vocab_size=_int(meta.get("n_vocab")),
            seeds=True,  # seeded sampling is honoured (batching aside)
        )
        self.check_probe(answer(data, PROBE_SPEC))
        return self.info

    def body(self, spec: JobSpec) -> dict[str, Any]:
        ids = spec.input_ids
        if ids is None:
            raise AttemptError(
                "bad_request", "the llamacpp backend sends token ids: this job has none", cost=Cost.FATAL
            )
        vocab = self.info.vocab_size if self.info is not None else None
        if vocab is not None and ids and max(ids) >= vocab:  # ids are >= 0 (JobSpec.from_kwargs)
            bad = next(i for i in ids if i >= vocab)
            raise AttemptError(
                "bad_request", f"token id {bad} is outside the vocabulary [0, {vocab})", cost=Cost.FATAL
            )
        body: dict[str, Any] = {"prompt": ids, "n_predict": spec.max_new_tokens, "return_tokens": True}
        for key, value in spec.sampling_params.items():
            if key == "max_new_tokens":
                continue
            if key not in KEYS:
                raise AttemptError(
                    "bad_request", f"sampling key {key!r} has no llama.cpp equivalent", cost=Cost.FATAL
                )
            body[KEYS[key][0]] = value
        if body.get("temperature") == 0 and "top_k" not in spec.sampling_params:
            # Greedy: the one most likely token, whatever top_k says. Top-k off (0) would leave the
            # whole vocabulary to the sampler chain, which then runs expf over every id for every
            # token of every slot on the server's one main thread (src/llama-sampler.cpp
            # llama_sampler_temp_impl, llama_sampler_dist_apply): with Kimi's 163,840 ids that cost
            # the server half its speed (bench/real_engine.py --n-vocab). top_k 1 cuts the list to
            # that token first, as cheap as the server's own default of 40.
            body["top_k"] = 1
        for name, neutral in KEYS.values():
            if neutral is not None:
                body.setdefault(name, neutral)
        return body

    async def generate(self, spec: JobSpec, rid: str, timeout: float) -> Answer:
        status, raw, headers = await self.http.call("POST", "/completion", self.body(spec), timeout=timeout)
        if status != 200:
            raise from_status(status, raw, headers)
        return answer(parse_json(raw), spec)

    async def load(self) -> Load | None:
        """Busy slots from /slots, the deferred requests from /metrics when it is on."""
        slots = await self.load_endpoint("/slots")
        metrics = await self.load_endpoint("/metrics")
        found = prometheus(metrics.decode("utf-8", "replace"), METRICS) if metrics is not None else {}
        busy = from_slots(slots) if slots is not None else None
        if busy is None and not found:
            return None
        return Load(
            source="+".join(p for p, raw in (("/slots", slots), ("/metrics", metrics)) if raw is not None),
            running=busy[0] if busy else count(found.get("llamacpp:requests_processing")),
            waiting=count(found.get("llamacpp:requests_deferred")),
            max_running=busy[1] if busy else None,
        )


METRICS = ("llamacpp:requests_processing", "llamacpp:requests_deferred")


def from_slots(raw: bytes) -> tuple[int, int] | None:
    """(busy slots, slots) from /slots' list of slots."""
    try:
        slots = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        return None
    return sum(1 for s in slots if s.get("is_processing")), len(slots)


def answer(data: Any, spec: JobSpec) -> Answer:
    if not isinstance(data, dict):
        raise wrong("object", "response is not a JSON object")
    tokens = data.get("tokens")
    if not isinstance(tokens, list):
        raise wrong("output_ids", "response has no tokens")
    stop_type = data.get("stop_type")
    if stop_type not in ("eos", "word", "limit"):
        raise wrong("finish_reason", f"unexpected stop_type {stop_type!r}")
    prompt_tokens, completion_tokens = data.get("tokens_evaluated"), data.get("tokens_predicted")
    if not isinstance(prompt_tokens, int) or not isinstance(completion_tokens, int):
        raise wrong("counts", "tokens_evaluated/tokens_predicted missing or not integers")
    timings = data.get("timings") if isinstance(data.get("timings"), dict) else {}
    truncated = bool(data.get("truncated"))
    if truncated or stop_type == "limit":
        reason, matched = "length", None
    else:
        reason = "stop"
        matched = data.get("stopping_word") if stop_type == "word" else (tokens[-1] if tokens else None)
    return Answer(
        output_ids=tokens,
        text=data.get("content"),
        finish_reason=reason,
        matched_stop=matched,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=_int(timings.get("cache_n")),
        finish_length=len(tokens) if reason == "length" else None,
    )


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
