"""SGLang's native ``POST /generate``: token ids in, token ids out (decision 6).

Facts from SGLang's own source (the wheels 0.4.6 to 0.5.23, paths under ``sglang/srt/``):

- ``entrypoints/http_server.py``: ``/server_info`` (only ``/get_server_info`` up to ~0.5.5) is the
  resolved server args plus scheduler info; ``context_length`` is null unless the server got
  ``--context-length``, ``max_req_input_len`` is always there (prompts must be shorter).
  ``/model_info`` (``/get_model_info`` before). ``/health`` stays 200 under ``--api-key``.
- ``managers/io_struct.py`` / ``sampling/sampling_params.py``: ``max_new_tokens`` defaults to
  128, so genq always sends it; unknown sampling keys are an error.
- ``managers/tokenizer_manager.py``: ``output_ids`` untrimmed (the EOS or stop token is its last
  id); absent in 0.4.x, and in 0.5.1 led by up to 5 prompt tokens (``detokenizer_manager.py``
  passed the detokenizer's window), right from 0.5.5: genq needs 0.5.5 or newer;
  ``meta_info.finish_reason`` is ``{"type": "stop", "matched": id|str}``,
  ``{"type": "length", "length": n}`` (n: the max_new_tokens the scheduler actually used, which
  may be lower than asked) or ``{"type": "abort", "message"}`` with HTTP 200.
- ``managers/scheduler.py``: a sampled token outside the vocabulary ends the request as
  ``{"type": "stop", "matched": "NaN happened"}``; ``SGLANG_REQ_RUNNING_TIMEOUT`` answers a long
  request 503 "Request running timeout reached."; ``--max-queued-requests`` answers 503 "The
  request queue is full."; retraction under memory pressure is a 503 too.
- ``managers/tokenizer_manager.py``: a rid still held answers 400 "Duplicate request ID
  detected" (0.5.15 on); ``/abort_request`` aborts every rid that starts with the one given.
- ``--skip-tokenizer-init`` (SGLang's advice for ``input_ids`` workloads): no tokenizer or
  detokenizer in the server. ``managers/tokenizer_manager.py`` (``_handle_batch_output``, the
  ``BatchTokenIDOutput`` branch) answers ``{"output_ids", "meta_info"}`` with no ``text`` key;
  ``/server_info`` (``utils/common.py`` build_server_info: the resolved server args) says
  ``skip_tokenizer_init``; ``sampling/sampling_params.py`` (raise_if_tokenizer_required) refuses
  ``stop``, ``stop_regex`` and ``min_new_tokens`` > 0, which need the tokenizer.
- ``managers/detokenizer_manager.py``: the ``text`` of a server that runs its tokenizer is made
  incrementally. The scheduler hands a request's ids over every SGLANG_FORCE_STREAM_INTERVAL (50,
  ``environ.py``) output tokens and at its end (``scheduler_components/output_streamer.py``),
  after the last 5 prompt ids (INIT_INCREMENTAL_DETOKENIZATION_OFFSET,
  ``managers/schedule_batch.py``); each handover decodes the ids from the last commit on and keeps
  what lies past the context's own text, committing it where it does not end in U+FFFD; the end
  trims the matched stop token unless ``no_stop_trim`` (trim_matched_stop), and decodes with the
  request's ``skip_special_tokens`` and ``spaces_between_special_tokens``. genq makes the text of
  a server that skips its tokenizer the same way (:meth:`SGLang.decode`).
- ``sampling/sampling_batch_info.py``: ``sampling_seed`` is honoured only with
  ``--enable-deterministic-inference`` (shown as ``enable_deterministic_inference`` in
  /server_info), accepted and ignored otherwise.
- No endpoint tells the vocabulary size; ``utils/auth.py`` exempts ``/health*`` from the API key.
- Load (``--concurrency auto``): ``entrypoints/v1_loads.py`` GET ``/v1/loads`` answers
  ``{"loads": [one dict per DP rank]}`` with ``num_running_reqs``, ``num_waiting_reqs``,
  ``token_usage``, ``max_running_requests``, ``max_total_num_tokens``
  (``managers/load_snapshot.py`` LoadSnapshot) but no cumulative retraction count; with
  ``--enable-metrics``, ``/metrics`` (``observability/metrics_collector.py``) has
  ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``,
  ``sglang:max_total_num_tokens`` and the counter ``sglang:num_retracted_requests_total``
  (incremented in ``managers/scheduler.py`` only when metrics are on).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from typing import Any

import orjson

from genq import sampling
from genq.backends import sglang_router
from genq.backends.base import (
    PROBE_IDS,
    Answer,
    AttemptError,
    Backend,
    Cost,
    Http,
    ServerInfo,
    ServerRefused,
    decode_ids,
    error_message,
    from_status,
    parse_json,
    text_ids,
    wrong,
)
from genq.backends.load import Load, count, fraction, prometheus, summed
from genq.logprobs import Invalid, LogProbs, number
from genq.schema import JobSpec

NAN_MATCHED = "NaN happened"
MIN_VERSION = "0.5.5"
# The sampling keys a server without its tokenizer refuses (sampling/sampling_params.py
# raise_if_tokenizer_required): matching a stop string, or holding EOS back, needs the tokenizer.
NEEDS_TOKENIZER = ("stop", "stop_regex", "min_new_tokens")
# How SGLang's detokenizer sees a request (managers/detokenizer_manager.py): after this many prompt
# ids of context, a handover of the ids every so many output tokens (SGLANG_FORCE_STREAM_INTERVAL;
# a server started with another value makes its text at other points, rarely another text).
DETOKENIZER_CONTEXT_IDS = 5
DETOKENIZER_EVERY = 50


class SGLang(Backend):
    name = "sglang"
    sampling_keys = frozenset(sampling.KEYS)  # genq's names are SGLang's
    logprobs = True  # return_logprob + top_logprobs_num (managers/io_struct.py)

    # -- probe ------------------------------------------------------------------------------

    def __init__(self, http: Http, model: str | None = None) -> None:
        super().__init__(http, model)
        # Behind SGLang's router (sglang_router.py): the replicas it lists, and the one whose facts
        # the probe read (None: genq cannot reach any, so it can neither abort nor ask them).
        self.router = False
        self.replicas: list[str] = []
        self.reached: str | None = None
        # /server_info's skip_tokenizer_init at the last probe: None where genq cannot ask (behind
        # a router whose replicas it cannot reach), so an answer without text may be right.
        self.skips_tokenizer: bool | None = False

    async def _server_info(self, at: str | None = None) -> tuple[int, Any]:
        status, info = await self.http.get_json("/server_info", at=at)
        if status == 404:  # SGLang <= 0.5.5 has only the old name, which the router answers too
            status, info = await self.http.get_json("/get_server_info", at=at)
        return status, info

    async def _replica_info(self) -> dict[str, Any]:
        """The router's replicas, and the server facts of the first that answers genq."""
        self.replicas = await sglang_router.replica_urls(self.http)
        for replica in self.replicas:
            with contextlib.suppress(AttemptError):
                status, info = await self._server_info(at=replica)
                if status == 200 and isinstance(info, dict) and "max_req_input_len" in info:
                    self.reached = replica
                    return info
        return {}

    def _router_note(self) -> str:
        listed = ", ".join(self.replicas) or "none listed"
        if self.reached:
            return (
                f"behind SGLang's router, {len(self.replicas)} replicas ({listed}); version, context "
                f"and seeds read from {self.reached}; aborts and health checks go to the replicas; "
                + sglang_router.RETRIES_NOTE
            )
        return (
            f"behind SGLang's router, whose replicas ({listed}) genq cannot reach: version, context "
            "length and seed support unknown (give enqueue --context-length); a request given up on "
            "is abandoned by closing its connection, as the router forwards no /abort_request; "
            + sglang_router.RETRIES_NOTE
        )

    async def probe(self) -> ServerInfo:
        url = self.http.base_url
        status, info = await self._server_info()
        self.router = status == 200 and sglang_router.is_router(info)
        if self.router:
            info = await self._replica_info()
        if status in (401, 403):
            raise ServerRefused(f"{url} refused genq's API key on /server_info ({status}): {_key_hint()}")
        known = self.router or isinstance(info, dict) and "max_req_input_len" in info
        if status != 200 or not known:
            raise ServerRefused(
                f"{url} does not answer /server_info like SGLang (HTTP {status}); "
                "is it an SGLang server? (other engines: --backend vllm, openai-chat or llamacpp)"
            )
        at = self.reached  # behind the router, a replica's own answers (None: this server's)
        _, model = await self.http.get_json("/model_info", at=at)
        if not isinstance(model, dict):
            _, model = await self.http.get_json("/get_model_info", at=at)
        model = model if isinstance(model, dict) else {}
        # context_length is null unless the server got --context-length; the OpenAI model card
        # has the context the tokenizer manager enforces (max_model_len).
        _, cards = await self.http.get_json("/v1/models", at=at)
        card = cards["data"][0] if isinstance(cards, dict) and cards.get("data") else {}
        version = _str(info.get("version"))
        # None: behind a router whose replicas genq cannot ask.
        asked = "max_req_input_len" in info
        seeds = bool(info.get("enable_deterministic_inference")) if asked else None
        self.skips_tokenizer = info.get("skip_tokenizer_init") is True if asked else None
        self.text_always = self.skips_tokenizer is False
        result = ServerInfo(
            backend=self.name,
            url=url,
            version=version,
            model=_str(model.get("served_model_name") or model.get("model_path") or info.get("model_path")),
            context_length=_int(info.get("context_length")) or _int(card.get("max_model_len")),
            max_input_len=_int(info.get("max_req_input_len")),
            seeds=seeds,
            skips_tokenizer=self.skips_tokenizer,
        )
        if self.router:
            result.notes.append(self._router_note())
        if self.skips_tokenizer:
            result.notes.append(
                "it skips its tokenizer (--skip-tokenizer-init): its answers are ids without text, which "
                "this worker decodes with the dataset's tokenizer where it has it (records without it "
                "carry no text); it refuses stop strings and min_new_tokens, so datasets that use them "
                "stay queued for another worker"
            )
        await self._probe_generate(result)
        if seeds is False:
            result.notes.append(
                "it ignores sampling_seed (started without --enable-deterministic-inference): "
                "samples that rely on seeds are not reproducible"
            )
        self.info = result
        return result

    async def _probe_generate(self, info: ServerInfo) -> None:
        """One tiny generation: the key works, and the answer carries output_ids (SGLang >= 0.5)."""
        body = {
            "input_ids": PROBE_IDS,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "rid": f"genq-probe.{secrets.token_hex(6)}",
        }
        status, raw, _ = await self.http.call("POST", "/generate", body, timeout=120)
        if status in (401, 403):
            raise ServerRefused(
                f"{info.url} refused genq's API key on /generate "
                f"({status}: {error_message(raw)}): {_key_hint()}"
            )
        if status == 503:  # starting, unhealthy, overloaded: wait for it, do not refuse it
            raise from_status(status, raw, None)
        if status >= 500:  # up but failing: the jobs' own attempts will tell
            info.notes.append(f"its 1-token probe generation failed ({status}: {error_message(raw)})")
            return
        if status != 200:
            raise ServerRefused(f"{info.url} refused a 1-token /generate ({status}): {error_message(raw)}")
        data = parse_json(raw)
        output_ids = data.get("output_ids") if isinstance(data, dict) else None
        if not isinstance(output_ids, list):
            raise ServerRefused(
                f"{info.url} (SGLang {info.version or '?'}) answers /generate without output_ids: "
                f"genq needs SGLang >= {MIN_VERSION} for token-exact records (0.4.x returns text only)"
            )
        completion = (data.get("meta_info") or {}).get("completion_tokens")
        if len(output_ids) != completion:
            # 0.5.1 built output_ids from the detokenizer's window: up to 5 prompt tokens lead them.
            raise ServerRefused(
                f"{info.url} (SGLang {info.version or '?'}) returns {len(output_ids)} output_ids for "
                f"{completion} completion tokens: its output_ids are not the completion's "
                f"(SGLang 0.5.1 prefixes prompt tokens); genq needs SGLang >= {MIN_VERSION}"
            )
        self.check_probe(answer(data))

    # -- generate ---------------------------------------------------------------------------

    def body(self, spec: JobSpec, rid: str) -> dict[str, Any]:
        body: dict[str, Any] = {"sampling_params": spec.sampling_params, "rid": rid}
        if spec.logprobs:
            # Output tokens only (logprob_start_len -1 is the default); no text per token.
            body.update(return_logprob=True, top_logprobs_num=spec.logprobs)
        if spec.input_ids is not None:
            body["input_ids"] = spec.input_ids
        else:
            body["text"] = spec.text
        return body

    async def generate(self, spec: JobSpec, rid: str, timeout: float) -> Answer:
        body = self.body(spec, rid)
        status, raw, headers = await self.http.call("POST", "/generate", body, timeout=timeout)
        if status != 200:
            raise classify(status, raw, headers)
        return answer(parse_json(raw))

    def decode(self, tokenizer: Any, answer: Answer, spec: JobSpec) -> str:
        """The text SGLang's detokenizer makes of the answer (see the module's docstring): a
        character begun in the prompt and ended in the output is not the output's, and bytes that
        end a handover unfinished wait for the next."""
        params = spec.sampling_params
        output = answer.output_ids or []
        prompt = spec.input_ids or []
        ids = prompt[max(0, len(prompt) - DETOKENIZER_CONTEXT_IDS) :] + output
        start = len(ids) - len(output)
        surr, read = 0, start  # the context the next handover is decoded after: ids[surr:read]
        text = ""
        for handed in range(DETOKENIZER_EVERY, len(output), DETOKENIZER_EVERY):
            upto = start + handed
            new = _past(tokenizer, ids[surr:read], ids[surr:upto], params)
            if new and not new.endswith("\ufffd"):
                text, surr, read = text + new, read, upto
        last = text_ids(dataclasses.replace(answer, output_ids=ids[surr:]), params)
        return text + _past(tokenizer, ids[surr:read], last, params)

    def wrong_answers_hint(self, exc: AttemptError) -> str:
        if exc.rule != "text":
            return super().wrong_answers_hint(exc)
        said = {True: "true", False: "false", None: "not readable"}[self.skips_tokenizer]
        return (
            "it answers without text: is it started with --skip-tokenizer-init? genq reads "
            f"skip_tokenizer_init from its /server_info ({said} at the last probe) and reads it again "
            "before it resumes"
        )

    def declines(self, sampling_params: dict[str, Any]) -> str | None:
        if not self.skips_tokenizer:
            return None
        used = [k for k in NEEDS_TOKENIZER if sampling_params.get(k) not in (None, [], "", 0)]
        if not used:
            return None
        return (
            f"its sampling uses {', '.join(used)}, which SGLang started with --skip-tokenizer-init "
            "refuses (they need its tokenizer): its jobs stay queued for a worker whose server runs its "
            "tokenizer"
        )

    async def load(self) -> Load | None:
        """/v1/loads for the batch, /metrics (--enable-metrics) for retractions; either alone
        where the other is not served. Behind the router (which serves neither), the sum over the
        replicas genq reaches: their batches are the router's."""
        if not self.router:
            return await self._load_at(None)
        if not self.reached:
            return None
        return summed([load for load in await asyncio.gather(*map(self._load_at, self.replicas)) if load])

    async def _load_at(self, at: str | None) -> Load | None:
        try:
            loads = await self.load_endpoint("/v1/loads?include=core", at)
            metrics = await self.load_endpoint("/metrics", at)
        except AttemptError:
            if self.router:  # a replica that is down carries no load; the others still steer
                return None
            raise
        counted = from_metrics(metrics.decode("utf-8", "replace")) if metrics is not None else None
        batch = from_loads(loads) if loads is not None else None
        if batch is None or counted is None:
            return batch or counted
        return dataclasses.replace(batch, source="/v1/loads+/metrics", preempted=counted.preempted)

    async def abort(self, rid: str) -> bool:
        """``POST /abort_request``: the GPU stops working on a request genq gave up on. Behind the
        router, to every replica genq can reach (the router has no such route)."""
        if not self.router:
            return await self._abort_at(rid, None)
        if not self.reached:
            return True  # nobody genq can tell: closing the connection is all there is
        return all(await asyncio.gather(*(self._abort_at(rid, replica) for replica in self.replicas)))

    async def _abort_at(self, rid: str, at: str | None) -> bool:
        """Told (any answer: an unknown rid is no error), or False: the server was out of reach."""
        try:
            await self.http.call("POST", "/abort_request", {"rid": rid}, timeout=10, at=at)
        except AttemptError:
            return False
        return True

    async def healthy(self) -> bool:
        """Behind the router, whose own /health answers 200 whatever its replicas do: any replica
        answers its /health (the list read again each time), or, when genq cannot reach them, the
        router's own health checks found one healthy."""
        if not self.router:
            return await super().healthy()
        if not self.reached:
            return await sglang_router.ready_replicas(self.http) > 0
        self.replicas = await sglang_router.replica_urls(self.http) or self.replicas
        return any(await asyncio.gather(*(self.answers_health(replica) for replica in self.replicas)))


