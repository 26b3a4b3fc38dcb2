"""The engine interface: one small abstract class, one module per engine API beside it.

A backend turns a job into a request, sends it, normalizes the answer into the record's fields
(:class:`Answer`) and classifies every failure (:class:`AttemptError` with its :class:`Cost`);
it also probes its server once at start (:class:`ServerInfo`) and refuses one it cannot use
with one clear line (:class:`ServerRefused`). The worker's retries, gate, heartbeats and
records see only this interface, never an engine's name.
"""

from __future__ import annotations

import asyncio
import base64
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar
from urllib.parse import unquote, urlsplit

import aiohttp
import orjson

from genq.backends.load import LOAD_TIMEOUT_S, Load
from genq.logprobs import LogProbs
from genq.schema import JobSpec
from genq.settings import server_api_key

# Engines close idle keep-alive connections after a few seconds (SGLang's uvicorn: 5 s,
# SGLANG_TIMEOUT_KEEP_ALIVE); close ours sooner so a pooled connection is never reused just as
# the server drops it.
KEEPALIVE_S = 4.0
PROBE_TIMEOUT_S = 60.0
# SGLang's /health runs a 1-token generation and gives up after 20 s (SGLANG_HEALTH_CHECK_TIMEOUT):
# a busy server may take that long to say it is fine.
HEALTH_TIMEOUT_S = 30.0
# The largest answer body read (the worker's --max-response-mb): a 32k-token answer with top-20
# logprobs is a few MiB of JSON; a body past this is not an answer, and is not read into memory.
MAX_BODY_MB = 64
MAX_BODY_BYTES = MAX_BODY_MB << 20
# The probe's generation: one greedy token after ids every vocabulary has. Its answer is checked
# against this as a job's is against the job (Backend.check_probe).
PROBE_IDS = [1, 2, 3]
PROBE_SPEC = JobSpec(
    dataset="genq-probe",
    row=0,
    sample=0,
    id="genq-probe",
    sampling_params={"max_new_tokens": 1, "temperature": 0.0},
    input_ids=PROBE_IDS,
)


class Cost(Enum):
    """What a failed send costs the job (decision 7; the whole table is docs/failures.md)."""

    FREE = "free"  # the server did no work (refused, queue full, 429): retry, costs nothing
    ATTEMPT = "attempt"  # the prompt's own try failed: counts against --max-attempts
    SERVER = "server"  # the server failed while working on it: spared unless it served others meanwhile
    FATAL = "fatal"  # this request can never succeed (400): the job fails at once
    AUTH = "auth"  # the server refused our credentials: the worker waits, no job pays
    # A replica behind SGLang's router could not be reached: spared whatever the others answered
    # (the router's other replicas serve on), bounded by --max-spared like SERVER.
    REPLICA = "replica"


@dataclass
class AttemptError(Exception):
    """One send that did not produce a record.

    ``kind`` is the error class written to ``errors.jsonl``; ``message`` is the server's own
    words where it gave any.
    """

    kind: str
    message: str
    status: int | None = None
    cost: Cost = Cost.ATTEMPT
    retry_after: float | None = None
    # Counts toward "the server is down" (closes the gate after a few in a row).
    down: bool = False
    # The connection died mid-request: a crash if /health fails right after, else this request's.
    dropped: bool = False
    # How an answer is wrong (``bad_response``), in the same words whatever the job: a run of
    # answers wrong the same way is the server's configuration, not the jobs' fault (worker/gate.py).
    rule: str | None = None

    def __str__(self) -> str:
        status = f" {self.status}" if self.status is not None else ""
        return f"{self.kind}{status}: {self.message}"


class ServerRefused(Exception):
    """The server cannot serve genq (wrong engine or version, bad key): one line says why."""


@dataclass
class ServerInfo:
    """What the probe learned about a server; None where the server does not say."""

    backend: str
    url: str
    version: str | None = None
    model: str | None = None
    context_length: int | None = None  # prompt + new tokens must stay below this
    max_input_len: int | None = None  # prompts must be shorter than this
    vocab_size: int | None = None
    seeds: bool | None = None  # honours a per-request seed (reproducible samples)
    token_exact: bool = True  # output ids are the server's own, not re-tokenized text
    # It runs no tokenizer (SGLang's --skip-tokenizer-init): answers carry ids, no text; None: unknown.
    skips_tokenizer: bool | None = False
    notes: list[str] = field(default_factory=list)  # said once at worker start, and in status

    def prompt_limit(self) -> int | None:
        """The context length for genq's length checks: prompt + max_new_tokens must be below it."""
        if self.context_length is not None:
            return self.context_length
        # SGLang: max_req_input_len = min(context - 1, KV capacity - 1) - 5, so the context is at
        # least this much: a bound that never lets a prompt through that the server would refuse.
        return self.max_input_len + 6 if self.max_input_len is not None else None

    def summary(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "version": self.version,
            "model": self.model,
            "context_length": self.prompt_limit(),
            "seeds": self.seeds,
            "token_exact": self.token_exact,
            "skips_tokenizer": self.skips_tokenizer,
        }


