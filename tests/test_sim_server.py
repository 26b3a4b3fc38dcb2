"""The SGLang simulator, driven as a real process over real HTTP.

Each server runs as `python -m genq.sim --port 0 ...` in a subprocess, as demos and load tests run it,
so the CLI, the printed URL line and SIGTERM handling are tested too. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from click.testing import CliRunner

from genq.sim import cli as sim_cli
from genq.sim import model
from genq.sim.config import SimConfig
from genq.sim.scheduler import BatchScheduler
from tests.helpers import sim_stats, wait_until

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 10.0


@contextlib.contextmanager
def running_sim(*flags: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start the simulator, yield its base URL, then SIGTERM it and require a clean exit 0."""
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "genq.sim", "--port", "0", *flags],
            cwd=REPO_ROOT,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        try:
            yield _read_url(proc, stderr)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
                pytest.fail("sim-server did not stop within its timeout after SIGTERM")
            assert proc.stdout is not None
            proc.stdout.close()
            stderr.seek(0)
            assert code == 0, stderr.read().decode(errors="replace")


def _read_url(proc: subprocess.Popen[str], stderr: Any) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    prefix = "sim-server listening on "
    if not line.startswith(prefix):
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)
        stderr.seek(0)
        pytest.fail(f"no URL line from sim-server: {line!r}\n{stderr.read().decode(errors='replace')}")
    return line[len(prefix) :].strip()


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """One plain server (no latency, no faults) shared by the tests that only read from it."""
    with running_sim() as url:
        yield url


@pytest.fixture
def start_sim() -> Iterator[Any]:
    """Start servers with given flags (and environment); all are stopped at the end of the test.

    This module's own, not conftest's `genq sim-server` launcher: it runs the `python -m genq.sim` entry
    point, can pass environment variables (GENQ_SIM_*), and requires exit 0 on SIGTERM."""
    with contextlib.ExitStack() as stack:
        yield lambda *flags, env=None: stack.enter_context(running_sim(*flags, env=env))


class Reply:
    def __init__(self, status: int, body: bytes, headers: Any) -> None:
        self.status, self.raw, self.headers = status, body, headers

    @property
    def json(self) -> Any:
        return orjson.loads(self.raw)


async def _request(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any = None,
    timeout: float = REQUEST_TIMEOUT_S,
) -> Reply:
    data = None if body is None else orjson.dumps(body)
    headers = {"Content-Type": "application/json"}
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with session.request(method, url, data=data, headers=headers, timeout=client_timeout) as resp:
        return Reply(resp.status, await resp.read(), resp.headers)


def call(method: str, url: str, body: Any = None, timeout: float = REQUEST_TIMEOUT_S) -> Reply:
    """One HTTP request on a fresh connection, bounded by `timeout`."""

    async def go() -> Reply:
        async with aiohttp.ClientSession() as session:
            return await _request(session, method, url, body, timeout)

    return asyncio.run(go())


