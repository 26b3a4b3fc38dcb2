"""OpenAI Batch API files: `genq enqueue` reads request lines shaped exactly like OpenAI's documented
examples, `genq export --format openai-batch` writes output lines the openai package's own types
accept; and `genq enqueue --dry-run`, which reads, checks and renders without touching Redis."""

from __future__ import annotations

import orjson
from openai.types import Completion
from openai.types.chat import ChatCompletion

from genq.sim.model import tokenize
from tests.dataset_helpers import run_pipeline
from tests.helpers import read_jsonl, write_jsonl

# OpenAI's Batch API guide, "Preparing your batch file", line for line.
CHAT = [
    {
        "custom_id": "request-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "gpt-3.5-turbo-0125",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Hello world!"},
            ],
            "max_tokens": 1000,
        },
    },
    {
        "custom_id": "request-2",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "gpt-3.5-turbo-0125",
            "messages": [
                {"role": "system", "content": "You are an unhelpful assistant."},
                {"role": "user", "content": "Hello world!"},
            ],
            "max_tokens": 1000,
        },
    },
]


def completion(custom_id: str, prompt: str) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "gpt-3.5-turbo-instruct", "prompt": prompt, "max_tokens": 1000},
    }


def test_batch_files_run_and_come_back_as_the_batch_apis_output(
    procs, start_sim, out, tmp_path, tokenizer_dir
):
    from transformers import AutoTokenizer

    # A prompt of 1100 words + max_tokens 1000 cannot fit in 1500: the server refuses it (a 400),
    # so the export has a failure line too.
    url = start_sim("--context-length", "1500")
    chat = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    texts = write_jsonl(
        tmp_path / "texts.jsonl",
        [
            completion("c-1", "Say this is a test"),
            completion("c-long", "word " * 1100),
            completion("c-3", "hi"),
        ],
    )
    records = run_pipeline(procs, url, out, "batch", str(chat), str(texts), "--tokenizer", str(tokenizer_dir))

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    by_row = {r["row"]: r for r in records}
    assert sorted(by_row) == [0, 1, 2, 4]
    assert {r["sampling_params"]["max_new_tokens"] for r in records} == {1000}  # max_tokens, mapped
    for row, line in enumerate(CHAT):
        messages = line["body"]["messages"]
        assert (
            by_row[row]["input_ids"]
            == tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        )
        assert by_row[row]["source_id"] == line["custom_id"]
    assert by_row[2]["messages"] == [{"role": "user", "content": "Say this is a test"}]
    # a /v1/completions prompt goes as text, without the chat template: the server reads 5 words
    assert by_row[2]["prompt_tokens"] == len(tokenize("Say this is a test")) == 5
    (error,) = read_jsonl(out / "batch" / "errors.jsonl")
    assert (error["row"], error["source_id"], error["error"]) == (3, "c-long", "bad_request")

    res = procs.run("export", out, "--format", "openai-batch")
    assert res.returncode == 0, res.stderr
    lines = read_jsonl(out / "batch" / "batch_output.jsonl")
    assert [line["custom_id"] for line in lines] == ["request-1", "request-2", "c-1", "c-long", "c-3"]
    for line, row in zip(lines[:2], (0, 1), strict=True):
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = ChatCompletion.model_validate(line["response"]["body"])
        assert body.object == "chat.completion" and body.model == "gpt-3.5-turbo-0125"
        assert body.choices[0].message.content == by_row[row]["content"]
        assert body.choices[0].finish_reason == by_row[row]["finish_reason"]
        assert body.usage.completion_tokens == len(by_row[row]["output_ids"])
        assert body.usage.total_tokens == by_row[row]["prompt_tokens"] + by_row[row]["completion_tokens"]
    for line, row in ((lines[2], 2), (lines[4], 4)):
        body = Completion.model_validate(line["response"]["body"])
        assert body.object == "text_completion" and body.model == "gpt-3.5-turbo-instruct"
        assert body.choices[0].text == by_row[row]["text"]
        assert line["response"]["request_id"] == by_row[row]["id"]
    assert lines[3]["response"] is None
    assert lines[3]["error"] == {"code": "bad_request", "message": error["message"]}


def _dry_run(procs, *args: str):
    return procs.run("enqueue", *args, "--dry-run", "--dataset", "dry")


def _ours(conn, namespace: str) -> list:
    """Every key of this test's namespace (genq's and RQ's: their names carry it), and its queues
    in RQ's set of queues; the Redis is shared by the whole session, whose other tests' leftovers
    may still write their own."""
    keys = sorted(k for k in conn.keys("*") if namespace.encode() in k)
    return keys + sorted(q for q in conn.smembers("rq:queues") if namespace.encode() in q)


