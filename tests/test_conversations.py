"""Whole conversations regenerated turn by turn (``--turns all``), and every sampling knob.

The simulator's answer is a pure function of the prompt ids, so each turn's prompt can be
recomputed here: the dataset's chat template over the conversation so far, with the model's own
earlier answers; and each turn's output is what the simulator gives that prompt.
"""

from __future__ import annotations

import orjson
import pytest
from transformers import AutoTokenizer

from genq.conversation import answer_message, turn_prompt
from genq.keys import Keys
from genq.sim.model import generate
from tests.helpers import log_of, read_jsonl, sigkill, sim_stats, status_json, wait_until, write_jsonl

PARAMS = {"max_new_tokens": 40}
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def sharegpt_rows(n: int, turns_of=lambda i: 1 + i % 4) -> list[dict]:
    """1-4 user turns each (with the dataset's own answers, which genq regenerates), a system
    prompt on every third."""
    rows = []
    for i in range(n):
        conv = [{"from": "system", "value": "You are a helpful assistant."}] if i % 3 == 0 else []
        for k in range(turns_of(i)):
            conv.append({"from": "human", "value": f"question {k} of row {i}: what is the sea?"})
            conv.append({"from": "gpt", "value": "an old answer, replaced"})
        rows.append({"id": f"c{i}", "conversations": conv})
    return rows


