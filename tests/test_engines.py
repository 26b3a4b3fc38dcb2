"""Every engine API through the same queue, records, views and exports: SGLang's /generate, vLLM's
/v1/completions (token ids in and out), and OpenAI-compatible chat (vLLM's, and a hosted one).

The simulator speaks each API with its real defaults, error shapes and quirks (sim/vllm.py and
sim/openai_chat.py name the source files).
"""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from genq.sim.model import generate, render_chat
from tests.helpers import (
    check_records,
    log_of,
    read_jsonl,
    sim_stats,
    status_json,
    stop,
    wait_all,
    wait_until,
    write_jsonl,
    write_prompts,
)

FAULTS = ("--fail-500", "0.05", "--fail-503", "0.05", "--fail-reset", "0.02", "--fail-abort", "0.02")
FAULT_KINDS = ("error_500", "error_503", "reset", "abort")  # the simulator's names for FAULTS' kinds


def assert_faults_fired(url: str, records: list[dict], kinds: tuple[str, ...]) -> None:
    """The scenario happened: the server injected each fault kind, and records needed retries."""
    fired = sim_stats(url)["faults"]
    assert all(fired[k] > 0 for k in kinds), f"faults injected by the server: {fired}; expected {kinds}"
    assert records, "no records"
    assert any(r["attempts"] > 1 for r in records), "no record needed a retry: the faults reached no job"


@pytest.mark.parametrize(("backend", "api"), [("sglang", "sglang"), ("vllm", "vllm"), ("auto", "vllm")])
def test_token_backends_give_the_servers_ids_exactly_once(procs, start_sim, out, tmp_path, backend, api):
    url = start_sim("--api", api, "--latency", "realistic", "--decode-step-ms", "3", *FAULTS)
    data = tmp_path / "tok.jsonl"
    prompts = write_prompts(data, 300)
    assert procs.run("enqueue", data, "--max-new-tokens", "120").returncode == 0
    workers = [
        procs.start("worker", "--server", url, "--backend", backend, "--burst", "--max-attempts", "10")
        for _ in range(2)
    ]
    assert wait_all(workers, 180) == [0, 0], [log_of(w) for w in workers]
    # The backend it was told, or the one it detected, serves: "(vllm detected 0.33.0, model ...".
    served = f"({api} detected " if backend == "auto" else f"({api} "
    assert all(served in log_of(w) for w in workers), [log_of(w) for w in workers]
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    assert_faults_fired(url, read_jsonl(out / "tok" / "raw_responses.jsonl"), FAULT_KINDS)
    records = check_records(out, "tok", prompts, {"max_new_tokens": 120})
    assert {r["backend"] for r in records} == {api}
    assert "token_exact" not in records[0], "token-exact records carry no flag"
    # SGLang always says how many prompt tokens its cache held; vLLM only with
    # --enable-prompt-tokens-details (not set here): null, never a made-up 0.
    cached = int if api == "sglang" else type(None)
    assert all(isinstance(r["cached_tokens"], cached) for r in records), {r["cached_tokens"] for r in records}
    assert not read_jsonl(out / "tok" / "errors.jsonl")
    # The training data: prompt ids + the server's output ids, loss on the output only.
    assert procs.run("export", out, "--format", "eagle3", "--include-truncated").returncode == 0
    rows = {r["id"]: r for r in read_jsonl(out / "tok" / "tokenized_data.jsonl")}
    for r in records:
        prompt = prompts[r["row"]]
        assert rows[r["id"]]["input_ids"] == prompt + r["output_ids"]
        assert rows[r["id"]]["loss_mask"] == [0] * len(prompt) + [1] * len(r["output_ids"])