def from_loads(raw: bytes) -> Load | None:
    """/v1/loads summed over DP ranks; the fullest rank's token_usage."""
    try:
        ranks = orjson.loads(raw).get("loads")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
        return None
    return summed(
        [
            Load(
                source="/v1/loads",
                running=count(r.get("num_running_reqs")),
                waiting=count(r.get("num_waiting_reqs")),
                kv_usage=fraction(r.get("token_usage")),
                max_running=count(r.get("max_running_requests")),
                kv_tokens=count(r.get("max_total_num_tokens")),
            )
            for r in ranks
        ]
    )


METRICS = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:max_total_num_tokens",
    "sglang:num_retracted_requests_total",
)


def from_metrics(text: str) -> Load | None:
    found = prometheus(text, METRICS)
    if "sglang:num_running_reqs" not in found:
        return None
    return Load(
        source="/metrics",
        running=count(found.get("sglang:num_running_reqs")),
        waiting=count(found.get("sglang:num_queue_reqs")),
        kv_usage=fraction(found.get("sglang:token_usage")),
        preempted=_retracted(found.get("sglang:num_retracted_requests_total")),
        kv_tokens=count(found.get("sglang:max_total_num_tokens")),
    )


def _retracted(value: float | None) -> int:
    """SGLang's metrics run in prometheus_client's multiprocess mode, which shows a counter only
    once it has counted (observability/metrics_collector.py; seen on the real 0.5.23: no line for
    it on a server that has retracted nothing): a /metrics without it has retracted nothing yet."""
    return count(value) or 0


