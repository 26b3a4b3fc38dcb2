"""`genq export`: eagle3, sharegpt and messages files from a finished run; the raw file is only read."""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson

from genq.sim.model import generate, tokenize
from tests.dataset_helpers import run_pipeline
from tests.helpers import read_jsonl, write_jsonl

MAX_NEW = 300  # the simulator's outputs run 16-512 tokens: some finish, some are cut


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _conversation(k: int) -> list[dict]:
    turns = [{"from": "system", "value": "You are a helpful assistant."}] if k % 2 else []
    for j in range(k % 3 + 1):
        turns += [
            {"from": "human", "value": f"question {k}.{j}"},
            {"from": "gpt", "value": f"answer {k}.{j}"},
        ]
    return turns


def test_eagle3_sharegpt_and_messages_exports_of_a_finished_run(
    procs, start_sim, out, tmp_path, tokenizer_dir
):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    url = start_sim("--latency", "zero")
    data = write_jsonl(tmp_path / "blend.jsonl", ({"conversations": _conversation(k)} for k in range(8)))
    records = run_pipeline(
        procs,
        url,
        out,
        "blend",
        str(data),
        "--tokenizer",
        str(tokenizer_dir),
        "--max-new-tokens",
        str(MAX_NEW),
    )
    raw = out / "blend" / "raw_responses.jsonl"
    before = _digest(raw)
    role = {"system": "system", "human": "user", "gpt": "assistant"}
    expected = {}
    for k in range(8):
        prompt = [{"role": role[t["from"]], "content": t["value"]} for t in _conversation(k)[:-1]]
        ids = tok.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"]
        expected[f"blend-{k}"] = (prompt, ids, generate(ids, {"max_new_tokens": MAX_NEW}))
    finished = {rid for rid, (_, _, gen) in expected.items() if gen.finish_reason["type"] == "stop"}
    assert 0 < len(finished) < 8, "the run has both finished and truncated outputs"
    assert {r["id"] for r in records} == set(expected)

    res = procs.run("export", out, "--format", "eagle3", "--include-truncated")
    assert res.returncode == 0, res.stderr
    assert f"blend: wrote 8 to {out / 'blend' / 'tokenized_data.jsonl'}" in res.stdout
    tokenized = read_jsonl(out / "blend" / "tokenized_data.jsonl")
    assert sorted(row["id"] for row in tokenized) == sorted(expected)
    for row in tokenized:
        _, ids, gen = expected[row["id"]]
        assert row["input_ids"] == ids + gen.output_ids
        assert row["loss_mask"] == [0] * len(ids) + [1] * len(gen.output_ids)

    res = procs.run("export", out, "--format", "sharegpt", "--out", tmp_path / "sft")
    assert res.returncode == 0, res.stderr
    assert f"blend: wrote {len(finished)} to" in res.stdout
    assert f"blend: left out {8 - len(finished)}: truncated (finish_reason length" in res.stderr
    sharegpt = {
        row["id"]: row["conversations"] for row in read_jsonl(tmp_path / "sft" / "blend" / "sharegpt.jsonl")
    }
    assert set(sharegpt) == finished
    back = {"system": "system", "user": "human", "assistant": "gpt"}
    for rid, conversation in sharegpt.items():
        prompt, _, gen = expected[rid]
        assert conversation[:-1] == [{"from": back[t["role"]], "value": t["content"]} for t in prompt]
        assert conversation[-1] == {"from": "gpt", "value": gen.text}

    res = procs.run("export", out, "--format", "messages", "--dataset", "blend")
    assert res.returncode == 0, res.stderr
    messages = read_jsonl(out / "blend" / "messages.jsonl")
    assert {row["id"] for row in messages} == finished, "the finished ones: truncated ones are left out"
    for row in messages:
        prompt, _, gen = expected[row["id"]]
        assert row["messages"] == [*prompt, {"role": "assistant", "content": gen.text}]
    assert _digest(raw) == before, "exports never change what the collector wrote"
    assert not list((out / "blend").glob("*.part")), "each file is written aside, then renamed"


