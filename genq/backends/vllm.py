"""vLLM's ``POST /v1/completions``: token ids in, token ids out (decision 6).

Facts from vLLM 0.33's source (paths under ``vllm/``):

- ``entrypoints/openai/completion/protocol.py``: ``prompt`` as a flat list of ints is one prompt,
  taken as is (no BOS added); a string is tokenized by the server (its BOS added);
  ``return_token_ids`` (0.10.2 on) puts the output ids in ``choices[0].token_ids``, the EOS or
  stop token kept, and echoes ``prompt_token_ids`` (a text prompt's: the record keeps them);
  ``max_tokens`` defaults to 16; unknown fields are dropped silently.
- ``config/model.py`` get_diff_sampling_param: omitted sampling fields come from the model's
  generation_config: genq sends every one (genq/backends/openai_compat.py).
- ``serve/engine/serving.py``: the ``X-Request-Id`` header names the request, fresh per send.
- ``v1/core/sched/utils.py``: ``stop_reason`` is the matched stop id or string, None for the
  model's EOS; ``finish_reason`` "abort" is HTTP 200 with partial output (a failed attempt),
  "error" comes as a 500.
- ``renderers/params.py``: prompt + max_tokens past max_model_len is clamped (0.32 on) and ends
  "length" early: the record keeps ``finish_length``.
- ``usage.prompt_tokens_details.cached_tokens`` only with ``--enable-prompt-tokens-details``;
  otherwise genq records null, never 0.
- Abort: closing the connection aborts the request (``serve/utils/api_utils.py``
  with_cancellation); there is no abort route by default.
- ``--skip-tokenizer-init`` (0.32, checked on the running server): ``v1/engine/detokenizer.py``
  IncrementalDetokenizer makes no text, so ``choices[0].text`` is ``""`` (not null) beside the ids;
  stop strings are accepted and never matched (the detokenizer matches them); text prompts and
  ``/detokenize`` answer 400 "Tokenizer not available when `skip_tokenizer_init=True`"
  (``renderers/base.py`` get_tokenizer): the probe asks ``/detokenize`` to tell. genq never sends
  ``detokenize`` (``SamplingParams`` has it, ``/v1/completions`` does not take it).

- Load (``--concurrency auto``): ``/metrics`` (always served; ``v1/metrics/loggers.py``) has
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a
  fraction; ``vllm:gpu_cache_usage_perc`` before 0.10) and the counter
  ``vllm:num_preemptions_total``, one sample per engine (DP rank). No batch-size gauge.

SGLang's own ``/v1/completions`` (0.5.20 on, with ``return_token_ids``; ``matched_stop`` there)
works through this backend too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from genq.backends import openai_compat as oai
from genq.backends.base import (
    PROBE_IDS,
    PROBE_SPEC,
    Answer,
    AttemptError,
    Backend,
    Cost,
    ServerInfo,
    ServerRefused,
    decode_ids,
    parse_json,
    text_ids,
    wrong,
)
from genq.backends.load import Load, count, fraction, info_labels, prometheus
from genq.logprobs import Invalid, LogProbs, number
from genq.schema import JobSpec

OPEN_BYTES_MAX = 4  # ids looked back for a character cut short: its bytes after the first, and none
DETOKENIZE_TIMEOUT_S = 10.0


class VLLM(Backend):
    name = "vllm"
    sampling_keys = oai.VLLM_SAMPLING_KEYS
    logprobs = True  # logprobs: K, ids as "token_id:N" with return_tokens_as_token_ids
    skips_tokenizer = False  # started with --skip-tokenizer-init: its "" is no text (the probe says)

    async def probe(self) -> ServerInfo:
        url = self.http.base_url
        card = await oai.model_card(self.http, self.model)
        version = await oai.server_version(self.http)
        self.model = str(card.get("id"))
        body = {
            "model": self.model,
            "prompt": PROBE_IDS,
            "max_tokens": 1,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        status, raw, _ = await self.http.call("POST", "/v1/completions", body, timeout=120)
        if status >= 500:
            raise oai.classify(status, raw, None)
        if status != 200:
            raise oai.refused_probe(url, "/v1/completions", status, raw)
        data = parse_json(raw)
        choices = (data if isinstance(data, dict) else {}).get("choices") or [{}]
        if not isinstance(choices[0], dict) or not isinstance(choices[0].get("token_ids"), list):
            raise ServerRefused(
                f"{url} (vLLM {version or '?'}) answers /v1/completions without token_ids: genq's vllm "
                "backend needs vLLM >= 0.10.2 (return_token_ids) for token-exact records; for text "
                "records use --backend openai-chat"
            )
        max_len = card.get("max_model_len")
        self.skips_tokenizer = await self._skips_tokenizer()
        self.text_always = not self.skips_tokenizer
        self.info = ServerInfo(
            backend=self.name,
            url=url,
            version=version,
            model=self.model,
            context_length=max_len if isinstance(max_len, int) else None,
            seeds=True,  # per-request seeds are honoured (v1/worker/gpu_model_runner.py)
            skips_tokenizer=self.skips_tokenizer,
        )
        if self.skips_tokenizer:
            self.info.notes.append(
                "it skips its tokenizer (--skip-tokenizer-init): its answers are ids with an empty text, "
                "which this worker decodes with the dataset's tokenizer where it has it (records without "
                "it carry no text); it never matches stop strings, so datasets that use them stay queued "
                "for another worker"
            )
        self.check_probe(self._answer(data, PROBE_SPEC))
        return self.info

    async def _skips_tokenizer(self) -> bool:
        """Its /detokenize refuses for want of a tokenizer (renderers/base.py): nothing else says so."""
        status, raw, _ = await self.http.call(
            "POST", "/detokenize", {"model": self.model, "tokens": PROBE_IDS}, timeout=DETOKENIZE_TIMEOUT_S
        )
        return status == 400 and b"skip_tokenizer_init" in raw

    def _answer(self, data: Any, spec: JobSpec) -> Answer:
        got = answer(data, spec)
        if self.skips_tokenizer:  # its "" is the text it never made
            got = dataclasses.replace(got, text=None, detokenized=False)
        return got

    def decode(self, tokenizer: Any, answer: Answer, spec: JobSpec) -> str:
        """As vLLM's detokenizer makes the text (v1/engine/detokenizer.py): for a fast tokenizer,
        tokenizers' DecodeStream primed with the prompt ids (FastIncrementalDetokenizer), one step
        per output id, the stop token left out; it gives out text only where it ends whole, so a
        character begun in the prompt is not the output's and bytes left unfinished at the end never
        come. For another tokenizer (SlowIncrementalDetokenizer), one decode without those last bytes."""
        params = spec.sampling_params
        ids = text_ids(answer, params)
        fast = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        if fast is not None:
            return _streamed(fast, spec.input_ids or [], ids, params.get("skip_special_tokens", True))
        while True:
            text = decode_ids(tokenizer, ids, params)
            if not text.endswith("\ufffd") or not ids:
                return text
            ids = ids[:-1]

    def declines(self, sampling_params: dict[str, Any]) -> str | None:
        if not self.skips_tokenizer or not sampling_params.get("stop"):
            return None
        return (
            "its sampling uses stop strings, which vLLM started with --skip-tokenizer-init accepts and "
            "never matches (its detokenizer would): its jobs stay queued for a worker whose server runs "
            "its tokenizer"
        )

    def body(self, spec: JobSpec) -> dict[str, Any]:
        prompt: list[int] | str | None = spec.input_ids if spec.input_ids is not None else spec.text
        if prompt is None:
            raise AttemptError(
                "bad_request",
                "the vllm backend sends token ids or a plain text prompt: this job has a conversation "
                "(enqueue it with --tokenizer, or use --backend openai-chat)",
                cost=Cost.FATAL,
            )
        return {
            "model": self.model,
            "prompt": prompt,
            **oai.map_sampling(spec.sampling_params, extras=True, explicit=True),
            "max_tokens": spec.max_new_tokens,
            "n": 1,
            "stream": False,
            "return_token_ids": True,
            **({"logprobs": spec.logprobs, "return_tokens_as_token_ids": True} if spec.logprobs else {}),
        }

    async def generate(self, spec: JobSpec, rid: str, timeout: float) -> Answer:
        return self._answer(await oai.post(self.http, "/v1/completions", self.body(spec), rid, timeout), spec)

    async def open_character(self, output_ids: list[int]) -> int:
        """vLLM primes a request's DecodeStream with its prompt ids, and restarts it without them
        when they end inside a character ("Invalid prefix", v1/engine/detokenizer.py
        FastIncrementalDetokenizer): the next piece's text would lose that character. Its own
        ``/detokenize`` says whether the last ids end whole (a character is at most 4 bytes, so 3
        ids back at most); where it cannot say, 0."""
        for back in range(OPEN_BYTES_MAX):
            window = output_ids[max(0, len(output_ids) - back - 4) : len(output_ids) - back]
            text = await self._detokenize(window) if window else None
            if text is None:
                return 0
            if not text.endswith("\ufffd"):
                return back
        return 0  # not a character cut short: bytes that never make one

    async def _detokenize(self, ids: list[int]) -> str | None:
        if (None, "/detokenize") in self._absent:
            return None
        try:
            status, raw, _ = await self.http.call(
                "POST", "/detokenize", {"model": self.model, "tokens": ids}, timeout=DETOKENIZE_TIMEOUT_S
            )
        except AttemptError:
            return None
        if status in (404, 405, 501):
            self._absent.add((None, "/detokenize"))
        try:
            data = parse_json(raw) if status == 200 else None
        except AttemptError:
            return None
        text = data.get("prompt") if isinstance(data, dict) else None
        return text if isinstance(text, str) else None

    async def load(self) -> Load | None:
        raw = await self.load_endpoint("/metrics")
        return from_metrics(raw.decode("utf-8", "replace")) if raw is not None else None


METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:num_preemptions_total",
)


def from_metrics(text: str) -> Load | None:
    """/metrics summed over engines; KV usage averaged over them."""
    found = prometheus(text, METRICS)
    if "vllm:num_requests_running" not in found:
        return None
    engines = max(1, text.count("vllm:num_requests_running{"))
    usage = found.get("vllm:kv_cache_usage_perc", found.get("vllm:gpu_cache_usage_perc"))
    return Load(
        source="/metrics",
        running=count(found.get("vllm:num_requests_running")),
        waiting=count(found.get("vllm:num_requests_waiting")),
        kv_usage=fraction(usage / engines) if usage is not None else None,
        preempted=count(found.get("vllm:num_preemptions_total")),
        kv_tokens=kv_tokens(text),
    )


def kv_tokens(text: str) -> int | None:
    """The KV cache's size in tokens, summed over engines: ``vllm:cache_config_info`` carries the
    CacheConfig's fields as labels (v1/metrics/loggers.py log_metrics_info; config/cache.py
    metrics_info), ``num_gpu_blocks`` blocks of ``block_size`` tokens each. None where a label is
    missing or not a count (the blocks are "None" until the engine has profiled its memory)."""
    sizes = []
    for labels in info_labels(text, "vllm:cache_config_info"):
        blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
        if not (blocks.isdigit() and size.isdigit()):
            return None
        sizes.append(int(blocks) * int(size))
    return sum(sizes) or None


def _streamed(tokenizer: Any, prompt: list[int], ids: list[int], skip_special_tokens: bool) -> str:
    """FastIncrementalDetokenizer's text: a DecodeStream primed with the prompt, stepped per id; one
    that breaks on a prefix that is not UTF-8 starts over without it, as vLLM's does."""
    from tokenizers.decoders import DecodeStream  # a fast tokenizer's own library: there with it

    stream = DecodeStream(ids=prompt, skip_special_tokens=skip_special_tokens)
    out = []
    for token_id in ids:
        try:
            piece = stream.step(tokenizer, token_id)
        except Exception as exc:  # tokenizers raises a bare Exception for "Invalid prefix"
            if not str(exc).startswith("Invalid prefix"):
                raise
            stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            piece = stream.step(tokenizer, token_id)
        out.append(piece or "")
    return "".join(out)