@dataclass
class Answer:
    """A finished generation, in the record's terms."""

    output_ids: list[int] | None
    text: str | None
    finish_reason: str  # "stop" | "length"
    matched_stop: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    finish_length: int | None = None  # where the server cut max_new_tokens (a length finish)
    token_exact: bool = True
    # The server's own split of the answer (chat APIs with a reasoning parser); None: genq splits
    # the text itself by the dataset's think markers.
    reasoning: str | None = None
    content: str | None = None
    prompt_ids: list[int] | None = None  # the prompt as the server rendered it (chat APIs that say)
    logprobs: LogProbs | None = None  # when the job asked for them (genq/logprobs.py)
    # The server made ``text``. False: it skips its tokenizer (SGLang's --skip-tokenizer-init) and
    # answers ids alone; the worker decodes them where it has the dataset's tokenizer.
    detokenized: bool = True

    def check(self, spec: JobSpec, vocab_size: int | None, text_always: bool) -> None:
        """Raise a ``bad_response`` AttemptError (an attempt charged: bounded like any other) if
        this is not an answer the engine could have given ``spec``: a server's body is untrusted
        input, and a wrong answer must never become a record. Output ids are token ids (whole
        numbers in ``[0, vocab_size)`` when the vocabulary is known), no more of them than
        ``max_new_tokens`` (every engine counts the stop token it generates among them: SGLang
        scheduler's ``check_finished``, vLLM's ``max_tokens``, llama.cpp's ``n_predict``), a known
        finish reason, token counts that are counts, and the text where the API always gives one."""
        if self.finish_reason not in ("stop", "length"):
            raise wrong("finish_reason", f"finish_reason {_brief(self.finish_reason)}, not stop or length")
        for name in ("prompt_tokens", "completion_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise wrong("counts", f"{name} is {_brief(value)}, not a count")
        if (text_always or self.text is not None) and not isinstance(self.text, str):
            raise wrong("text", f"the answer's text is {_brief(self.text)}, not a string")
        ids = self.output_ids
        if ids is None:
            return
        if not all(type(i) is int for i in ids) or (ids and min(ids) < 0):
            bad = next(i for i in ids if type(i) is not int or i < 0)
            raise wrong("ids", f"output_ids holds {_brief(bad)}, not a token id")
        if vocab_size is not None and ids and max(ids) >= vocab_size:
            raise wrong("vocabulary", f"output id {max(ids)} is outside the vocabulary [0, {vocab_size})")
        if len(ids) > spec.max_new_tokens:
            raise wrong(
                "max_new_tokens", f"{len(ids)} output ids for a max_new_tokens of {spec.max_new_tokens}"
            )


def text_ids(answer: Answer, sampling_params: dict[str, Any]) -> list[int]:
    """The output ids an engine's text is made of: the matched stop token left out unless the job
    keeps it (``no_stop_trim``; vLLM's include_stop_str_in_output); it is the last id. SGLang:
    managers/detokenizer_manager.py trim_matched_stop ("we can always assume"); vLLM:
    v1/engine/detokenizer.py update (stop_terminated)."""
    ids = answer.output_ids or []
    if type(answer.matched_stop) is int and ids and not sampling_params.get("no_stop_trim"):
        return ids[:-1]
    return ids


def decode_ids(tokenizer: Any, ids: list[int], sampling_params: dict[str, Any]) -> str:
    """``ids`` decoded with the job's ``skip_special_tokens`` and ``spaces_between_special_tokens``
    (true by default in SGLang and vLLM)."""
    return tokenizer.decode(
        ids,
        skip_special_tokens=sampling_params.get("skip_special_tokens", True),
        spaces_between_special_tokens=sampling_params.get("spaces_between_special_tokens", True),
    )


def wrong(rule: str, message: str) -> AttemptError:
    """A ``bad_response``: an answer no engine could have given, wrong in the way ``rule`` names."""
    return AttemptError("bad_response", message, rule=rule)


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "…"


def split_credentials(url: str) -> tuple[str, str | None]:
    """``url`` without its userinfo, and the ``Authorization: Basic`` value it carried (a proxy in
    front of the server may ask for one). Only the bare URL is ever stored or shown: records, the
    worker hash, status, the dashboard and logs all take ``base_url``."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
    return parts._replace(netloc=host).geturl(), f"Basic {token}"


class Http:
    """The worker's connection pool to one server, with its API key (sent as a Bearer token; else
    the Basic credentials of the URL, if it has any).

    No pool or read timeout here: the caller bounds each attempt (decision 8). aiohttp, not
    httpx (decision 3): its CPU cost per request stays flat at hundreds in flight.
    """

    def __init__(self, url: str, max_connections: int = 16, max_body: int = MAX_BODY_BYTES) -> None:
        base_url, self._basic = split_credentials(url)
        self.base_url = base_url.rstrip("/")
        self._max_connections = max_connections
        self.max_body = max_body
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Http:
        connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=KEEPALIVE_S)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=15)
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        key = server_api_key()  # read each time: a rotated key file is picked up
        if key:
            headers["Authorization"] = f"Bearer {key}"
        elif self._basic:
            headers["Authorization"] = self._basic
        return {**headers, **(extra or {})}

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float,
        headers: dict[str, str] | None = None,
        at: str | None = None,
    ) -> tuple[int, bytes, Any]:
        """(status, body, headers) of one request; transport failures as AttemptError. ``at``: another
        server's base URL, reached through this pool (the replicas behind SGLang's router)."""
        assert self._session is not None, "use Http as an async context manager"
        data = orjson.dumps(body) if body is not None else None
        try:
            async with asyncio.timeout(timeout):
                async with self._session.request(
                    method, (at or self.base_url) + path, data=data, headers=self.headers(headers)
                ) as resp:
                    return resp.status, await self._read(resp), resp.headers
        except TimeoutError as exc:
            raise AttemptError("timeout", f"no response within {timeout:.0f} s") from exc
        except aiohttp.ClientConnectorError as exc:
            # Nothing was sent: the server is not there. Costs nothing; a few in a row close the gate.
            raise AttemptError("connection", str(exc), cost=Cost.FREE, down=True) from exc
        except aiohttp.ClientPayloadError as exc:
            raise AttemptError("bad_response", f"truncated body: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise AttemptError(
                "connection", f"{type(exc).__name__}: {exc}", cost=Cost.SERVER, dropped=True
            ) from exc

    async def _read(self, resp: aiohttp.ClientResponse) -> bytes:
        """The body, read no further than ``max_body`` bytes: a server's answer is untrusted, and
        one that never ends must not take the worker's memory with it (the connection is closed)."""
        limit = self.max_body
        if resp.content_length is not None and resp.content_length <= limit:
            return await resp.read()
        chunks, size = [], 0
        async for chunk in resp.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > limit:
                break
            chunks.append(chunk)
        if size > limit:
            resp.close()
            raise AttemptError(
                "bad_response",
                f"a body over {limit:,} bytes (the worker's --max-response-mb): not read further",
            )
        return b"".join(chunks)

    async def get_json(
        self, path: str, timeout: float = PROBE_TIMEOUT_S, at: str | None = None
    ) -> tuple[int, Any]:
        """(status, parsed JSON or None) of a GET, for probes."""
        status, raw, _ = await self.call("GET", path, timeout=timeout, at=at)
        try:
            return status, orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            return status, None


