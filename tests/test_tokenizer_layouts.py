"""The model genq was built for, end to end (Kimi-K2.5): every tokenizer layout users meet, its
template's thinking switch, tool-use rows, and the tokenizer shipped as code, run only with this
host's consent (--trust-remote-code), never Redis's. The tokenizers are built here
(genq/sim/tokenizers.py, `genq sim-tokenizer`)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time
from pathlib import Path

import pytest
from rq import Queue

from genq.keys import Keys
from genq.sim.tokenizers import LAYOUTS, build
from genq.templates import ChatTemplate, RemoteCodeRefused
from tests.helpers import genq_argv, log_of, read_jsonl, status_json, write_jsonl

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
PLAIN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "hello world"},
]
AGENTIC = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": "The weather in Paris is sunny."},
]
ROWS = [
    {"messages": PLAIN},
    {"messages": AGENTIC, "tools": TOOLS},
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Write a haiku"},
                    {"type": "text", "text": "about the sea."},
                ],
            }
        ]
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ]
    },
]
# What each row is sent as: up to the last user turn, or the tool result after it.
PROMPTS = {
    0: (PLAIN, None),
    1: (AGENTIC[:3], TOOLS),
    2: ([{"role": "user", "content": "Write a haiku\nabout the sea."}], None),
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    """Each layout with its template in tokenizer_config.json (False) or chat_template.jinja (True)."""
    root = tmp_path_factory.mktemp("layouts")
    return {
        (lay, f): build(lay, root / f"{lay}-{'jinja' if f else 'config'}", f)
        for lay in LAYOUTS
        for f in (0, 1)
    }


def _tok(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(folder), trust_remote_code=(folder / "tokenization_kimi.py").exists()
    )


def _expected(tok, messages, tools, thinking: bool) -> list[int]:
    encoded = tok.apply_chat_template(
        [messages],
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        thinking=thinking,
    )
    return list(encoded["input_ids"][0])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("template_file", [False, True], ids=["config", "jinja"])
def test_prompt_ids_and_eagle3_masks_are_the_templates_for_every_layout(layouts, layout, template_file):
    """genq's ids are apply_chat_template(..., add_generation_prompt=True) of that tokenizer, thinking
    on and off, with tools; the EAGLE-3 loss mask covers exactly the assistant turns."""
    folder = layouts[layout, template_file]
    tok = _tok(folder)
    trust = layout == "tiktoken"
    for thinking in (True, False):
        template = ChatTemplate(str(folder), {"thinking": thinking}, trust_remote_code=trust)
        got = template.render([m for m, _ in PROMPTS.values()], [t for _, t in PROMPTS.values()])
        for (messages, tools), ids in zip(PROMPTS.values(), got, strict=True):
            assert ids == _expected(tok, messages, tools, thinking), (layout, thinking, messages)
        tail = tok.decode(got[0][-3:])
        assert tail.endswith("<think></think>" if not thinking else "<|im_middle|><think>"), tail
    # Loss on the assistant turns only: the thought, the answer, the tool call and each end of turn.
    template = ChatTemplate(str(folder), {"thinking": True}, trust_remote_code=trust)
    answered = [*AGENTIC[:3], {"role": "assistant", "content": "Sunny.", "reasoning_content": "I read it."}]
    spans = template.assistant_spans(answered, TOOLS)
    assert not isinstance(spans, str), spans
    ids, mask = spans
    assert (
        len(ids) == len(mask)
        and ids == tok.apply_chat_template(answered, tools=TOOLS, thinking=True)["input_ids"]
    )
    # The whole mask, derived here from the tokenizer's own renders of successive prefixes: each
    # assistant turn is what its render adds to the prompt before it (generation prompt included).
    want = [0] * len(ids)
    for i, message in enumerate(answered):
        if message["role"] != "assistant":
            continue
        before = tok.apply_chat_template(answered[:i], tools=TOOLS, thinking=True, add_generation_prompt=True)
        through = tok.apply_chat_template(answered[: i + 1], tools=TOOLS, thinking=True)["input_ids"]
        start = len(before["input_ids"])
        assert ids[: len(through)] == list(through), (layout, i)
        want[start : len(through)] = [1] * (len(through) - start)
    assert mask == want, (layout, [j for j, (a, b) in enumerate(zip(mask, want, strict=True)) if a != b])
    learned = [i for i, m in zip(ids, mask, strict=True) if m]
    text = tok.decode(learned)
    for piece in ("get_weather", "Paris", "I read it.", "</think>", "Sunny.", "<|im_end|>"):
        assert piece in text.replace("▁", " "), (layout, piece, text)
    assert "sunny" not in text and "What is the weather" not in text, (
        "tool results and user turns are context"
    )


def test_a_tokenizer_that_is_code_runs_only_with_this_hosts_consent(layouts, procs, tmp_path):
    """Without --trust-remote-code: one line naming the file and the flag, exit 2, nothing enqueued,
    and never transformers' y/N prompt (a terminal is there to answer it)."""
    folder = layouts["tiktoken", True]
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS[:1])
    master, terminal = pty.openpty()
    started = time.monotonic()
    proc = subprocess.Popen(
        genq_argv("enqueue", data, "--tokenizer", folder, "--dataset", "kimi"),
        env=procs.env,
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
    )
    os.close(terminal)
    screen = b""
    try:
        while proc.poll() is None and time.monotonic() - started < 60:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    screen += os.read(master, 1 << 16)
                except OSError:  # EIO: the terminal's last holder closed it
                    break
        proc.wait(max(1.0, 60 - (time.monotonic() - started)))
    finally:
        proc.kill()
        proc.wait(10)
        os.close(master)
    text = screen.decode(errors="replace")
    assert proc.returncode == 2, text
    assert "[y/N]" not in text and "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "tokenization_kimi.py" in lines[0] and "--trust-remote-code" in lines[0], lines[0]
    assert "kimi" not in status_json(procs)["datasets"], "nothing enqueued"
    with pytest.raises(RemoteCodeRefused):
        ChatTemplate(str(folder))
    # With the flag (or GENQ_TRUST_REMOTE_CODE), the same command enqueues.
    res = procs.run(
        "enqueue", data, "--tokenizer", folder, "--dataset", "kimi", env={"GENQ_TRUST_REMOTE_CODE": "1"}
    )
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("layout, package", [("tiktoken", "tiktoken"), ("sentencepiece", "sentencepiece")])
def test_a_layouts_missing_package_is_named_with_its_extra(layouts, procs, tmp_path, layout, package):
    hidden = tmp_path / "hide"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text(f"import sys\nsys.modules[{package!r}] = None\n")
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS[:1])
    env = {"PYTHONPATH": str(hidden)}
    res = procs.run("enqueue", data, "--tokenizer", layouts[layout, False], "--trust-remote-code", env=env)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().count("\n") == 0 and f"pip install 'genq[{package}]'" in res.stderr, res.stderr