def generate(url: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> Reply:
    return call("POST", f"{url}/generate", body, timeout)


async def stats_when(
    session: aiohttp.ClientSession, url: str, cond: Any, what: str, timeout: float = REQUEST_TIMEOUT_S
) -> dict[str, Any]:
    """/sim/stats once ``cond`` holds of it, polled inside a running scenario; after ``timeout``
    seconds the test fails, naming ``what`` (helpers.wait_until for the event loop)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = (await _request(session, "GET", f"{url}/sim/stats")).json
        if cond(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; /sim/stats: {stats}")
        await asyncio.sleep(0.02)


# --- the model, no server ---


def test_model_is_deterministic_and_prefix_stable() -> None:
    ids = model.tokenize("a prompt about the sea")
    assert ids == model.tokenize("a  prompt about\tthe sea")
    assert all(100 <= i < model.VOCAB_SIZE for i in ids)
    full = model.generate(ids, {"max_new_tokens": 1000})
    assert full == model.generate(ids, {"max_new_tokens": 1000})
    assert 16 <= full.completion_tokens <= 512
    assert full.output_ids[-1] == model.EOS_TOKEN_ID
    assert full.finish_reason == {"type": "stop", "matched": model.EOS_TOKEN_ID}
    assert full.text == model.detokenize(full.output_ids)
    cut = model.generate(ids, {"max_new_tokens": 5})
    assert cut.output_ids == full.output_ids[:5]
    assert cut.finish_reason == {"type": "length", "length": 5}
    seeded = model.generate(ids, {"max_new_tokens": 1000, "sampling_seed": 1})
    assert seeded.output_ids != full.output_ids
    neutral = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    assert model.generate(ids, {"max_new_tokens": 1000, **neutral}) == full
    # A setting away from neutral changes the answer: a server applying a default the client
    # did not ask for is caught by tests that recompute outputs.
    assert model.generate(ids, {"max_new_tokens": 1000, "temperature": 0.6}) != full


def test_model_stop_token_ids_ignore_eos_and_lengths() -> None:
    ids = model.tokenize("stop here please")
    full = model.generate(ids, {"max_new_tokens": 1000})
    stop_id = full.output_ids[3]
    stopped = model.generate(ids, {"max_new_tokens": 1000, "stop_token_ids": [stop_id]})
    assert stopped.output_ids == full.output_ids[:4]
    assert stopped.finish_reason == {"type": "stop", "matched": stop_id}
    assert stopped.text == model.detokenize(full.output_ids[:3])
    long = model.generate(ids, {"max_new_tokens": 700, "ignore_eos": True})
    assert long.completion_tokens == 700 and model.EOS_TOKEN_ID not in long.output_ids
    fixed = model.generate(ids, {"max_new_tokens": 100}, min_len=10, max_len=10)
    assert fixed.completion_tokens == 10 and fixed.output_ids[-1] == model.EOS_TOKEN_ID


# --- /generate on a plain server ---


def test_output_equals_model_for_input_ids(base_url: str) -> None:
    ids = list(range(1000, 1040))
    params = {"max_new_tokens": 600, "sampling_seed": 7, "temperature": 0.7}
    reply = generate(base_url, {"input_ids": ids, "sampling_params": params, "rid": "r-ids"})
    assert reply.status == 200
    expected = model.generate(ids, params)
    body = reply.json
    assert body["output_ids"] == expected.output_ids
    assert body["text"] == expected.text
    meta = body["meta_info"]
    assert meta["id"] == "r-ids"
    assert meta["finish_reason"] == expected.finish_reason
    assert meta["prompt_tokens"] == len(ids)
    assert meta["completion_tokens"] == expected.completion_tokens
    assert {"cached_tokens", "e2e_latency"} <= set(meta)

    short = generate(base_url, {"input_ids": ids, "sampling_params": {**params, "max_new_tokens": 4}})
    assert short.json["output_ids"] == expected.output_ids[:4]
    assert short.json["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert len(short.json["meta_info"]["id"]) == 32  # a uuid hex when no rid is given


def test_text_prompt(base_url: str) -> None:
    text = "Write a haiku about queues."
    reply = generate(base_url, {"text": text, "sampling_params": {"max_new_tokens": 300}})
    assert reply.status == 200
    expected = model.generate(model.tokenize(text), {"max_new_tokens": 300})
    assert reply.json["output_ids"] == expected.output_ids
    assert reply.json["text"] == expected.text
    assert reply.json["meta_info"]["prompt_tokens"] == len(model.tokenize(text))


def test_default_max_new_tokens_is_128(base_url: str) -> None:
    reply = generate(base_url, {"text": "long answer", "sampling_params": {"ignore_eos": True}})
    assert reply.status == 200
    assert reply.json["meta_info"]["completion_tokens"] == 128
    assert reply.json["meta_info"]["finish_reason"] == {"type": "length", "length": 128}


def test_unknown_sampling_key_is_refused_as_the_release_does(base_url: str, start_sim: Any) -> None:
    reply = generate(base_url, {"text": "hi", "sampling_params": {"max_tokens": 10}})
    assert reply.status == 400  # 0.5.22+: the schema gate's plain string
    assert reply.json["error"].startswith("unknown field `max_tokens`, expected one of `max_new_tokens`")
    old = start_sim("--sglang-version", "0.5.20")
    reply = generate(old, {"text": "hi", "sampling_params": {"max_tokens": 10}})
    assert (reply.status, reply.raw) == (500, b"Internal Server Error")  # an uncaught TypeError


@pytest.mark.parametrize(
    "body",
    [
        {"sampling_params": {}},
        {"text": "hi", "sampling_params": {"top_p": 0.0}},
        {"text": "hi", "sampling_params": {"top_k": 0}},
        {"text": "hi", "sampling_params": {"sampling_seed": 2**63}},
    ],
    ids=["no-prompt", "bad-top-p", "bad-top-k", "seed-past-int64"],
)
def test_invalid_requests_are_400(base_url: str, body: dict[str, Any]) -> None:
    reply = generate(base_url, body)
    assert reply.status == 400
    assert reply.json["error"]["message"]


def test_input_ids_win_over_text(base_url: str) -> None:
    """io_struct.py accepts both; the tokenizer manager uses input_ids."""
    reply = generate(base_url, {"text": "hi there", "input_ids": [100, 101], "sampling_params": {}})
    assert reply.status == 200
    assert reply.json["meta_info"]["prompt_tokens"] == 2


@pytest.mark.parametrize("bad_id", [model.VOCAB_SIZE, -1])
def test_ids_outside_the_vocabulary_crash_the_server(bad_id: int) -> None:
    """SGLang never checks them: they reach the embedding, and the GPU faults. The server dies with
    every connection; it does not answer 400."""
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "genq.sim", "--port", "0"],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        url = _read_url(proc, stderr)
        with pytest.raises(aiohttp.ClientError):
            generate(url, {"input_ids": [100, bad_id]})
        assert proc.wait(STOP_TIMEOUT_S) == 134
        assert proc.stdout is not None
        proc.stdout.close()


def test_context_overflow_is_400_with_sglang_message(base_url: str) -> None:
    ids = [500] * 100
    reply = generate(base_url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 8093}})
    assert reply.status == 400
    assert reply.json["error"]["message"] == (
        "Requested token count exceeds the model's maximum context length of 8192 tokens. "
        "You requested a total of 8193 tokens: 100 tokens from the input messages and 8093 tokens "
        "for the completion. Please reduce the number of tokens in the input messages or the "
        "completion to fit within the limit."
    )
    # Exactly the context passes the check (0.5.15+: ">") and is lowered silently by the scheduler.
    reply = generate(
        base_url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 8092, "ignore_eos": True}}
    )
    assert reply.status == 200
    assert reply.json["meta_info"]["finish_reason"] == {"type": "length", "length": 8192 - 2 - 100}


def test_prompt_at_max_req_input_len_is_refused_by_the_scheduler(start_sim: Any) -> None:
    url = start_sim("--context-length", "512")
    ok = generate(url, {"input_ids": [500] * 505, "sampling_params": {"max_new_tokens": 1}})
    assert ok.status == 200
    reply = generate(url, {"input_ids": [500] * 506, "sampling_params": {"max_new_tokens": 1}})
    assert reply.status == 400
    assert reply.json["error"]["message"] == (
        "Input length (506 tokens) exceeds the maximum allowed length (506 tokens). "
        "Use a shorter input or enable --allow-auto-truncate."
    )


def test_max_new_tokens_limit_lowers_silently_and_length_says_so(start_sim: Any) -> None:
    url = start_sim("--max-new-tokens-limit", "50")
    reply = generate(
        url, {"input_ids": [500] * 10, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    )
    assert reply.json["meta_info"]["finish_reason"] == {"type": "length", "length": 50}
    assert len(reply.json["output_ids"]) == 50


def test_health_and_info_endpoints(base_url: str) -> None:
    for path in ("/health", "/health_generate"):
        reply = call("GET", base_url + path)
        assert (reply.status, reply.raw) == (200, b"")
    for path in ("/model_info", "/get_model_info"):
        info = call("GET", base_url + path).json
        assert info["model_path"] == model.MODEL_PATH
        assert info["is_generation"] is True
        assert "tokenizer_path" in info
    for path in ("/server_info", "/get_server_info"):
        info = call("GET", base_url + path).json
        assert info["context_length"] is None, "null unless --context-length was given"
        assert info["max_req_input_len"] == model.DEFAULT_CONTEXT_LENGTH - 6
        assert info["model_path"] == model.MODEL_PATH
        assert info["max_running_requests"] > 0
        assert info["version"] == "0.5.23"
        assert info["enable_deterministic_inference"] is True
        assert "vocab_size" not in info, "SGLang tells no vocabulary size"


def test_context_length_flag_is_shown_and_enforced(start_sim: Any) -> None:
    url = start_sim("--context-length", "1024")
    info = call("GET", url + "/server_info").json
    assert (info["context_length"], info["max_req_input_len"]) == (1024, 1018)


@pytest.mark.parametrize(
    ("version", "routes"),
    [
        ("0.4.6", {"/get_server_info"}),
        ("0.5.5", {"/get_server_info"}),
        ("0.5.15", {"/server_info", "/get_server_info"}),
    ],
)
def test_info_routes_by_release(start_sim: Any, version: str, routes: set[str]) -> None:
    url = start_sim("--sglang-version", version)
    present = {p for p in ("/server_info", "/get_server_info") if call("GET", url + p).status == 200}
    assert present == routes


def test_old_releases_answer_as_they_did(start_sim: Any) -> None:
    ids = [500] * 10
    url = start_sim("--sglang-version", "0.4.6")
    assert "output_ids" not in generate(url, {"input_ids": ids}).json
    url = start_sim("--sglang-version", "0.5.1")
    reply = generate(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert reply.json["output_ids"][:5] == ids[-5:], "0.5.1 leads output_ids with prompt tokens"
    assert len(reply.json["output_ids"]) == 8 and reply.json["meta_info"]["completion_tokens"] == 3
    seeded = generate(url, {"input_ids": ids, "sampling_params": {"sampling_seed": 1}})
    assert seeded.status == 500, "sampling_seed is an unexpected keyword before 0.5.5"


def test_api_key_guards_everything_but_health(start_sim: Any) -> None:
    url = start_sim("--api-key", "k1")
    assert call("GET", url + "/health").status == 200
    for method, path in (("POST", "/generate"), ("GET", "/server_info"), ("GET", "/model_info")):
        reply = call(method, url + path, {"input_ids": [100]} if method == "POST" else None)
        assert (reply.status, reply.json) == (401, {"error": "Unauthorized"})

    async def with_key() -> int:
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer k1"}) as session:
            return (await _request(session, "POST", url + "/generate", {"input_ids": [100]})).status

    assert asyncio.run(with_key()) == 200


def test_seeds_are_ignored_without_deterministic_inference(start_sim: Any) -> None:
    url = start_sim("--no-deterministic-inference")
    assert call("GET", url + "/server_info").json["enable_deterministic_inference"] is False
    plain = generate(url, {"input_ids": [500] * 10}).json["output_ids"]
    seeded = generate(url, {"input_ids": [500] * 10, "sampling_params": {"sampling_seed": 7}}).json[
        "output_ids"
    ]
    assert plain == seeded


# --- health and fault switches ---


def test_unhealthy_server_answers_503_until_it_recovers(start_sim: Any) -> None:
    url = start_sim()
    assert call("POST", f"{url}/sim/health", {"healthy": False}).status == 200
    assert call("GET", f"{url}/health").status == 503
    assert call("GET", f"{url}/health_generate").status == 503
    assert generate(url, {"text": "hi"}).status == 503
    assert call("POST", f"{url}/sim/health", {"healthy": True}).status == 200
    assert call("GET", f"{url}/health").status == 200
    assert generate(url, {"text": "hi"}).status == 200
    assert call("GET", f"{url}/sim/stats").json["unhealthy"] == 1


def test_fault_rates_change_at_run_time(start_sim: Any) -> None:
    url = start_sim()
    assert call("POST", f"{url}/sim/faults", {"error_500": 1.0}).json["error_500"] == 1.0
    reply = generate(url, {"text": "hi"})
    assert reply.status == 500
    assert reply.json["message"] == "Internal server error (injected)"
    call("POST", f"{url}/sim/faults", {"error_500": 0.0})
    assert generate(url, {"text": "hi"}).status == 200
    assert call("POST", f"{url}/sim/faults", {"bogus": 1.0}).status == 400


@pytest.mark.parametrize(
    ("flag", "status", "message"),
    [
        ("--fail-500", 500, "Internal server error (injected)"),
        ("--fail-503", 503, "The request queue is full."),
        ("--fail-429", 429, None),
    ],
)
def test_error_faults(start_sim: Any, flag: str, status: int, message: str | None) -> None:
    url = start_sim(flag, "1.0")
    reply = generate(url, {"text": "hi"})
    assert reply.status == status
    assert reply.json["object"] == "error" and reply.json["code"] == status
    if message is not None:
        assert reply.json["message"] == message
    if status == 429:
        assert reply.headers["Retry-After"] == "1"
    stats = call("GET", f"{url}/sim/stats").json
    assert stats["generations"] == 0 and stats["completed"] == 0


def test_fault_rate_from_environment(start_sim: Any) -> None:
    url = start_sim(env={"GENQ_SIM_FAIL_429": "1.0"})
    assert generate(url, {"text": "hi"}).status == 429


def test_reset_fault_is_a_connection_error_after_the_work(start_sim: Any) -> None:
    url = start_sim("--fail-reset", "1.0")
    with pytest.raises(aiohttp.ClientConnectionError):
        generate(url, {"text": "hi"})
    stats = call("GET", f"{url}/sim/stats").json
    assert stats["faults"]["reset"] == 1
    assert stats["generations"] == 1 and stats["completed"] == 0


def test_truncate_fault_is_a_payload_error(start_sim: Any) -> None:
    url = start_sim("--fail-truncate", "1.0")
    with pytest.raises(aiohttp.ClientPayloadError):
        generate(url, {"text": "hi", "sampling_params": {"max_new_tokens": 50}})
    stats = call("GET", f"{url}/sim/stats").json
    assert stats["faults"]["truncate"] == 1
    assert stats["generations"] == 1 and stats["completed"] == 0


def test_abort_fault_is_http_200_with_abort_finish_reason(start_sim: Any) -> None:
    url = start_sim("--fail-abort", "1.0")
    reply = generate(url, {"text": "hi", "rid": "a1"})
    assert reply.status == 200
    assert reply.json["output_ids"] == []
    assert reply.json["meta_info"]["id"] == "a1"
    assert reply.json["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Abort (injected)",
        "status_code": None,
        "err_type": None,
    }


def test_hang_fault_duplicate_rid_and_abort_request(start_sim: Any) -> None:
    url = start_sim("--fail-hang", "1.0")
    with pytest.raises(TimeoutError):
        generate(url, {"text": "hi"}, timeout=0.3)
    # The client gave up because the server hung, not because it was slow: the fault fired, and
    # nothing was generated or answered.
    stats = wait_until(lambda: (s := sim_stats(url))["faults"]["hang"] == 1 and s, 10, "the hang fault")
    assert (stats["generations"], stats["completed"]) == (0, 0), stats

    async def scenario() -> tuple[Reply, Reply]:
        async with aiohttp.ClientSession() as session:
            hanging = asyncio.create_task(
                _request(session, "POST", f"{url}/generate", {"text": "x", "rid": "dup"})
            )
            await stats_when(session, url, lambda s: s["faults"]["hang"] == 2, "the rid dup to hang")
            duplicate = await _request(session, "POST", f"{url}/generate", {"text": "y", "rid": "dup"})
            assert not hanging.done()
            aborted = await _request(
                session, "POST", f"{url}/abort_request", {"rid": "dup", "abort_all": False}
            )
            assert aborted.status == 200
            return duplicate, await asyncio.wait_for(hanging, REQUEST_TIMEOUT_S)

    duplicate, hung = asyncio.run(scenario())
    assert duplicate.status == 400
    assert duplicate.json["error"]["message"] == "Duplicate request ID detected: dup"
    assert hung.status == 200
    assert hung.json["meta_info"]["finish_reason"]["type"] == "abort"
    assert hung.json["output_ids"] == []
    assert call("POST", f"{url}/abort_request", {"rid": "nobody", "abort_all": False}).status == 200


def test_abort_is_by_prefix_of_an_exact_live_rid(start_sim: Any) -> None:
    """tokenizer_manager.py ignores a rid that is not live; scheduler.py then aborts every rid that
    starts with the one given: aborting "job-1" takes "job-10" with it."""
    url = start_sim("--fail-hang", "1.0")

    async def scenario() -> tuple[dict[str, Any], dict[str, Reply], Reply]:
        async with aiohttp.ClientSession() as session:
            tasks = {
                r: asyncio.create_task(_request(session, "POST", f"{url}/generate", {"text": "x", "rid": r}))
                for r in ("job-1", "job-10", "job-2")
            }
            await stats_when(session, url, lambda s: s["in_flight"] == 3, "three requests hanging")
            await _request(session, "POST", f"{url}/abort_request", {"rid": "job"})  # not live: ignored
            await _request(session, "POST", f"{url}/abort_request", {"rid": "job-1"})
            prefixed = [tasks["job-1"], tasks["job-10"]]
            done, _ = await asyncio.wait(prefixed, timeout=REQUEST_TIMEOUT_S)
            assert len(done) == 2, "job-1 and job-10 were not answered after aborting job-1"
            # Both answered, so the server acted on the aborts: job-2 is still held.
            stats = (await _request(session, "GET", f"{url}/sim/stats")).json
            assert not tasks["job-2"].done(), "job-2 was answered: an abort took it too"
            await _request(session, "POST", f"{url}/abort_request", {"rid": "job-2"})
            last = await asyncio.wait_for(tasks["job-2"], REQUEST_TIMEOUT_S)
            return stats, {r: t.result() for r, t in tasks.items() if t in done}, last

    stats, aborted, last = asyncio.run(scenario())
    assert (stats["aborted"], stats["in_flight"]) == (2, 1), stats
    assert sorted(aborted) == ["job-1", "job-10"]
    for reply in aborted.values():
        assert reply.status == 200 and reply.json["meta_info"]["finish_reason"]["type"] == "abort"
    assert last.json["meta_info"]["finish_reason"]["type"] == "abort", "job-2 was live until its own abort"
    assert sorted(call("GET", f"{url}/sim/rids").json) == ["job-1", "job-10", "job-2"]


def test_running_timeout_is_a_503(start_sim: Any) -> None:
    url = start_sim("--latency", "realistic", "--decode-step-ms", "20", "--req-running-timeout", "1")
    reply = generate(
        url, {"input_ids": [500] * 10, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    )
    stats = sim_stats(url)
    assert (stats["timed_out"], stats["generations"]) == (1, 0), f"the scheduler timed it out: {stats}"
    assert reply.status == 503
    assert reply.json == {
        "object": "error",
        "message": "Request running timeout reached.",
        "type": "503",
        "param": None,
        "code": 503,
    }
    short = generate(
        url, {"input_ids": [500] * 10, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    )
    assert short.status == 200


def test_nan_fault_looks_finished_but_is_not(start_sim: Any) -> None:
    """The answer was cut at max_new_tokens, yet it comes back as a stop on EOS."""
    url = start_sim("--fail-nan", "1.0")
    ids, params = [500] * 10, {"max_new_tokens": 20, "ignore_eos": True}
    honest = model.generate(ids, params)
    assert honest.finish_reason == {"type": "length", "length": 20}
    assert model.EOS_TOKEN_ID not in honest.output_ids
    reply = generate(url, {"input_ids": ids, "sampling_params": params})
    assert sim_stats(url)["faults"]["nan"] == 1, "the NaN fault fired"
    assert reply.status == 200
    assert reply.json["meta_info"]["finish_reason"] == {"type": "stop", "matched": "NaN happened"}
    assert reply.json["output_ids"] == [*honest.output_ids[:-1], model.EOS_TOKEN_ID]


def test_starting_server_answers_health_503_and_holds_generations(start_sim: Any) -> None:
    url = start_sim("--startup-s", "5")

    async def scenario() -> tuple[int, Reply]:
        async with aiohttp.ClientSession() as session:
            health = (await _request(session, "GET", url + "/health")).status
            assert health == 503, "the server had started before the test looked: raise --startup-s"
            body = {"input_ids": [500] * 10}
            held = asyncio.create_task(_request(session, "POST", f"{url}/generate", body, timeout=20))
            await stats_when(session, url, lambda s: s["requests"] == 1, "the generation to reach the server")
            # Until /health says started, the generation must stay unanswered (each look reads the
            # answer and the counters first, then /health).
            looks, deadline = 0, time.monotonic() + 20
            while True:
                answered = held.done()
                stats = (await _request(session, "GET", f"{url}/sim/stats")).json
                health = (await _request(session, "GET", url + "/health")).status
                if health == 200:
                    break
                assert health == 503
                assert not answered and stats["completed"] == 0, (
                    f"a generation was answered while /health still said starting: {stats}"
                )
                looks += 1
                assert time.monotonic() < deadline, "/health still 503 after 20 s"
                await asyncio.sleep(0.05)
            return looks, await asyncio.wait_for(held, 20)

    looks, reply = asyncio.run(scenario())
    assert looks > 0, "the generation was never seen held: the server started first (raise --startup-s)"
    assert reply.status == 200
    assert sim_stats(url)["completed"] == 1


# --- realistic latency ---


def test_latency_grows_with_concurrency(monkeypatch: pytest.MonkeyPatch) -> None:
    """The latency model of sim/scheduler.py on a virtual clock, so nothing depends on this host's
    speed: a decode step takes decode_step_s * (1 + decoding / batch_knee) for every sequence
    decoding in it, so a request's latency grows with the number decoding beside it."""
    clock = [0.0]
    real_sleep = asyncio.sleep

    async def virtual_sleep(seconds: float) -> None:
        clock[0] += seconds
        await real_sleep(0)

    # The flags reach the model (the server is not started: its settings are caught instead).
    configs: list[SimConfig] = []

    async def serve(config: SimConfig, host: str, port: int) -> None:
        configs.append(config)

    monkeypatch.setattr(sim_cli, "_serve", serve)
    res = CliRunner().invoke(
        sim_cli.sim_server,
        [
            "--latency",
            "realistic",
            "--decode-step-ms",
            "5",
            "--batch-knee",
            "16",
            "--prefill-per-token-us",
            "0",
        ],
    )
    assert res.exit_code == 0, res.output
    params = configs[0].latency_params()
    assert (params.decode_step_s, params.batch_knee, params.prefill_per_token_s) == (0.005, 16, 0.0)
    # Only the scheduler sleeps in this event loop (no prefill: nothing waits on the real clock).
    monkeypatch.setattr("genq.sim.scheduler.asyncio.sleep", virtual_sleep)

    async def latency(n: int) -> float:
        """n requests of 40 tokens sent together; they decode together and end at the same step."""
        scheduler = BatchScheduler(params)
        scheduler.start()
        started = clock[0]
        sequences = [scheduler.submit(0, 40) for _ in range(n)]
        assert await asyncio.gather(*(s.future for s in sequences)) == [40] * n
        await scheduler.stop()
        return clock[0] - started

    single, crowded = asyncio.run(latency(1)), asyncio.run(latency(64))
    assert single == pytest.approx(40 * 0.005 * (1 + 1 / 16))
    assert crowded == pytest.approx(40 * 0.005 * (1 + 64 / 16))


def test_abort_request_returns_partial_output(start_sim: Any) -> None:
    url = start_sim("--latency", "realistic", "--decode-step-ms", "5")
    params = {"max_new_tokens": 2000, "ignore_eos": True}

    async def scenario() -> Reply:
        async with aiohttp.ClientSession() as session:
            body = {"text": "go on", "rid": "long", "sampling_params": params}
            running = asyncio.create_task(_request(session, "POST", f"{url}/generate", body))
            await stats_when(session, url, lambda s: s["running"] == 1, "the long request to be running")
            # A probe with a longer prompt, admitted after it, decodes only in steps the long one
            # decodes in too: once the probe's 8 tokens are out, so are 8 of the long one's.
            probe = {"input_ids": [500] * 10, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
            answer = await _request(session, "POST", f"{url}/generate", probe)
            assert answer.status == 200 and answer.json["meta_info"]["completion_tokens"] == 8
            await _request(session, "POST", f"{url}/abort_request", {"rid": "long"})
            return await asyncio.wait_for(running, REQUEST_TIMEOUT_S)

    reply = asyncio.run(scenario())
    stats = sim_stats(url)
    assert (stats["aborted"], stats["completed"]) == (1, 1), (
        f"the abort ended it, the probe finished: {stats}"
    )
    assert reply.status == 200
    assert reply.json["meta_info"]["finish_reason"]["type"] == "abort"
    partial = reply.json["output_ids"]
    assert 8 <= len(partial) < 2000
    assert partial == model.generate(model.tokenize("go on"), params).output_ids[: len(partial)]


def test_bounded_queue_answers_503_when_full(start_sim: Any) -> None:
    url = start_sim(
        "--latency",
        "realistic",
        "--decode-step-ms",
        "5",
        "--max-running-requests",
        "1",
        "--max-queued-requests",
        "0",
    )

    async def scenario() -> tuple[Reply, Reply]:
        async with aiohttp.ClientSession() as session:
            body = {
                "text": "first",
                "rid": "first",
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
            }
            first = asyncio.create_task(_request(session, "POST", f"{url}/generate", body))
            await stats_when(session, url, lambda s: s["running"] == 1, "the first request in the only slot")
            second = asyncio.create_task(_request(session, "POST", f"{url}/generate", {"text": "second"}))
            answered, _ = await asyncio.wait({second}, timeout=REQUEST_TIMEOUT_S / 2)
            await _request(session, "POST", f"{url}/abort_request", {"abort_all": True})
            assert answered, "the second request was held, not refused: the full queue took it"
            return await asyncio.wait_for(first, REQUEST_TIMEOUT_S), second.result()

    first, second = asyncio.run(scenario())
    stats = sim_stats(url)
    assert (stats["queue_full"], stats["requests"]) == (1, 2), stats
    assert second.status == 503
    assert second.json["message"] == "The request queue is full."
    assert first.status == 200, "the first one was served (until its abort), not refused"
    assert first.json["meta_info"]["finish_reason"]["type"] == "abort"


# --- vLLM's OpenAI-compatible server (--api vllm) ---


def test_vllm_completions_token_ids_in_and_out_with_its_defaults(start_sim: Any) -> None:
    url = start_sim("--api", "vllm")
    ids = [500, 501, 502]

    async def go() -> tuple[Reply, Reply]:
        async with aiohttp.ClientSession(headers={"X-Request-Id": "req-7"}) as session:
            full = await _request(
                session,
                "POST",
                url + "/v1/completions",
                {
                    "prompt": ids,
                    "max_tokens": 600,
                    "temperature": 1.0,
                    "top_p": 1.0,
                    "top_k": -1,
                    "return_token_ids": True,
                    "a_typo_ignored": 1,
                },
            )
            bare = await _request(
                session, "POST", url + "/v1/completions", {"prompt": ids, "return_token_ids": True}
            )
            return full, bare

    full, bare = asyncio.run(go())
    assert full.status == 200
    choice = full.json["choices"][0]
    expected = model.generate(ids, {"max_new_tokens": 600})
    assert choice["token_ids"] == expected.output_ids and choice["prompt_token_ids"] == ids
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None, "EOS: no stop_reason"
    assert full.json["usage"]["completion_tokens"] == len(expected.output_ids)
    assert full.json["usage"]["prompt_tokens_details"] is None, "cached tokens only with the flag"
    # Left out: max_tokens is 16, and sampling comes from the model's generation_config.
    defaults = {"max_new_tokens": 16, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert bare.json["choices"][0]["token_ids"] == model.generate(ids, defaults).output_ids
    assert bare.json["choices"][0]["finish_reason"] == "length"
    assert call("GET", url + "/sim/rids").json == ["req-7", "req-7"], "X-Request-Id wins; duplicates allowed"
    assert call("GET", url + "/version").json == {"version": "0.33.0"}
    card = call("GET", url + "/v1/models").json["data"][0]
    assert (card["id"], card["max_model_len"]) == (model.MODEL_PATH, model.DEFAULT_CONTEXT_LENGTH)


def test_vllm_errors_and_clamps_as_its_source_says(start_sim: Any) -> None:
    url = start_sim("--api", "vllm", "--context-length", "512")
    long = call("POST", url + "/v1/completions", {"prompt": [500] * 513, "max_tokens": 5})
    assert long.status == 400
    assert long.json["error"]["message"].startswith("This model's maximum context length is 512 tokens.")
    assert long.json["error"]["message"].endswith("(parameter=input_tokens, value=513)")
    oov = call("POST", url + "/v1/completions", {"prompt": [500, model.VOCAB_SIZE]})
    assert (oov.status, oov.json["error"]["message"]) == (
        400,
        f"Token id {model.VOCAB_SIZE} is out of vocabulary",
    )
    clamped = call(
        "POST",
        url + "/v1/completions",
        {"prompt": [500] * 500, "max_tokens": 100, "ignore_eos": True, "return_token_ids": True},
    )
    assert clamped.status == 200 and len(clamped.json["choices"][0]["token_ids"]) == 12
    assert clamped.json["choices"][0]["finish_reason"] == "length"
    old = start_sim("--api", "vllm", "--vllm-version", "0.10.0")
    reply = call("POST", old + "/v1/completions", {"prompt": [500, 501], "return_token_ids": True})
    assert "token_ids" not in reply.json["choices"][0], "return_token_ids arrived in 0.10.2"
    flat = call("POST", old + "/v1/completions", {"prompt": []})
    assert flat.status == 400 and flat.json["object"] == "error", "flat error bodies before 0.10.1"


def test_vllm_chat_returns_ids_and_reasoning(start_sim: Any) -> None:
    url = start_sim("--api", "vllm", "--reasoning-parser")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why is the sky blue"}]
    reply = call(
        "POST",
        url + "/v1/chat/completions",
        {
            "messages": messages,
            "max_completion_tokens": 200,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "return_token_ids": True,
        },
    )
    assert reply.status == 200
    prompt = model.render_chat(messages)
    expected = model.generate(prompt, {"max_new_tokens": 200})
    assert reply.json["prompt_token_ids"] == prompt
    choice = reply.json["choices"][0]
    assert choice["token_ids"] == expected.output_ids
    message = choice["message"]
    assert " ".join(filter(None, [message["reasoning"], message["content"]])) == expected.text


# --- a hosted chat API (--api openai-chat) ---


def test_hosted_chat_is_strict_and_rate_limits(start_sim: Any) -> None:
    url = start_sim("--api", "openai-chat")
    messages = [{"role": "user", "content": "hello there"}]
    ok = call("POST", url + "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 50})
    assert ok.status == 200 and "token_ids" not in ok.json["choices"][0]
    assert (
        ok.json["choices"][0]["message"]["content"]
        == model.generate(model.render_chat(messages), {"max_new_tokens": 50}).text
    )
    bad = call("POST", url + "/v1/chat/completions", {"messages": messages, "top_k": 5})
    assert (bad.status, bad.json["error"]["message"]) == (
        400,
        "Unrecognized request argument supplied: top_k",
    )
    limited = start_sim("--api", "openai-chat", "--fail-429", "1.0")
    reply = call("POST", limited + "/v1/chat/completions", {"messages": messages})
    assert reply.status == 429 and reply.headers["Retry-After"] == "1"