class Backend(ABC):
    """One engine API. Subclasses are small: a body builder, a parser, a classifier, a probe."""

    name: ClassVar[str]
    health_path: ClassVar[str] = "/health"
    # genq's sampling keys (SGLang's names, genq/sampling.py) this engine has an equivalent for.
    sampling_keys: ClassVar[frozenset[str]]
    # What a prompt is sent as: "ids" (genq renders conversations) or "messages" (the server does).
    sends: ClassVar[str] = "ids"
    # Returns top-K log-probabilities per output token when a job asks (enqueue --logprobs).
    logprobs: ClassVar[bool] = False
    # The API's answer always carries the text (a chat answer may be a tool call, or all reasoning);
    # a server may say at its probe that it does not (SGLang's --skip-tokenizer-init).
    text_always: bool = True

    def __init__(self, http: Http, model: str | None = None) -> None:
        self.http = http
        self.model = model  # the model to ask for, where a server serves several
        self.info: ServerInfo | None = None
        self._absent: set[tuple[str | None, str]] = set()  # (server, load endpoint) not served

    @abstractmethod
    async def probe(self) -> ServerInfo:
        """Read the server's facts and send one tiny generation; raise ServerRefused if unusable."""

    @abstractmethod
    async def generate(self, spec: JobSpec, rid: str, timeout: float) -> Answer:
        """One send of ``spec`` under request id ``rid``; raise AttemptError on any failure."""

    async def answer(self, spec: JobSpec, rid: str, timeout: float) -> Answer:
        """:meth:`generate`, its answer checked (:meth:`Answer.check`) before anything is built of it."""
        answer = await self.generate(spec, rid, timeout)
        answer.check(spec, self.info.vocab_size if self.info is not None else None, self.text_always)
        return answer

    def check_probe(self, answer: Answer) -> None:
        """The probe's 1-token generation checked as every answer is (:meth:`Answer.check`): a server
        whose every answer would be refused is found before a job pays for it."""
        answer.check(PROBE_SPEC, self.info.vocab_size if self.info is not None else None, self.text_always)

    def decode(self, tokenizer: Any, answer: Answer, spec: JobSpec) -> str:
        """The text the server would have made of ``answer`` to ``spec`` had it run its tokenizer,
        for a server that does not (``answer.detokenized`` False): the worker decodes with the
        dataset's tokenizer. This default is one decode of the ids the text is made of; engines
        whose detokenizer works otherwise (incrementally, with the prompt as context) say how."""
        return decode_ids(tokenizer, text_ids(answer, spec.sampling_params), spec.sampling_params)

    def wrong_answers_hint(self, exc: AttemptError) -> str:
        """What to check on a server whose every answer is wrong the way ``exc`` is (the gate says it
        once as it holds the worker's jobs). Engines name the flag they know of."""
        return "check the server's engine, version and flags against genq's docs/engines.md"

    def declines(self, sampling_params: dict[str, Any]) -> str | None:
        """Why this server can never serve a dataset of these sampling settings (its jobs are left
        queued for another worker), or None. Most engines take every key genq maps for them."""
        return None

    async def abort(self, rid: str) -> bool:
        """Stop the server's work on ``rid`` after giving up on it; False when the server could not
        be told (unreachable: the worker tells it again once it is back). Default: nothing beyond
        closing the connection, which the timeout already did (vLLM and llama.cpp abort on that)."""
        return True

    async def open_character(self, output_ids: list[int]) -> int:
        """How many of the last ``output_ids`` are the bytes of a character not yet whole, on an
        engine whose detokenizer loses its context where a continued prompt ends inside one: a
        piece is cut before them, and they are generated again (worker/runner.py). Default 0: the
        engine detokenizes a continuation with the output before it as context, as one request
        would (SGLang: a window of the ids before it, managers/detokenizer_manager.py; llama.cpp)."""
        return 0

    async def load(self) -> Load | None:
        """The server's load now, from its own signals (genq/backends/load.py); None where it
        publishes none (hosted APIs). Cheap: --concurrency auto asks about once a second. Raises
        AttemptError when the server cannot be reached."""
        return None

    async def load_endpoint(self, path: str, at: str | None = None) -> bytes | None:
        """The body of a load endpoint of the server (or of the one at ``at``), or None: not now
        (an error status), or never (404, 501: not served by that server or its configuration,
        remembered so it is asked once)."""
        if (at, path) in self._absent:
            return None
        status, raw, _ = await self.http.call("GET", path, timeout=LOAD_TIMEOUT_S, at=at)
        if status in (404, 405, 501):
            self._absent.add((at, path))
        return raw if status == 200 else None

    async def healthy(self) -> bool:
        return await self.answers_health()

    async def answers_health(self, at: str | None = None) -> bool:
        """The server (or the one at ``at``) answers its health path with 200."""
        try:
            status, _, _ = await self.http.call("GET", self.health_path, timeout=HEALTH_TIMEOUT_S, at=at)
        except AttemptError:
            return False
        return status == 200