def test_code_writable_by_other_users_is_not_run_even_with_consent(tmp_path):
    folder = build("tiktoken", tmp_path / "shared-kimi")
    os.chmod(folder / "tokenization_kimi.py", 0o666)
    with pytest.raises(RemoteCodeRefused, match="other users"):
        ChatTemplate(str(folder), trust_remote_code=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kimi_shaped_datasets_run_end_to_end_thinking_on_and_off(
    layouts, layout, procs, start_sim, conn, namespace, out, tmp_path
):
    """enqueue -> worker -> collector for each layout: records carry the template's ids (tools
    included), their tools, and a reasoning/content split that follows the thinking switch; an
    image part is refused with its reason and the other rows go through."""
    url = start_sim("--latency", "zero")
    folder = layouts[layout, layout == "tiktoken"]  # Kimi-K2.5 ships chat_template.jinja
    trust = ["--trust-remote-code"] if layout == "tiktoken" else []
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    for name, thinking in (("on", "true"), ("off", "false")):
        res = procs.run(
            "enqueue", data, "--dataset", name, "--tokenizer", folder, *trust,
            "--chat-template-kwargs", f'{{"thinking": {thinking}}}', "--reasoning-preset", "kimi-k2",
            "--max-new-tokens", "48", "--rejects", tmp_path / f"{name}.rejects.jsonl",
        )  # fmt: skip
        assert res.returncode == 3, res.stderr  # one row refused, the others enqueued
        assert "read 4, enqueued 3, skipped 0, rejected 1" in res.stdout, res.stdout
        assert (
            f"{data}:4: field 'messages'[0].content[1]: a 'image_url' part: genq sends text only"
            in res.stderr
        )
    worker = procs.start("worker", "--server", url, "--burst", "--concurrency", "8")
    assert worker.wait(120) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst", timeout=120).returncode == 0
    tok = _tok(folder)
    end_id = tok.convert_tokens_to_ids("</think>")
    for name, thinking in (("on", True), ("off", False)):
        records = {r["row"]: r for r in read_jsonl(out / name / "raw_responses.jsonl")}
        assert sorted(records) == [0, 1, 2]
        for row, (messages, tools) in PROMPTS.items():
            record = records[row]
            assert record["input_ids"] == _expected(tok, messages, tools, thinking), (name, row)
            assert record.get("tools") == tools
            if end_id in record["output_ids"]:
                continue  # the toy model closed the thought by chance: the split has its end
            if thinking:  # the prompt opened the thought: an output that never closes it is all thought
                assert record["content"] is None and record["reasoning"] is not None, record
            else:  # <think></think> in the prompt: the model did not think
                assert record["reasoning"] is None and record["content"] is not None, record
    exported = procs.run("export", out, "--format", "messages", "--dataset", "off", "--include-truncated")
    assert exported.returncode == 0, exported.stderr
    rows = read_jsonl(out / "off" / "messages.jsonl")
    assert [r.get("tools") for r in sorted(rows, key=lambda r: r["id"])] == [None, TOOLS, None]


def _queued(conn, namespace: str, dataset: str) -> int:
    return Queue(Keys(namespace).queue_name(dataset), connection=conn, serializer="json").count


def test_consent_is_per_host_a_worker_without_it_leaves_the_jobs_queued(
    layouts, procs, start_sim, conn, namespace, out, tmp_path
):
    """--turns all: the worker renders later turns with the tokenizer, so it runs its code. A worker
    without --trust-remote-code leaves those jobs queued (not failed) and says why once; one with
    it runs them. Then the code file changes: another tokenizer, refused like a changed template."""
    url = start_sim("--latency", "zero")
    folder = build("tiktoken", tmp_path / "kimi", template_file=True)
    dialog = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    data = write_jsonl(tmp_path / "dialogs.jsonl", [{"messages": dialog}] * 3)
    args = [
        "enqueue",
        data,
        "--tokenizer",
        folder,
        "--trust-remote-code",
        "--turns",
        "all",
        "--max-new-tokens",
        "16",
    ]
    args += ["--chat-template-kwargs", '{"thinking": false}', "--reasoning-preset", "kimi-k2"]
    assert procs.run(*args, "--dataset", "turns").returncode == 0
    refusing = procs.start("worker", "--server", url, "--burst", "--concurrency", "4")
    assert refusing.wait(120) == 0, log_of(refusing)
    said = [line for line in log_of(refusing).splitlines() if "dataset turns:" in line]
    assert len(said) == 1 and "--trust-remote-code" in said[0] and "tokenization_kimi.py" in said[0], said
    assert _queued(conn, namespace, "turns") == 3, "left queued, not failed"
    consenting = procs.start(
        "worker", "--server", url, "--burst", "--concurrency", "4", "--trust-remote-code"
    )
    assert consenting.wait(120) == 0, log_of(consenting)
    assert procs.run("collect", "--out", out, "--burst", timeout=120).returncode == 0
    records = read_jsonl(out / "turns" / "raw_responses.jsonl")
    assert len(records) == 3 and all(len(r["turns"]) == 2 for r in records)
    # The worker renders turn 2 as enqueue would: the template's switch (thinking off) and the
    # model's own first answer in place of the dataset's.
    tok = _tok(folder)
    for record in records:
        first, second = record["turns"]
        answer = {"role": "assistant", "content": first["content"] or ""}
        if first["reasoning"] is not None:
            answer["reasoning_content"] = first["reasoning"]
        assert first["input_ids"] == _expected(tok, dialog[:1], None, thinking=False)
        assert second["input_ids"] == _expected(tok, [dialog[0], answer, dialog[2]], None, thinking=False)
        assert tok.decode(second["input_ids"]).endswith("<think></think>")
    # The code changes (a new revision of the repo): another tokenizer, though the template is the same.
    before = ChatTemplate(str(folder), trust_remote_code=True).fingerprint
    with open(folder / "tokenization_kimi.py", "a") as fh:
        fh.write("\n# revised\n")
    assert ChatTemplate(str(folder), trust_remote_code=True).fingerprint != before
    res = procs.run(*args, "--dataset", "turns")
    assert res.returncode != 0 and "was first enqueued with" in res.stderr, res.stderr
    # Jobs enqueued before the change meet the changed code at the worker: failed, saying why.
    (folder / "tokenization_kimi.py").write_text(
        (folder / "tokenization_kimi.py").read_text().replace("\n# revised\n", "")
    )
    assert procs.run(*args, "--dataset", "later").returncode == 0
    with open(folder / "tokenization_kimi.py", "a") as fh:
        fh.write("\n# revised\n")
    worker = procs.start("worker", "--server", url, "--burst", "--concurrency", "4", "--trust-remote-code")
    assert worker.wait(120) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst", timeout=120).returncode == 0
    errors = read_jsonl(out / "later" / "errors.jsonl")
    assert len(errors) == 3, errors
    for error in errors:
        assert error["error"] == "tokenizer" and "chat template and code" in error["message"], error
        assert "not the ones the dataset was enqueued with" in error["message"], error


def test_turns_all_refuses_tool_use_per_row(layouts, procs, tmp_path):
    """Regenerating every turn of an agentic conversation would need its tools run again: such a row
    is refused with its reason, and the plain dialogs beside it go through."""
    data = write_jsonl(tmp_path / "mixed.jsonl", [{"messages": AGENTIC, "tools": TOOLS}, {"messages": PLAIN}])
    res = procs.run(
        "enqueue", data, "--tokenizer", layouts["fast", False], "--turns", "all", "--dataset", "t"
    )
    assert res.returncode == 3, res.stderr
    assert "read 2, enqueued 1, skipped 0, rejected 1" in res.stdout, res.stdout
    assert f"{data}:1: field 'messages': turn 1 is tool use: --turns all regenerates" in res.stderr, (
        res.stderr
    )


def test_an_openai_batch_request_with_tools_is_rendered_with_them(layouts, procs, conn, namespace, tmp_path):
    body = {"model": "kimi", "messages": AGENTIC[:3], "tools": TOOLS, "max_tokens": 32}
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": body}
    data = write_jsonl(tmp_path / "batch.jsonl", [line])
    folder = layouts["fast", False]
    res = procs.run("enqueue", data, "--tokenizer", folder, "--dataset", "b", "--max-new-tokens", "32")
    assert res.returncode == 0, res.stderr
    (job,) = Queue(Keys(namespace).queue_name("b"), connection=conn, serializer="json").get_jobs()
    assert job.kwargs["tools"] == TOOLS
    assert job.kwargs["input_ids"] == _expected(_tok(folder), AGENTIC[:3], TOOLS, thinking=True)