def test_no_vllm_default_leaks_into_a_record(procs, start_sim, out, tmp_path):
    """vLLM fills every sampling field a request leaves out from the model's generation_config (here
    temperature 0.6, top_p 0.95, top_k 20, min_p 0.1, repetition_penalty 1.1) and max_tokens with
    16; the simulator's answer changes with each, so a default that leaked shows as other ids."""
    config = '{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1}'
    url = start_sim("--api", "vllm", "--generation-config", config)
    data = tmp_path / "leak.jsonl"
    prompts = write_prompts(data, 50)
    assert procs.run("enqueue", data, "--max-new-tokens", "300", "--top-p", "0.9").returncode == 0
    worker = procs.start("worker", "--server", url, "--backend", "vllm", "--burst")
    assert worker.wait(60) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    records = check_records(out, "leak", prompts, {"max_new_tokens": 300, "top_p": 0.9})
    assert any(r["completion_tokens"] > 16 for r in records)


def test_a_vllm_without_return_token_ids_is_refused_pointing_to_openai_chat(procs, start_sim, tmp_path):
    url = start_sim("--api", "vllm", "--vllm-version", "0.10.1")
    data = tmp_path / "old.jsonl"
    write_prompts(data, 5)
    assert procs.run("enqueue", data).returncode == 0
    worker = procs.start("worker", "--server", url, "--burst")
    assert worker.wait(60) == 78
    (line,) = [line for line in log_of(worker).splitlines() if "ERROR" in line]
    assert "without token_ids" in line and "vLLM >= 0.10.2" in line and "--backend openai-chat" in line


def test_vllm_context_checks_at_enqueue_and_cached_tokens_when_told(procs, start_sim, out, tmp_path):
    url = start_sim("--api", "vllm", "--context-length", "512", "--prompt-tokens-details")
    data = write_jsonl(tmp_path / "ctx.jsonl", [{"input_ids": [101] * n} for n in (100, 400, 10)])
    res = procs.run("enqueue", data, "--max-new-tokens", "200", "--server", url)
    assert res.returncode == 3, res.stderr  # rows rejected, the rest enqueued
    assert "enqueued 2, skipped 0, rejected 1" in res.stdout
    assert f"{data}:2: field 'input_ids': 400 prompt tokens + max_new_tokens 200 do not fit" in res.stderr
    worker = procs.start("worker", "--server", url)
    wait_until(lambda: status_json(procs)["stream"]["length"] == 2, 60, "both jobs done")
    assert [(w["backend"], w["model"]) for w in status_json(procs)["workers"]] == [("vllm", "genq/sim-model")]
    assert stop(worker) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    records = read_jsonl(out / "ctx" / "raw_responses.jsonl")
    assert sorted(r["row"] for r in records) == [0, 2]
    assert all(isinstance(r["cached_tokens"], int) for r in records)


def _chat_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        turns = [{"from": "human", "value": f"question {i} about the sea"}]
        if i % 3 == 0:
            turns = [
                {"from": "system", "value": "answer briefly"},
                {"from": "human", "value": f"first {i}"},
                {"from": "gpt", "value": "an old answer"},
                {"from": "human", "value": f"second {i}"},
            ]
        rows.append({"id": f"c{i}", "conversations": turns})
    return rows


def _expected_prompt(row: dict) -> list[int]:
    """The regenerated prompt: the conversation up to its last user turn, rendered by the server."""
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    turns = [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]
    return render_chat(turns)