def error_message(raw: bytes) -> str:
    """The server's own words from an error body, whatever shape the engine gives it."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw[:2000].decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in data:
            return str(data["message"])
        if isinstance(err, str):
            return err
        if "detail" in data:
            return str(data["detail"])
    return raw[:2000].decode("utf-8", "replace")


def retry_after(headers: Any) -> float | None:
    value = headers.get("Retry-After") if headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def from_status(status: int, raw: bytes, headers: Any) -> AttemptError:
    """The generic meaning of an HTTP error status; engines refine it (their own 400s and 503s)."""
    message, after = error_message(raw), retry_after(headers)
    if status in (401, 403):
        return AttemptError("auth", message, status, cost=Cost.AUTH)
    if status in (400, 413, 422):
        return AttemptError("bad_request", message, status, cost=Cost.FATAL)
    if status == 429:
        return AttemptError("rate_limited", message, status, cost=Cost.FREE, retry_after=after)
    if status == 503:
        return AttemptError("unavailable", message, status, cost=Cost.SERVER, retry_after=after, down=True)
    if status >= 500:
        return AttemptError("server_error", message, status, retry_after=after)
    return AttemptError("http_error", message, status, retry_after=after)


def parse_json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise AttemptError(
            "bad_response", f"body is not JSON ({len(raw)} bytes): {exc}", rule="json"
        ) from exc