def test_dry_run_checks_and_renders_everything_and_touches_no_redis(
    procs, conn, namespace, tmp_path, tokenizer_dir
):
    rows = [
        *CHAT,
        {**CHAT[0], "custom_id": "other", "body": {**CHAT[0]["body"], "max_tokens": 500}},
        {**CHAT[0], "custom_id": "asks", "body": {**CHAT[0]["body"], "logprobs": True}},
        {**CHAT[0], "custom_id": "hot", "body": {**CHAT[0]["body"], "temperature": 3.5}},
    ]
    chat = write_jsonl(tmp_path / "chat.jsonl", rows)
    texts = write_jsonl(tmp_path / "texts.jsonl", [completion("c-1", "Say this is a test")])
    before = _ours(conn, namespace)

    res = _dry_run(procs, chat, texts, "--tokenizer", tokenizer_dir, "--samples", "2")
    assert res.returncode == 0, res.stderr
    assert _ours(conn, namespace) == before, "a dry run writes nothing to Redis"
    assert f"{chat}: 5 rows: would enqueue 4 jobs (2 rows x 2 samples), reject 3" in res.stdout
    assert f"{texts}: 1 rows: would enqueue 2 jobs (1 rows x 2 samples), reject 0" in res.stdout
    out = res.stdout.splitlines()
    first = out.index(next(line for line in out if line.startswith(f"{chat}: first prompt")))
    assert out[first].endswith("tokens:")
    assert out[first + 1 : first + 3] == ["<|im_start|>system", "You are a helpful assistant.<|im_end|>"]
    assert "Say this is a test" in out
    assert "dry: dry run: would enqueue 6 jobs, reject 3 rows" in res.stdout
    assert f"rejected {chat}:3: field 'body': its sampling is not the dataset's" in res.stderr
    assert "max_new_tokens 500, the dataset's 1000" in res.stderr
    assert f"rejected {chat}:4: field 'body.logprobs': not a field genq maps" in res.stderr
    assert f"rejected {chat}:5: field 'body': temperature must be a non-negative" not in res.stderr
    assert f"rejected {chat}:5: field 'body': " in res.stderr  # 3.5: still valid for SGLang, not the recipe

    # No Redis at all: a dry run does not need one.
    res = procs.run(
        "enqueue",
        chat,
        "--dry-run",
        "--tokenizer",
        tokenizer_dir,
        env={"GENQ_REDIS_URL": "redis://127.0.0.1:1/0"},
    )
    assert res.returncode == 0, res.stderr

    # The command line may not contradict the rows: neither setting would be silently dropped.
    res = _dry_run(procs, chat, "--tokenizer", tokenizer_dir, "--max-new-tokens", "64")
    assert res.returncode != 0
    assert f"{chat}:1: the row asks for max_new_tokens 1000, the command line for 64" in res.stderr


def test_batch_rows_need_a_renderer_and_a_text_endpoint_a_token_backend(procs, tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    res = _dry_run(procs, chat)
    assert res.returncode != 0
    assert f"{chat}:1: url /v1/chat/completions holds conversations: give --tokenizer" in res.stderr
    res = _dry_run(procs, chat, "--backend", "openai-chat")
    assert res.returncode == 0, res.stderr
    assert orjson.dumps(CHAT[0]["body"]["messages"]).decode() in res.stdout
    texts = write_jsonl(tmp_path / "texts.jsonl", [completion("c-1", "Say this is a test")])
    res = _dry_run(procs, texts, "--backend", "openai-chat")
    assert res.returncode != 0
    assert "url /v1/completions sends a plain text prompt" in res.stderr


def _record(row: int, url: str, finish: str = "stop") -> dict:
    return {
        "id": f"d-{row}",
        "dataset": "d",
        "row": row,
        "source_id": f"r{row}",
        "sample": 0,
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "output_ids": [7, 8],
        "text": "Hi there",
        "reasoning": None,
        "content": "Hi there",
        "finish_reason": finish,
        "finished_at": "2026-12-02T00:00:00Z",
        "batch": {"url": url, "model": "m"},
    }


def _error(row: int) -> dict:
    return {"id": f"d-{row}", "dataset": "d", "row": row, "source_id": f"r{row}", "sample": 0}


def test_the_export_merges_failures_in_row_order_and_keeps_truncated_answers(procs, tmp_path):
    folder = tmp_path / "out" / "d"
    folder.mkdir(parents=True)
    # Finished out of order; row 2 failed, then succeeded after `genq retry`; row 3 was cut short.
    write_jsonl(
        folder / "raw_responses.jsonl",
        [
            _record(2, "/v1/completions"),
            _record(0, "/v1/chat/completions"),
            _record(3, "/v1/completions", "length"),
        ],
    )
    write_jsonl(
        folder / "errors.jsonl",
        [
            {**_error(2), "error": "timeout", "message": "slow"},
            {**_error(1), "error": "bad_request", "message": "no"},
        ],
    )
    res = procs.run("export", tmp_path / "out", "--format", "openai-batch")
    assert res.returncode == 0, res.stderr
    assert "d: wrote 4 to" in res.stdout
    lines = read_jsonl(folder / "batch_output.jsonl")
    assert [line["custom_id"] for line in lines] == ["r0", "r1", "r2", "r3"]
    assert lines[1] == {
        "id": "batch_req_d-1",
        "custom_id": "r1",
        "response": None,
        "error": {"code": "bad_request", "message": "no"},
    }
    assert (
        lines[2]["error"] is None
        and Completion.model_validate(lines[2]["response"]["body"]).choices[0].text == "Hi there"
    )
    assert Completion.model_validate(lines[3]["response"]["body"]).choices[0].finish_reason == "length"
    chat = ChatCompletion.model_validate(lines[0]["response"]["body"])
    assert chat.created == 1796169600 and chat.usage.total_tokens == 6
