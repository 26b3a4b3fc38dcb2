"""Chat templates, length checks and think markers, against a tokenizer built here (no download)."""

from __future__ import annotations

import pytest
from rq import Queue

from genq.keys import Keys
from genq.producer import thinking
from genq.sim.model import generate
from genq.templates import ChatTemplate, TemplateError
from genq.worker.reasoning import split
from tests.dataset_helpers import run_pipeline
from tests.helpers import write_jsonl

THREE_TURNS = [
    {"from": "human", "value": "What is the capital of France?"},
    {"from": "gpt", "value": "Paris."},
    {"from": "human", "value": "And of Italy?"},
    {"from": "gpt", "value": "Rome, the eternal city."},
]


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def _jobs(conn, namespace: str, dataset: str) -> dict[str, dict]:
    queue = Queue(Keys(namespace).queue_name(dataset), connection=conn, serializer="json")
    return {job.kwargs["id"]: job.kwargs for job in queue.get_jobs()}


def test_the_simulator_gets_the_chat_template_of_the_conversation_minus_its_last_answer(
    procs, start_sim, out, tmp_path, tokenizer_dir, tok
):
    url = start_sim("--latency", "zero")
    rows = [
        {"id": "sg", "conversations": THREE_TURNS},
        {
            "messages": [
                {"role": "system", "content": "Old rules."},
                {"role": "user", "content": "hello world"},
            ]
        },
        {"prompt": "Write a haiku about the sea."},
        {"instruction": "Explain recursion.", "input": "In one sentence."},
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    system = "Be brief."
    records = run_pipeline(
        procs,
        url,
        out,
        "chat",
        str(data),
        "--tokenizer",
        str(tokenizer_dir),
        "--chat-template-kwargs",
        '{"enable_thinking": true}',
        "--system-prompt",
        system,
        "--max-new-tokens",
        "64",
    )
    expected = {
        0: [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"},
        ],
        1: [{"role": "user", "content": "hello world"}],
        2: [{"role": "user", "content": "Write a haiku about the sea."}],
        3: [{"role": "user", "content": "Explain recursion.\n\nIn one sentence."}],
    }
    assert sorted(r["row"] for r in records) == [0, 1, 2, 3]
    for record in records:
        conversation = [{"role": "system", "content": system}, *expected[record["row"]]]
        ids = tok.apply_chat_template(conversation, add_generation_prompt=True, enable_thinking=True)[
            "input_ids"
        ]
        assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n"), "template kwargs were passed"
        assert record["input_ids"] == ids
        assert record["prompt_tokens"] == len(ids), "the server saw exactly these ids"
        assert record["output_ids"] == generate(ids, {"max_new_tokens": 64}).output_ids
        assert record["messages"] == conversation
    assert next(r for r in records if r["row"] == 0)["source_id"] == "sg"


def test_template_refusals_and_prompts_too_long_are_rejected_or_clipped(
    procs, conn, namespace, tmp_path, tokenizer_dir, tok
):
    long_text = "hello world " * 40
    rows = [
        {"messages": [{"role": "user", "content": "short question"}]},
        {"messages": [{"role": "tool", "content": "{}"}, {"role": "user", "content": "go"}]},
        {"messages": [{"role": "user", "content": long_text}]},
        {"messages": [{"role": "user", "content": long_text * 3}]},
    ]
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    ids = [
        tok.apply_chat_template([r["messages"][-1]], add_generation_prompt=True)["input_ids"] for r in rows
    ]
    context = len(ids[2]) + 50  # row 2 fits only with fewer than 100 new tokens; row 3 not at all
    assert len(ids[0]) + 100 < context < len(ids[3])
    args = [
        "enqueue",
        data,
        "--tokenizer",
        tokenizer_dir,
        "--max-new-tokens",
        "100",
        "--context-length",
        context,
    ]
    res = procs.run(*args)
    assert res.returncode == 3, res.stderr  # rows rejected, the rest enqueued
    assert "read 4, enqueued 1, skipped 0, rejected 3" in res.stdout
    assert f"rejected {data}:2: chat template: TemplateError: unknown role tool" in res.stderr
    assert (
        f"rejected {data}:3: field 'input_ids': {len(ids[2])} prompt tokens + max_new_tokens 100 do not fit "
        f"in the context length of {context}"
    ) in res.stderr
    res = procs.run(*args, "--dataset", "clipped", "--clip-max-new-tokens")
    assert res.returncode == 3, res.stderr  # rows rejected, the rest enqueued
    assert "read 4, enqueued 2, skipped 0, rejected 2, clipped 1" in res.stdout
    assert f"clipped {data}:3: max_new_tokens 100 -> {context - 1 - len(ids[2])} to fit" in res.stderr
    assert f"rejected {data}:4: field 'input_ids': {len(ids[3])} prompt tokens leave no room" in res.stderr
    jobs = _jobs(conn, namespace, "clipped")
    assert jobs["clipped-2"]["sampling_params"]["max_new_tokens"] == context - 1 - len(ids[2])
    assert jobs["clipped-0"]["sampling_params"]["max_new_tokens"] == 100


def test_a_datasets_tokenizer_template_and_system_prompt_are_fixed_at_its_first_enqueue(
    procs, tmp_path, tokenizer_dir
):
    data = write_jsonl(tmp_path / "fixed.jsonl", [{"prompt": "hello"}])
    base = ["enqueue", data, "--tokenizer", tokenizer_dir]
    assert procs.run(*base, "--chat-template-kwargs", '{"enable_thinking": true}').returncode == 0
    for other in (base, ["enqueue", data], [*base, "--think-end", "</think>"]):
        res = procs.run(*other)
        assert res.returncode != 0 and "was first enqueued with" in res.stderr, (other, res.stderr)


def test_a_tokenizer_that_cannot_be_loaded_offline_is_a_clear_error(procs, tmp_path):
    data = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "hello"}])
    res = procs.run("enqueue", data, "--tokenizer", "no-such-org/no-such-model")
    assert res.returncode != 0
    assert res.stderr == (
        "Error: tokenizer 'no-such-org/no-such-model' not found: not a local folder, and the Hugging Face "
        "repo is not in the local cache (genq never downloads: `hf download no-such-org/no-such-model` "
        "first, or pass a path)\n"
    )
    # A mistyped path is no repo id: said so, not Hugging Face's "Repo id must be in the form ...".
    missing = tmp_path / "missing"
    res = procs.run("enqueue", data, "--tokenizer", missing)
    assert res.returncode != 0
    assert res.stderr == (
        f"Error: tokenizer '{missing}' not found: not a local folder and not a Hugging Face repo id; pass a "
        "path or a repo id\n"
    )
    with pytest.raises(TemplateError, match="not found"):
        ChatTemplate(str(missing))