def _past(tokenizer: Any, context: list[int], ids: list[int], params: dict[str, Any]) -> str:
    """The text of ``ids`` past that of their first ids, ``context``: the detokenizer's new text."""
    return decode_ids(tokenizer, ids, params)[len(decode_ids(tokenizer, context, params)) :]


def classify(status: int, raw: bytes, headers: Any) -> AttemptError:
    """SGLang's error statuses, refined by its own messages."""
    exc = from_status(status, raw, headers)
    message = exc.message
    if status == 400 and "Duplicate request ID" in message:
        # genq never reuses a rid; should it happen anyway, the old request is still running.
        exc.kind, exc.cost = "duplicate_rid", Cost.ATTEMPT
    elif status == 503 and "queue is full" in message:
        exc.kind, exc.cost, exc.down = "overloaded", Cost.FREE, False  # refused before any work
    elif status == 503 and "running timeout" in message:
        exc.kind, exc.down = "server_timeout", False  # the server is up; this generation ran too long
    elif status == 503 and "Retracted" in message:
        exc.down = False  # memory pressure: the server is up
    elif status == 500 and sglang_router.unreachable(raw):
        # SGLang's router could not reach a replica: that replica's outage, not the prompt's.
        exc.kind, exc.cost, exc.down = "connection", Cost.REPLICA, True
    return exc