@pytest.mark.parametrize(("api", "ids"), [("openai-chat", False), ("vllm", True)])
def test_a_chat_endpoint_gets_conversations_without_a_tokenizer(procs, start_sim, out, tmp_path, api, ids):
    """Text in, text out: the rows' conversations go as messages, the server renders them. Records
    say token_exact false, carry ids only when the server returned them, and the reasoning the
    server's parser split off; errors, stats and status work as for any dataset."""
    url = start_sim("--api", api, "--reasoning-parser", "--context-length", "60", *FAULTS[:4])
    rows = _chat_rows(60)
    rows.append({"id": "long", "conversations": [{"from": "human", "value": "word " * 80}]})
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    # A hosted endpoint is detected as one; vLLM's chat is asked for by name (auto picks /v1/completions).
    backend = ("--backend", "openai-chat") if api == "vllm" else ()
    res = procs.run(
        "enqueue", data, "--server", url, *backend, "--max-new-tokens", "30", "--temperature", "0.7"
    )
    assert res.returncode == 0, res.stderr
    worker = procs.start("worker", "--server", url, *backend, "--burst", "--max-attempts", "10")
    assert worker.wait(120) == 0, log_of(worker)
    # The hosted endpoint's chat API is detected; vLLM's is the one asked for by name.
    assert ("(openai-chat detected " if api == "openai-chat" else "(openai-chat vllm") in log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    records = read_jsonl(out / "chat" / "raw_responses.jsonl")
    assert_faults_fired(url, records, FAULT_KINDS[:2])
    assert sorted(r["row"] for r in records) == list(range(60))
    for r in records:
        expected = generate(_expected_prompt(rows[r["row"]]), {"max_new_tokens": 30, "temperature": 0.7})
        assert r["token_exact"] is False and r["backend"] == "openai-chat"
        assert r["output_ids"] == (expected.output_ids if ids else None)
        assert " ".join(filter(None, [r["reasoning"], r["content"]])) == expected.text
        assert r["messages"][-1]["role"] == "user" and r["source_id"] == f"c{r['row']}"
    (error,) = read_jsonl(out / "chat" / "errors.jsonl")
    assert (error["row"], error["error"], error["status"]) == (60, "bad_request", 400)
    assert "maximum context length" in error["message"]
    stats = orjson.loads(procs.run("stats", out, "--json").stdout)["datasets"]["chat"]
    assert stats["records"] == 60
    assert stats["completion_tokens"] == sum(r["completion_tokens"] for r in records)
    assert status_json(procs)["datasets"]["chat"]["done"] == 60
    assert sim_stats(url)["rejected"] == 1


@pytest.mark.timeout(2 * 180 + 60 + 120 + 60)  # its runs' and exports' budgets, and a minute
def test_a_chat_run_resumes_and_eagle3_needs_a_tokenizer_for_text_records(
    tmp_path, monkeypatch, tokenizer_dir
):
    """`genq run --backend openai-chat --simulate` twice: the second finds everything on disk. Text
    records cannot become EAGLE-3 data without ids: export says so and counts them."""
    data = write_jsonl(tmp_path / "talk.jsonl", _chat_rows(30))
    out = tmp_path / "out"
    raw = out / "talk" / "raw_responses.jsonl"
    argv = [sys.executable, "-m", "genq", "run", str(data), "--out", str(out), "--simulate"]
    argv += ["--backend", "openai-chat", "--sim-latency", "zero", "--max-new-tokens", "600"]
    monkeypatch.delenv("GENQ_REDIS_URL", raising=False)
    written = []
    for enqueued, skipped in ((30, 0), (0, 30)):
        res = subprocess.run(argv, capture_output=True, text=True, timeout=180)
        assert res.returncode == 0, res.stderr
        assert f"talk: read 30, enqueued {enqueued}, skipped {skipped}, rejected 0" in res.stdout, res.stdout
        assert "talk: 30 done, 0 failed of 30" in res.stdout
        written.append(raw.read_bytes())
    assert written[1] == written[0], "the second run wrote nothing: it found every record on disk"
    assert len(read_jsonl(raw)) == 30
    export = subprocess.run(
        [sys.executable, "-m", "genq", "export", str(out), "--format", "eagle3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert export.returncode == 1, export.stderr  # nothing of 30 records exported
    assert "talk: wrote 0" in export.stdout
    assert "talk: left out 30: no output_ids" in export.stderr and "--tokenizer" in export.stderr
    rendered = subprocess.run(
        [
            sys.executable,
            "-m",
            "genq",
            "export",
            str(out),
            "--format",
            "eagle3",
            "--tokenizer",
            str(tokenizer_dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rendered.returncode == 0, rendered.stderr
    assert "talk: wrote 30" in rendered.stdout and "rendered 30 records" in rendered.stdout
    rows = read_jsonl(out / "talk" / "tokenized_data.jsonl")
    assert len(rows) == 30
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) and 1 in r["loss_mask"] for r in rows)