def answer(data: Any, spec: JobSpec) -> Answer:
    choice = oai.first_choice(data)
    reason = oai.finish(choice)
    output_ids = choice.get("token_ids")
    if not isinstance(output_ids, list):
        raise wrong("output_ids", "response has no choices[0].token_ids")
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and spec.input_ids is not None and echoed != spec.input_ids:
        raise wrong("prompt_echo", "prompt_token_ids echoed differ from the prompt sent")
    if spec.input_ids is None and not (isinstance(echoed, list) and all(type(i) is int for i in echoed)):
        raise wrong("prompt_echo", "a text prompt's answer has no choices[0].prompt_token_ids")
    prompt_tokens, completion_tokens, cached = oai.usage_counts(data)
    asked = spec.max_new_tokens
    cut = len(output_ids) if reason == "length" and len(output_ids) < asked else None
    return Answer(
        output_ids=output_ids,
        text=choice.get("text"),
        finish_reason=reason,
        matched_stop=oai.matched_stop(choice, reason, output_ids),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached,
        finish_length=cut if cut is not None else (asked if reason == "length" else None),
        logprobs=_logprobs(choice.get("logprobs"), output_ids, spec.logprobs) if spec.logprobs else None,
        prompt_ids=echoed if spec.input_ids is None else None,  # a text prompt: the server's own ids
    )