def answer(data: Any) -> Answer:
    """The record's fields from a /generate body, or AttemptError if it is not a finished generation."""
    meta = data.get("meta_info") if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        raise wrong("meta_info", "response has no meta_info")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind == "abort":
        raise AttemptError("aborted", str(finish.get("message") or "request aborted by the server"), 200)
    if kind == "stop" and finish.get("matched") == NAN_MATCHED:
        # The sampler produced NaN/an id outside the vocabulary: not a real completion.
        raise AttemptError("nan", "the server's sampler hit NaN (finish_reason matched 'NaN happened')", 200)
    if kind not in ("stop", "length"):
        raise wrong("finish_reason", f"unexpected finish_reason {finish!r}")
    output_ids = data.get("output_ids")
    if not isinstance(output_ids, list):
        raise wrong("output_ids", "response has no output_ids")
    for name in ("prompt_tokens", "completion_tokens"):
        if not isinstance(meta.get(name), int):
            raise wrong("counts", f"meta_info.{name} missing or not an integer")
    text = data.get("text")
    return Answer(
        output_ids=output_ids,
        text=text,
        detokenized=text is not None,  # None: the server skips its tokenizer (else Answer.check refuses it)
        finish_reason=kind,
        matched_stop=finish.get("matched"),
        prompt_tokens=meta["prompt_tokens"],
        completion_tokens=meta["completion_tokens"],
        cached_tokens=_int(meta.get("cached_tokens")),
        finish_length=_int(finish.get("length")) if kind == "length" else None,
        logprobs=_logprobs(meta, len(output_ids)) if "output_token_logprobs" in meta else None,
    )


def _logprobs(meta: dict[str, Any], n: int) -> LogProbs:
    """tokenizer_manager.py: output_token_logprobs = [[logprob, id, text], ...] and
    output_top_logprobs = [[[logprob, id, text] × K], ...], one entry per output token."""
    token, top = meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs") or []
    if len(token) != n or (top and len(top) != n):
        raise wrong("logprobs", f"{len(token)} logprobs for {n} output tokens")
    rows = top or [[] for _ in token]
    try:  # a null or huge logprob is data (genq/logprobs.py); a shape that is not SGLang's is not
        return LogProbs(
            [number(t[0]) for t in token],
            [[int(x[1]) for x in row] for row in rows],
            [[number(x[0]) for x in row] for row in rows],
        )
    except (Invalid, TypeError, ValueError, IndexError, KeyError) as exc:
        raise wrong("logprobs", f"logprobs not in SGLang's shape: {exc}") from exc


def _key_hint() -> str:
    return "set GENQ_SERVER_API_KEY or GENQ_SERVER_API_KEY_FILE to the server's --api-key"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return str(value) if value is not None else None