# -- think markers ----------------------------------------------------------------------------


def test_think_markers_resolve_from_presets_or_the_tokenizer(tokenizer_dir):
    template = ChatTemplate(str(tokenizer_dir))
    end_id = template.token_id("</think>")
    markers, special = thinking.resolve(None, None, None, "</think>", None, template)
    assert markers == {"end": "</think>", "end_id": end_id} and not special
    assert thinking.resolve("qwen3", None, None, None, None, None) == (
        {"start": "<think>", "start_id": 151667, "end": "</think>", "end_id": 151668},
        False,
    )
    assert thinking.resolve("deepseek-r1", None, None, None, None, None)[0]["end_id"] == 128799
    kimi, special = thinking.resolve("kimi-k2", None, None, None, None, None)
    assert kimi["end_id"] == 163607 and special, "Kimi's </think> is special: it must stay in the text"
    # With a tokenizer, the preset's texts are looked up in it.
    assert thinking.resolve("qwen3", None, None, None, None, template)[0]["end_id"] == end_id
    assert thinking.resolve("none", None, None, None, None, None) == (None, False)
    with pytest.raises(thinking.ThinkError, match="needs its text"):
        thinking.resolve(None, None, None, None, 7, None)
    with pytest.raises(thinking.ThinkError, match=f"is token {end_id}"):
        thinking.resolve(None, None, None, "</think>", end_id + 1, template)


def test_split_by_end_marker_open_thought_and_vanished_special_token():
    think = {"start": "<think>", "start_id": 10, "end": "</think>", "end_id": 11}
    # The model opened and closed its thought.
    parts = split(think, [10, 5, 6, 11, 7, 2], "<think>\nsteps here\n</think>\n\nThe answer.")
    assert (parts.reasoning, parts.content, parts.reasoning_tokens) == ("steps here", "The answer.", 4)
    # The template opened it in the prompt (R1-0528, Qwen3-Thinking, Kimi-K2.5); the output was cut.
    parts = split(think, [5, 6, 7], "still thinking", prompt_ids=[1, 2, 10, 3])
    assert (parts.reasoning, parts.content, parts.reasoning_tokens) == ("still thinking", None, 3)
    # Thinking switched off in the prompt (<think></think> already closed): all content.
    parts = split(think, [5, 6, 2], "Direct answer.", prompt_ids=[1, 10, 3, 11, 3])
    assert (parts.reasoning, parts.content, parts.reasoning_tokens) == (None, "Direct answer.", 0)
    # Text prompts: the opening marker is looked for in the prompt's tail.
    parts = split(think, [5, 6], "cut short", prompt_text="...<|im_start|>assistant\n<think>\n")
    assert parts.reasoning == "cut short" and parts.content is None
    # Only a text marker (no tokenizer, no id): reasoning_tokens unknown, not zero.
    parts = split({"end": "</think>"}, [5, 6, 7], "a</think>b")
    assert (parts.reasoning, parts.content, parts.reasoning_tokens) == ("a", "b", None)


def test_reasoning_is_split_in_the_record(procs, start_sim, out, tmp_path):
    """End to end: the simulator's deterministic output, split at a token chosen from it."""
    url = start_sim("--latency", "zero")
    prompt = [300 + i for i in range(12)]
    params = {"max_new_tokens": 200}
    gen = generate(prompt, params)
    words = gen.text.split()
    # A word whose first appearance in the text (even inside another word) is its own.
    k = next(i for i in range(3, len(words)) if gen.text.find(words[i]) == len(" ".join(words[:i])) + 1)
    end_id, end_word = gen.output_ids[k], words[k]
    data = write_jsonl(tmp_path / "think.jsonl", [{"input_ids": prompt}])
    (record,) = run_pipeline(
        procs,
        url,
        out,
        "think",
        str(data),
        "--max-new-tokens",
        "200",
        "--think-end",
        end_word,
        "--think-end-token-id",
        str(end_id),
    )
    cut = gen.text.index(end_word)
    assert record["reasoning"] == gen.text[:cut].strip()
    assert record["content"] == gen.text[cut + len(end_word) :].lstrip()
    assert record["reasoning_tokens"] == k + 1
    assert record["text"] == gen.text and record["output_ids"] == gen.output_ids
    assert record["input_ids"] == prompt