def _logprobs(data: Any, output_ids: list[int], k: int) -> LogProbs:
    """choices[0].logprobs: token_logprobs per output token, top_logprobs as {"token_id:N": logprob}
    (the sampled token may be among them or beside them: the K best are kept)."""
    if not isinstance(data, dict) or len(data.get("token_logprobs") or []) != len(output_ids):
        raise wrong("logprobs", "response has no logprobs for every output token")
    rows = data.get("top_logprobs") or [{} for _ in output_ids]
    try:  # a null or huge logprob is data (genq/logprobs.py); a shape that is not vLLM's is not
        top = [
            sorted(((number(v), int(t.rsplit(":", 1)[1])) for t, v in (row or {}).items()), key=_best)[:k]
            for row in rows
        ]
        token = [number(x) for x in data["token_logprobs"]]
    except (Invalid, TypeError, ValueError, AttributeError) as exc:
        raise wrong("logprobs", f"logprobs not in vLLM's shape: {exc}") from exc
    return LogProbs(token, [[i for _, i in row] for row in top], [[v for v, _ in row] for row in top])


def _best(pair: tuple[float | None, int]) -> tuple[float, int]:
    """Best first; a null logprob sorts last."""
    return (-pair[0] if pair[0] is not None else float("inf"), -pair[1])
