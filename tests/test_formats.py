"""Readers and row formats: every file kind and row shape, bad rows named with file:line and why."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rq import Queue

from genq import sources
from genq.keys import Keys
from genq.producer.formats import Shape
from genq.producer.readers import Rejected, Row, read_dataset
from genq.sources import SourceError
from tests.helpers import read_jsonl, write_jsonl

CONVERSATION = [
    {"from": "system", "value": "You are a helpful assistant."},
    {"from": "human", "value": "What is the capital of France?"},
    {"from": "gpt", "value": "Paris."},
    {"from": "human", "value": "And of Italy?"},
    {"from": "gpt", "value": "Rome."},
]
AS_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


def _rows(paths: list[Path], shape: Shape | None = None, split: str | None = None) -> list[Row | Rejected]:
    return list(read_dataset(paths, shape or Shape(chat=True), split))


def _queued(conn, namespace: str, dataset: str) -> dict[str, dict]:
    keys = Keys(namespace)
    queue = Queue(keys.queue_name(dataset), connection=conn, serializer="json")
    return {job.kwargs["id"]: job.kwargs for job in queue.get_jobs()}


# -- row formats ------------------------------------------------------------------------------


def test_each_row_format_becomes_its_prompt(tmp_path):
    data = write_jsonl(
        tmp_path / "all.jsonl",
        [
            {
                "id": "a",
                "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            },
            {"id": 2, "conversations": CONVERSATION},
            {"prompt": "Tell me a joke."},
            {"instruction": "Translate to French.", "input": "Good morning"},
            {"instruction": "Name a colour."},
            {"input_ids": [5, 6, 7]},
        ],
    )
    rows = _rows([data])
    assert all(isinstance(r, Row) for r in rows), rows
    assert [r.row for r in rows] == list(range(6))
    assert rows[0].prompt.messages == [{"role": "user", "content": "hi"}] and rows[0].prompt.source_id == "a"
    assert rows[1].prompt.messages == AS_MESSAGES and rows[1].prompt.source_id == "2"
    assert rows[2].prompt.messages == [{"role": "user", "content": "Tell me a joke."}]
    assert rows[3].prompt.messages == [{"role": "user", "content": "Translate to French.\n\nGood morning"}]
    assert rows[4].prompt.messages == [{"role": "user", "content": "Name a colour."}]
    assert rows[5].prompt.input_ids == [5, 6, 7] and rows[5].prompt.messages is None
    # Without a tokenizer, text prompts are sent as text.
    text = write_jsonl(
        tmp_path / "text.jsonl", [{"prompt": "Tell me a joke."}, {"instruction": "Do.", "input": "it"}]
    )
    plain = _rows([text], Shape())
    assert plain[0].prompt.text == "Tell me a joke." and plain[0].prompt.messages is None
    assert plain[1].prompt.text == "Do.\n\nit"


def test_system_prompt_replaces_or_adds_the_system_turn(tmp_path):
    data = write_jsonl(
        tmp_path / "sys.jsonl",
        [{"conversations": CONVERSATION}, {"prompt": "Hello"}, {"system": "Be terse.", "prompt": "Hi"}],
    )
    rows = _rows([data], Shape(chat=True, system_prompt="Answer in French."))
    assert rows[0].prompt.messages[0] == {"role": "system", "content": "Answer in French."}
    assert rows[0].prompt.messages[1:] == AS_MESSAGES[1:]
    assert rows[1].prompt.messages == [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
    ]
    # A row's own system column is used when no --system-prompt is given.
    own = _rows([data], Shape(chat=True))
    assert own[2].prompt.messages == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
    ]


def test_field_mapping_reads_other_column_names(tmp_path):
    data = write_jsonl(
        tmp_path / "mapped.jsonl",
        [
            {"uuid": "x1", "dialog": [{"speaker": "user", "text": "hey"}, {"speaker": "bot", "text": "hi"}]},
            {"uuid": "x2", "question": "Why is the sky blue?"},
        ],
    )
    shape = Shape(
        chat=True,
        fields={
            "messages": "dialog",
            "role": "speaker",
            "content": "text",
            "id": "uuid",
            "prompt": "question",
        },
    )
    rows = _rows([data], shape)
    assert rows[0].prompt.messages == [{"role": "user", "content": "hey"}]
    assert rows[0].prompt.source_id == "x1"
    assert rows[1].prompt.messages == [{"role": "user", "content": "Why is the sky blue?"}]


def test_bad_rows_are_rejected_with_where_and_why_in_process(tmp_path):
    data = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"conversations": CONVERSATION},
            "{not json",
            {"messages": []},
            {"messages": [{"role": "assistant", "content": "I start."}]},
            {"conversations": [{"from": "human", "value": 3}]},
            {"conversations": [{"from": "alien", "value": "x"}]},
            {"messages": "hello"},
            {"messages": [{"role": "user"}]},
            {"prompt": 42},
            {"instruction": "Do it.", "input": ["a"]},
            {"prompt": "ok", "id": [1]},
            {"title": "no prompt here"},
            {"messages": [{"role": "user", "content": "last good row"}]},
        ],
    )
    rows = _rows([data])
    reasons = {r.row: str(r) for r in rows if isinstance(r, Rejected)}
    assert [r.row for r in rows if isinstance(r, Row)] == [0, 12]
    expected = {
        1: f"{data}:2: malformed JSON",
        2: f"{data}:3: field 'messages': expected a non-empty list of turns, got an empty list",
        3: f"{data}:4: field 'messages': the conversation has no user turn to answer (roles: assistant)",
        4: f"{data}:5: field 'conversations'[0].value: expected a string, got int",
        5: f"{data}:6: field 'conversations'[0].from: expected one of human, user, gpt",
        6: f"{data}:7: field 'messages': expected a non-empty list of turns, got str",
        7: f"{data}:8: field 'messages'[0].content: missing (the turn has 'role')",
        8: f"{data}:9: field 'prompt': expected a non-empty string",
        9: f"{data}:10: field 'input': expected a string, got list",
        10: f"{data}:11: field 'id': expected a string or integer, got list",
        11: f"{data}:12: no prompt: expected field 'input_ids', 'messages', 'conversations', 'prompt', "
        "'instruction' or 'custom_id' (fields present: title)",
    }
    assert set(reasons) == set(expected)
    for row, text in expected.items():
        assert reasons[row].startswith(text), (reasons[row], text)


def test_explicit_format_rejects_other_shapes(tmp_path):
    data = write_jsonl(
        tmp_path / "f.jsonl", [{"prompt": "a"}, {"messages": [{"role": "user", "content": "b"}]}]
    )
    rows = _rows([data], Shape(format="messages", chat=True))
    assert str(rows[0]) == f"{data}:1: field 'messages': missing (fields present: prompt)"
    assert isinstance(rows[1], Row)


def test_conversations_without_a_tokenizer_stop_with_a_clear_error(tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "fine"}, {"conversations": CONVERSATION}])
    reader = read_dataset([data], Shape())
    assert isinstance(next(reader), Row)
    with pytest.raises(
        SourceError, match=r"chat.jsonl:2: format sharegpt holds conversations: give --tokenizer"
    ):
        next(reader)


# -- file kinds -------------------------------------------------------------------------------


def test_json_array_streamed_with_line_numbers_across_chunk_boundaries(tmp_path, monkeypatch):
    items = [{"prompt": f"question number {i} " + "x" * (i % 7)} for i in range(60)]
    items[17] = {"prompt": ""}
    items[30] = {"input_ids": [1, 2, 3], "note": 'brackets ] [ and "quotes" and \\ in a string'}
    data = tmp_path / "arr.json"
    dumped = [json.dumps(i, indent=2) for i in items]
    data.write_text("[\n" + ",\n".join(dumped) + "\n]\n")
    starts = [2 + sum(d.count("\n") + 1 for d in dumped[:i]) for i in range(len(items))]
    monkeypatch.setattr(sources, "JSON_CHUNK", 7)  # every element spans several reads
    rows = _rows([data], Shape())
    assert [r.row for r in rows] == list(range(60))
    assert rows[30].prompt.input_ids == [1, 2, 3]
    assert rows[59].prompt.text == items[59]["prompt"]
    assert [r.where for r in rows] == [f"{data}:{line}" for line in starts]
    assert str(rows[17]) == f"{data}:{starts[17]}: field 'prompt': expected a non-empty string"
    assert sources.count(data) == 60


def test_json_array_broken_mid_way_stops_after_the_rows_before_it(tmp_path):
    data = tmp_path / "broken.json"
    data.write_text('[{"prompt": "a"},\n {"prompt": "b"},\n {"prompt": "c" "d"},\n {"prompt": "e"}]')
    reader = read_dataset([data], Shape())
    assert [next(reader).row for _ in range(2)] == [0, 1]
    bad = next(reader)
    assert isinstance(bad, Rejected) and str(bad).startswith(f"{data}:3: malformed JSON: Expecting ','")
    with pytest.raises(SourceError, match="rows after it cannot be numbered"):
        next(reader)


def test_json_file_with_json_lines_inside(tmp_path):
    data = write_jsonl(tmp_path / "lines.json", [{"prompt": "a"}, {"prompt": "b"}])
    assert [r.prompt.text for r in _rows([data], Shape())] == ["a", "b"]


def test_parquet_shards_shaped_like_open_perfectblend(tmp_path):
    """mlabonne/open-perfectblend: parquet shards data/train-0000k-of-0000n.parquet with
    `conversations` (list of {from, value}) and `source`."""
    folder = tmp_path / "open-perfectblend" / "data"
    folder.mkdir(parents=True)
    conversations = [
        [{"from": "human", "value": f"Solve {k} + {k}."}, {"from": "gpt", "value": f"{2 * k}"}]
        for k in range(5)
    ]
    conversations[3] = [{"from": "gpt", "value": "an answer without a question"}]  # the shape -fixed drops
    schema = pa.schema(
        [
            ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
            ("source", pa.string()),
        ]
    )
    for shard, part in enumerate((conversations[:3], conversations[3:])):
        table = pa.table({"conversations": part, "source": ["math"] * len(part)}, schema=schema)
        pq.write_table(table, folder / f"train-{shard:05d}-of-00002.parquet", row_group_size=2)
    paths = sources.expand([str(folder / "train-*.parquet")])
    assert [p.name for p in paths] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    rows = _rows(paths)
    assert [r.row for r in rows] == [0, 1, 2, 3, 4]
    assert rows[4].prompt.messages == [{"role": "user", "content": "Solve 4 + 4."}]
    assert str(rows[3]) == (
        f"{paths[1]}:row 0: field 'conversations': the conversation has no user turn to answer "
        "(roles: assistant)"
    )
    assert sum(sources.count(p) for p in paths) == 5
    # The same shards as a local dataset folder, read by the datasets library (offline).
    hf = _rows([folder.parent])
    assert [r.prompt.messages for r in hf if isinstance(r, Row)] == [
        r.prompt.messages for r in rows if isinstance(r, Row)
    ]
    assert sources.count(folder.parent) == 5


def test_hugging_face_dataset_saved_to_disk(tmp_path):
    import datasets

    folder = tmp_path / "saved"
    rows = {"prompt": [f"prompt {i}" for i in range(25)], "id": [f"s{i}" for i in range(25)]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(folder))
    read = _rows([folder], Shape())
    assert [r.prompt.text for r in read] == rows["prompt"]
    assert read[24].where == f"{folder}:row 24" and read[24].prompt.source_id == "s24"
    assert sources.count(folder) == 25
    with pytest.raises(SourceError, match="choose a split with --split"):
        _rows([folder], Shape(), split="test")


def test_rows_are_numbered_across_files_whatever_is_wrong(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "one"}, "", "{bad", {"prompt": "three"}])
    second = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "four"}])
    rows = _rows([first, second], Shape())
    assert [(r.row, type(r).__name__) for r in rows] == [(0, "Row"), (1, "Rejected"), (2, "Row"), (3, "Row")]
    assert rows[3].where == f"{second}:1"


def test_unknown_files_and_empty_globs_are_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(SourceError, match="unknown file type '.txt'"):
        sources.expand([str(tmp_path / "notes.txt")])
    with pytest.raises(SourceError, match="matches no file"):
        sources.expand([str(tmp_path / "*.parquet")])


# -- through the real command ----------------------------------------------------------------


def test_enqueue_reports_formats_and_rejects_bad_rows_while_the_rest_go_through(
    procs, conn, namespace, tmp_path
):
    data = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"prompt": "first"},
            "{oops",
            {"prompt": ["not", "text"]},
            {"input_ids": [100, 101]},
            {"instruction": "Say hi."},
        ],
    )
    parquet = tmp_path / "more.parquet"
    pq.write_table(pa.table({"input_ids": [[7, 8], [], [9]]}), parquet)
    rejects = tmp_path / "rejects.jsonl"
    res = procs.run(
        "enqueue", data, parquet, "--dataset", "mix", "--max-new-tokens", "16", "--rejects", rejects
    )
    assert res.returncode == 3, res.stderr  # rows rejected, the rest enqueued
    # A Parquet row has no line: its row in the file, and itself as JSON.
    assert read_jsonl(rejects)[-1] == {
        "file": str(parquet),
        "row": 1,
        "dataset_row": 6,
        "field": "input_ids",
        "reason": "field 'input_ids': expected a non-empty list of integers, got list",
        "raw": '{"input_ids":[]}',
    }
    assert "mix: read 8, enqueued 5, skipped 0, rejected 3" in res.stdout
    assert f"{data}: format prompt" in res.stderr
    assert f"{data}:4: also format input_ids" in res.stderr
    assert f"{data}:5: also format instruction" in res.stderr
    assert f"{parquet}: format input_ids" in res.stderr
    assert f"rejected {data}:2: malformed JSON" in res.stderr
    assert f"rejected {data}:3: field 'prompt': expected a non-empty string" in res.stderr
    assert (
        f"rejected {parquet}:row 1: field 'input_ids': expected a non-empty list of integers, got list"
        in res.stderr
    )
    jobs = _queued(conn, namespace, "mix")
    assert sorted(jobs) == ["mix-0", "mix-3", "mix-4", "mix-5", "mix-7"]
    assert jobs["mix-4"]["text"] == "Say hi." and jobs["mix-7"]["input_ids"] == [9]


def test_conversations_without_tokenizer_are_refused_by_the_command(procs, tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", [{"conversations": CONVERSATION}])
    res = procs.run("enqueue", data)
    assert res.returncode != 0
    assert "format sharegpt holds conversations: give --tokenizer" in res.stderr
    res = procs.run("enqueue", data, "--format", "messages")
    assert res.returncode != 0 and "--format messages needs --tokenizer" in res.stderr
    res = procs.run("enqueue", data, "--system-prompt", "x")
    assert res.returncode != 0 and "--system-prompt needs --tokenizer" in res.stderr