def test_reasoning_content_and_the_older_shapes_on_disk(procs, start_sim, out, tmp_path):
    url = start_sim("--latency", "zero")
    prompt = "the quick brown fox"
    gen = generate(tokenize(prompt), {"max_new_tokens": 600})
    words = gen.text.split()
    k = next(i for i in range(3, len(words)) if gen.text.find(words[i]) == len(" ".join(words[:i])) + 1)
    data = write_jsonl(tmp_path / "think.jsonl", [{"prompt": prompt}])
    run_pipeline(procs, url, out, "think", str(data), "--max-new-tokens", "600", "--think-end", words[k])
    res = procs.run("export", out, "--format", "messages", "--dataset", "think", "--reasoning-content")
    assert res.returncode == 0, res.stderr
    (row,) = read_jsonl(out / "think" / "messages.jsonl")
    cut = gen.text.index(words[k])
    assert row["messages"] == [
        {"role": "user", "content": prompt},
        {
            "role": "assistant",
            "content": gen.text[cut + len(words[k]) :].lstrip(),
            "reasoning_content": gen.text[:cut].strip(),
        },
    ]
    # Shapes users already have on disk, next to genq records that cannot be exported, and a line
    # the collector is still writing.
    legacy = out / "legacy"
    legacy.mkdir()
    lines = [
        {
            "id": "oa-1",
            "messages": [{"role": "user", "content": "hi"}],
            "choices": [
                {"message": {"content": "hello", "reasoning_content": "greet back"}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        },
        {"id": "tok-1", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
        {"id": "g-1", "output_ids": [5, 2], "prompt_tokens": 3, "finish_reason": "stop", "content": "x"},
        {"id": "g-2", "output_ids": [5, 2], "input_ids": [1, 2], "prompt_tokens": 3, "finish_reason": "stop"},
    ]
    (legacy / "raw_responses.jsonl").write_bytes(
        b"".join(orjson.dumps(x) + b"\n" for x in lines) + b'{"id": "torn", "output_'
    )
    res = procs.run("export", out, "--format", "eagle3", "--dataset", "legacy")
    assert res.returncode == 0, res.stderr
    assert [r["id"] for r in read_jsonl(legacy / "tokenized_data.jsonl")] == ["tok-1"]
    assert "left out 1: no output_ids (a text-only record" in res.stderr
    assert "left out 1: no prompt input_ids in the record" in res.stderr
    assert "left out 1: prompt input_ids do not match the server's prompt_tokens" in res.stderr
    res = procs.run("export", out, "--format", "sharegpt", "--dataset", "legacy", "--reasoning-content")
    assert res.returncode == 0, res.stderr
    assert read_jsonl(legacy / "sharegpt.jsonl") == [
        {
            "id": "oa-1",
            "conversations": [
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello", "reasoning_content": "greet back"},
            ],
        }
    ]
    assert "left out 3: no prompt conversation in the record" in res.stderr


def test_exports_come_in_row_order_with_the_rows_own_ids(procs, tmp_path):
    """The collector writes records in the order they finished; exports follow the dataset's rows
    (then samples), keep each row's own id as source_id, and put lines without a row last."""
    folder = tmp_path / "out" / "ordered"
    folder.mkdir(parents=True)
    finished = [(7, 1), (2, 0), (7, 0), (0, 0), (12, 0), (2, 1)]
    rows = [
        {
            "id": f"ordered-{row}-{sample}",
            "row": row,
            "sample": sample,
            "source_id": f"user-{row}",
            "input_ids": [1, 2],
            "output_ids": [3, row],
            "prompt_tokens": 2,
            "finish_reason": "stop",
        }
        for row, sample in finished
    ]
    rows.insert(3, {"input_ids": [9, 9], "loss_mask": [0, 1]})  # another tool's pre-tokenized row
    write_jsonl(folder / "raw_responses.jsonl", rows)
    res = procs.run("export", tmp_path / "out", "--format", "eagle3")
    assert res.returncode == 0, res.stderr
    exported = read_jsonl(folder / "tokenized_data.jsonl")
    ordered = sorted(finished)
    assert [e.get("id") for e in exported] == [f"ordered-{r}-{s}" for r, s in ordered] + [None]
    assert [e.get("source_id") for e in exported] == [f"user-{r}" for r, _ in ordered] + [None]
    assert exported[-1]["input_ids"] == [9, 9]


def test_eagle3_of_text_prompts_encodes_them_as_the_server_did(procs, tmp_path, tokenizer_dir):
    """Text prompts enqueued without a tokenizer (the demo's) reach the server as text: the record
    has no prompt ids. eagle3 says so and what to pass; with --tokenizer it encodes the text as
    the server's tokenizer manager does, checked against the server's prompt_tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    folder = tmp_path / "out" / "texts"
    folder.mkdir(parents=True)
    prompts = ["Explain binary search.", "Write a haiku about queues."]
    records = [
        {"id": f"texts-{i}", "row": i, "output_ids": [5, 6, 7], "prompt_tokens": len(tok.encode(p)),
         "finish_reason": "stop", "messages": [{"role": "user", "content": p}], "input_ids": None}
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    records[1]["prompt_tokens"] += 1  # as if another tokenizer had read it
    write_jsonl(folder / "raw_responses.jsonl", records)

    res = procs.run("export", tmp_path / "out", "--format", "eagle3")
    assert res.returncode == 1, "an export that wrote nothing of its records is a failure"
    assert read_jsonl(folder / "tokenized_data.jsonl") == []
    assert "left out 2: a text prompt sent without a tokenizer" in res.stderr, res.stderr
    last = res.stderr.splitlines()[-1]
    assert last.startswith("Error: nothing exported from ") and "every record was left out" in last, last

    res = procs.run("export", tmp_path / "out", "--format", "eagle3", "--tokenizer", tokenizer_dir)
    assert res.returncode == 0, res.stderr
    (exported,) = read_jsonl(folder / "tokenized_data.jsonl")
    ids = tok.encode(prompts[0])
    assert exported["input_ids"] == ids + [5, 6, 7]
    assert exported["loss_mask"] == [0] * len(ids) + [1, 1, 1]
    assert "not the server's tokenizer" in res.stderr, res.stderr


def test_a_dataset_with_nothing_to_export_is_said_and_stats_shows_the_check_stage(procs, tmp_path):
    """A checked dataset whose every sample was rejected has no raw_responses.jsonl: export says so
    in a line instead of passing over it, and `genq stats` shows the check stage's counts in text."""
    out = tmp_path / "out"
    for name in ("ok", "none"):
        (out / name).mkdir(parents=True)
    record = {"dataset": "ok", "row": 0, "sample": 0, "output_ids": [5, 6], "prompt_tokens": 3,
              "completion_tokens": 2, "finish_reason": "stop", "text": "hi", "schema": 1}  # fmt: skip
    write_jsonl(out / "ok" / "raw_responses.jsonl", [{**record, "id": "ok-0"}])
    rejected = {**record, "dataset": "none", "id": "none-0", "check": {"status": "rejected", "reason": "no"}}
    write_jsonl(out / "none" / "rejected_samples.jsonl", [rejected])
    res = procs.run("export", out, "--format", "parquet")
    assert res.returncode == 0, res.stderr
    assert (
        "none: nothing to export: no raw_responses.jsonl" in res.stderr
        and "rejected_samples.jsonl" in res.stderr
    )
    stats = procs.run("stats", out)
    assert stats.returncode == 0 and "check: rejected 1" in stats.stdout, stats.stdout