def expected_turns(tok, row: dict, params: dict, **model: int) -> list[dict]:
    """Each turn's prompt ids and output, recomputed the way genq must have produced them."""
    source = [{"role": ROLES[t["from"]], "content": t["value"]} for t in row["conversations"]]
    answers: list[dict] = []
    out = []
    n = sum(1 for m in source if m["role"] == "user")
    for k in range(n):
        prompt = tok.apply_chat_template(
            turn_prompt(source, answers, k), add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        gen = generate(list(prompt), params, **model)
        out.append({"input_ids": list(prompt), "output_ids": gen.output_ids, "text": gen.text})
        answers.append(answer_message(gen.text, None))
    return out


def check_conversations(
    out, dataset: str, rows: list[dict], tok, params: dict, skip=frozenset(), **model
) -> list:
    records = read_jsonl(out / dataset / "raw_responses.jsonl")
    assert sorted(r["row"] for r in records) == [i for i in range(len(rows)) if i not in skip]
    for r in records:
        want = expected_turns(tok, rows[r["row"]], params, **model)
        got = r["turns"]
        assert [t["input_ids"] for t in got] == [w["input_ids"] for w in want], f"{r['id']}: prompts"
        assert [t["output_ids"] for t in got] == [w["output_ids"] for w in want], f"{r['id']}: outputs"
        assert r["completion_tokens"] == sum(len(w["output_ids"]) for w in want)
        assert r["output_ids"] == want[-1]["output_ids"] and r["input_ids"] == want[-1]["input_ids"]
        assert [m["role"] for m in r["messages"]].count("assistant") == len(want) - 1
    return records


def test_every_user_turn_is_answered_with_the_models_own_earlier_answers(
    procs, start_sim, out, tmp_path, tokenizer_dir
):
    url = start_sim()
    rows = sharegpt_rows(40)
    data = write_jsonl(tmp_path / "conv.jsonl", rows)
    res = procs.run("enqueue", data, "--tokenizer", tokenizer_dir, "--turns", "all", "--max-new-tokens", "40")
    assert res.returncode == 0, res.stderr
    worker = procs.start("worker", "--server", url, "--burst")
    assert worker.wait(120) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    records = check_conversations(out, "conv", rows, tok, PARAMS)
    assert {len(r["turns"]) for r in records} == {1, 2, 3, 4}
    assert status_json(procs)["datasets"]["conv"]["completion_tokens"] == sum(
        r["completion_tokens"] for r in records
    )

    # Exports: the regenerated conversation, and eagle3 over the whole of it (loss on every answer).
    # Most answers stop at max_new_tokens here: keep them.
    assert procs.run("export", out, "--format", "messages", "--include-truncated").returncode == 0
    exported = {e["id"]: e["messages"] for e in read_jsonl(out / "conv" / "messages.jsonl")}
    for r in records:
        answers = [m["content"] for m in exported[r["id"]] if m["role"] == "assistant"]
        assert answers == [t["text"] for t in r["turns"]]
    # Without --tokenizer: the dataset's own, from the dataset.json the collector wrote beside its
    # files; with that file gone (a folder of before), eagle3 asks for --tokenizer.
    settings = orjson.loads((out / "conv" / "dataset.json").read_bytes())
    assert settings["prompting"]["tokenizer"] == str(tokenizer_dir), settings
    res = procs.run("export", out, "--format", "eagle3", "--include-truncated")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rendered 40 records with" in res.stdout and "(the dataset's, recorded at enqueue)" in res.stdout
    by_recorded = (out / "conv" / "tokenized_data.jsonl").read_bytes()
    (out / "conv" / "dataset.json").rename(tmp_path / "dataset.json")
    res = procs.run("export", out, "--format", "eagle3", "--include-truncated")
    assert "a conversation: eagle3 renders it whole with --tokenizer" in res.stderr
    res = procs.run("export", out, "--format", "eagle3", "--include-truncated", "--tokenizer", tokenizer_dir)
    assert res.returncode == 0 and "rendered 40 records" in res.stdout, res.stdout + res.stderr
    assert (out / "conv" / "tokenized_data.jsonl").read_bytes() == by_recorded
    tokenized = read_jsonl(out / "conv" / "tokenized_data.jsonl")
    assert sorted(row["id"] for row in tokenized) == sorted(exported) and len(tokenized) == len(rows)
    for row in tokenized:
        conversation = exported[row["id"]]
        whole = tok.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
        assert row["input_ids"] == list(whole)
        marked = [i for i, m in enumerate(row["loss_mask"]) if m]
        for k, message in enumerate(conversation):  # every answer's tokens are marked, nothing else
            if message["role"] == "assistant":
                before = tok.apply_chat_template(
                    conversation[:k], add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
                through = tok.apply_chat_template(conversation[: k + 1], tokenize=True, return_dict=True)[
                    "input_ids"
                ]
                assert all(row["loss_mask"][j] == 1 for j in range(len(before), len(through)))
        answer_tokens = sum(
            len(tok.apply_chat_template(conversation[: k + 1], tokenize=True, return_dict=True)["input_ids"])
            - len(
                tok.apply_chat_template(
                    conversation[:k], add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
            )
            for k, m in enumerate(conversation)
            if m["role"] == "assistant"
        )
        assert len(marked) == answer_tokens


@pytest.mark.slow
def test_a_worker_killed_mid_conversation_goes_on_from_the_first_unfinished_turn(
    procs, start_sim, out, tmp_path, tokenizer_dir, report, conn, namespace
):
    """Finished turns are kept in Redis: a conversation whose worker dies restarts at its first
    unfinished turn on another worker. What the kill costs: the turns in flight, counted."""
    url = start_sim("--latency", "realistic", "--decode-step-ms", "4", "--min-len", "40", "--max-len", "120")
    rows = sharegpt_rows(60, turns_of=lambda i: 4)
    data = write_jsonl(tmp_path / "killed.jsonl", rows)
    assert (
        procs.run(
            "enqueue", data, "--tokenizer", tokenizer_dir, "--turns", "all", "--max-new-tokens", "150"
        ).returncode
        == 0
    )
    victim = procs.start("worker", "--server", url, "--concurrency", "20", "--heartbeat-ttl", "5")
    wait_until(lambda: sim_stats(url)["generations"] >= 50, 60, "conversations half way")
    sigkill(victim)
    # The kill came mid-conversation: more turns were generated than the finished conversations hold.
    finished = conn.xlen(Keys(namespace).results("killed"))
    turns = sim_stats(url)["generations"] - 1  # less the victim's start-up probe
    assert finished < len(rows) and turns > 4 * finished, (
        f"{turns} turns generated and {finished} conversations finished at the kill"
    )
    worker = procs.start("worker", "--server", url, "--burst", "--concurrency", "20", "--heartbeat-ttl", "5")
    assert worker.wait(180) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    records = check_conversations(out, "killed", rows, tok, {"max_new_tokens": 150}, min_len=40, max_len=120)
    recorded = sum(len(r["turns"]) for r in records)
    generated = sim_stats(url)["generations"]
    wasted = generated - recorded - 2  # each worker's start-up probe is a 1-token generation too
    report(
        f"conversations: worker SIGKILLed mid-run: {generated} turns generated, {recorded} kept, "
        f"{wasted} wasted"
    )
    assert 0 <= wasted <= 20, "at most the turns in flight at the kill (one per job) are generated again"


def test_a_turn_that_fails_for_good_fails_the_job_naming_the_turn(
    procs, start_sim, out, tmp_path, tokenizer_dir
):
    url = start_sim("--context-length", "300")
    rows = [
        {"id": "ok", "conversations": [{"from": "human", "value": "short question"}]},
        {
            "id": "grows",
            "conversations": [
                {"from": "human", "value": "first question"},
                {"from": "gpt", "value": "old"},
                {"from": "human", "value": "word " * 120},
            ],
        },
    ]
    data = write_jsonl(tmp_path / "fails.jsonl", rows)
    res = procs.run(
        "enqueue", data, "--tokenizer", tokenizer_dir, "--turns", "all", "--max-new-tokens", "100"
    )
    assert res.returncode == 0, res.stderr
    worker = procs.start("worker", "--server", url, "--burst")
    assert worker.wait(60) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    (error,) = read_jsonl(out / "fails" / "errors.jsonl")
    assert (error["row"], error["error"], error["turn"]) == (1, "bad_request", 2)
    assert error["message"].startswith("turn 2 of 2: ")
    assert [r["row"] for r in read_jsonl(out / "fails" / "raw_responses.jsonl")] == [0]


def test_a_chat_endpoint_renders_each_turn_itself(procs, start_sim, out, tmp_path):
    url = start_sim("--api", "openai-chat")
    rows = sharegpt_rows(12)
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    res = procs.run("enqueue", data, "--server", url, "--turns", "all", "--max-new-tokens", "40")
    assert res.returncode == 0, res.stderr
    worker = procs.start("worker", "--server", url, "--burst")
    assert worker.wait(60) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    from genq.sim.model import render_chat

    records = read_jsonl(out / "chats" / "raw_responses.jsonl")
    assert sorted(r["row"] for r in records) == list(range(len(rows)))
    for r in records:
        source = [{"role": ROLES[t["from"]], "content": t["value"]} for t in rows[r["row"]]["conversations"]]
        assert len(r["turns"]) == sum(1 for m in source if m["role"] == "user"), (
            f"{r['id']}: a turn per question"
        )
        answers: list[dict] = []
        for k, turn in enumerate(r["turns"]):
            gen = generate(render_chat(turn_prompt(source, answers, k)), PARAMS)
            assert turn["text"] == gen.text and turn["output_ids"] is None
            answers.append(answer_message(gen.text, None))


def test_every_sampling_knob_is_checked_and_kept(procs, start_sim, out, tmp_path):
    data = write_jsonl(tmp_path / "knobs.jsonl", ({"input_ids": [100 + i, 200]} for i in range(20)))
    res = procs.run("enqueue", data, "--sampling-params", '{"temprature": 0.5}')
    assert res.returncode == 2 and "unknown sampling key 'temprature'" in res.stderr
    assert "did you mean 'temperature'?" in res.stderr
    res = procs.run("enqueue", data, "--sampling-params", '{"repetition_penalty": 3}')
    assert res.returncode == 2 and "repetition_penalty must be in (0, 2]" in res.stderr
    res = procs.run("enqueue", data, "--temperature", "0.5", "--sampling-params", '{"temperature": 0.7}')
    assert res.returncode == 2 and "both as a flag and in --sampling-params" in res.stderr
    url = start_sim("--api", "vllm")
    res = procs.run("enqueue", data, "--server", url, "--sampling-params", '{"custom_params": {"a": 1}}')
    assert res.returncode == 2 and "unknown sampling key 'custom_params' for the vllm backend" in res.stderr
    knobs = {
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "stop": ["zz"],
        "min_new_tokens": 3,
        "ignore_eos": False,
    }
    res = procs.run(
        "enqueue",
        data,
        "--max-new-tokens",
        "30",
        "--server",
        url,
        "--sampling-params",
        orjson.dumps(knobs).decode(),
    )
    assert res.returncode == 0, res.stderr
    worker = procs.start("worker", "--server", url, "--burst")
    assert worker.wait(60) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    records = read_jsonl(out / "knobs" / "raw_responses.jsonl")
    assert len(records) == 20 and all(
        r["sampling_params"] == {**knobs, "max_new_tokens": 30} for r in records
    )
    for r in records:  # the server used exactly those settings: the output is the one they give
        assert r["output_ids"] == generate([100 + r["row"], 200], {**knobs, "max_new_tokens": 30}).output_ids
