"""`genq stats DIR`: exact numbers from a folder mixing every record shape and malformed lines."""

from __future__ import annotations

from pathlib import Path

import orjson

from tests.helpers import Procs, write_jsonl


def genq_record(i: int, prompt: int, completion: int, finish: str, latency: float) -> dict:
    return {
        "id": f"mix-{i}",
        "dataset": "mix",
        "row": i,
        "sample": 0,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "output_ids": list(range(completion)),
        "finish_reason": finish,
        "latency_s": latency,
        "schema": 1,
    }


def chat(prompt: int, completion: int, finish: str, reasoning_key: str) -> dict:
    """An OpenAI chat completion as an older script saved it: usage nested, reasoning beside content."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "answer", reasoning_key: "thoughts"},
                "finish_reason": finish,
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def build_folder(root: Path) -> None:
    for folder in ("mix", "other", ".logs"):
        (root / folder).mkdir(parents=True)
    write_jsonl(
        root / "mix" / "raw_responses.jsonl",
        [
            genq_record(0, 10, 100, "stop", 1.0),
            genq_record(1, 20, 300, "length", 3.0),
            chat(30, 50, "stop", "reasoning_content"),
            chat(40, 250, "length", "reasoning"),
            '{"id": "torn", "choices": [',  # line 5: not JSON
            {"choices": [{"message": {"content": "no usage here"}}]},  # line 6: its tokens are unknown
            "",
            [1, 2, 3],  # line 8: JSON, but not an object
        ],
    )
    write_jsonl(
        root / "mix" / "generate.jsonl",
        [
            {
                "text": "x",
                "output_ids": [1, 2],
                "meta_info": {
                    "finish_reason": {"type": "stop", "matched": 2},
                    "prompt_tokens": 5,
                    "completion_tokens": 60,
                    "e2e_latency": 2.0,
                },
            },
            {"text": "y", "prompt_tokens": 15, "completion_tokens": 40, "finish_reason": {"type": "length"}},
            {"prompt": "a row of the input, not a result"},  # line 3
        ],
    )
    write_jsonl(
        root / "mix" / "tokenized_data.jsonl",
        [
            {"input_ids": list(range(10)), "loss_mask": [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]},
            {"input_ids": list(range(5)), "loss_mask": [0, 0, 1, 1, 1]},
            {"input_ids": [1, 2, 3], "loss_mask": [0, 1]},  # line 3: lengths differ
        ],
    )
    write_jsonl(
        root / "mix" / "errors.jsonl",
        [
            {
                "id": "mix-9",
                "dataset": "mix",
                "row": 9,
                "error": "bad_request",
                "message": "too long",
                "schema": 1,
            }
        ],
    )
    write_jsonl(
        root / "other" / "raw_responses.jsonl",
        (genq_record(i, 1, 10 * (i + 1), "stop", 0.5) for i in range(3)),
    )
    write_jsonl(root / ".logs" / "ignored.jsonl", [{"not": "read"}])


def test_stats_json_reads_every_shape_and_counts_malformed_lines(procs: Procs, tmp_path):
    root = tmp_path / "mixed"
    build_folder(root)
    res = procs.run("stats", root, "--json", env={"GENQ_REDIS_URL": "redis://127.0.0.1:1/0"})  # no Redis used
    assert res.returncode == 0, res.stderr
    data = orjson.loads(res.stdout)["datasets"]
    assert set(data) == {"mix", "other"}
    mix = data["mix"]
    assert mix["records"] == 8
    assert mix["prompt_tokens"] == 10 + 20 + 30 + 40 + 5 + 15 + 4 + 2
    assert mix["completion_tokens"] == 100 + 300 + 50 + 250 + 60 + 40 + 6 + 3
    assert mix["avg_completion_tokens"] == 101.1
    # lengths 3, 6, 40, 50, 60, 100, 250, 300 (inclusive quantiles)
    assert mix["completion_tokens_percentiles"] == {
        "min": 3,
        "p50": 55.0,
        "p90": 265.0,
        "p99": 296.5,
        "max": 300,
    }
    assert mix["finish_reasons"] == {"stop": 3, "length": 3, "unknown": 2}
    assert mix["latency_s"] == {"min": 1.0, "p50": 2.0, "p90": 2.8, "p99": 2.98, "max": 3.0}
    assert mix["shapes"] == {"genq": 2, "openai": 2, "generate": 2, "tokenized": 2}
    assert mix["errors"] == {"bad_request": 1}
    assert mix["unrecognized"] == {
        "lines": 5,
        "examples": [
            "mix/generate.jsonl:3: unknown shape (keys: prompt)",
            "mix/raw_responses.jsonl:5: not JSON",
            "mix/raw_responses.jsonl:6: openai record without an integer usage.prompt_tokens",
            "mix/raw_responses.jsonl:8: a JSON list, not an object",
            "mix/tokenized_data.jsonl:3: "
            "tokenized row whose input_ids and loss_mask are not lists of one length",
        ],
    }
    other = data["other"]
    assert (other["records"], other["prompt_tokens"], other["completion_tokens"]) == (3, 3, 60)
    assert other["avg_completion_tokens"] == 20.0
    assert other["unrecognized"] == {"lines": 0, "examples": []}


def test_stats_text_names_unrecognized_lines_and_a_folder_of_one_dataset(procs: Procs, tmp_path):
    root = tmp_path / "mixed"
    build_folder(root)
    res = procs.run("stats", root)
    assert res.returncode == 0, res.stderr
    assert "5 unrecognized lines (not counted)" in res.stdout
    assert "mix/raw_responses.jsonl:5: not JSON" in res.stdout
    # Pointed at one dataset's folder, files directly in it are that dataset.
    res = procs.run("stats", root / "other", "--json")
    assert orjson.loads(res.stdout)["datasets"]["other"]["records"] == 3


def test_stats_piped_prints_every_number_whole(procs: Procs, tmp_path):
    """Piped (not a terminal), rich would assume 80 columns and cut numbers (`23,4…`)."""
    folder = tmp_path / "out" / "a-dataset-with-a-long-name-for-the-table"
    folder.mkdir(parents=True)
    write_jsonl(
        folder / "raw_responses.jsonl",
        [
            {"id": f"x-{i}", "prompt_tokens": 123_456_789, "completion_tokens": 23_456_789, "output_ids": [1]}
            for i in range(3)
        ],
    )
    res = procs.run("stats", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    assert "…" not in res.stdout, res.stdout
    for number in ("370,370,367", "70,370,367", "23,456,789", "a-dataset-with-a-long-name-for-the-table"):
        assert number in res.stdout, res.stdout


def test_stats_after_an_export_counts_each_record_once(procs: Procs, tmp_path):
    """`genq export` writes beside raw_responses.jsonl by default; stats must not count those
    records again, nor call genq's own export files an unknown shape. The same file names in a
    folder of their own (another tool's output) are still read."""
    out = tmp_path / "out"
    (out / "run").mkdir(parents=True)
    write_jsonl(
        out / "run" / "raw_responses.jsonl",
        [
            {"id": f"run-{i}", "row": i, "input_ids": [1, 2], "output_ids": [3, 4, 5], "prompt_tokens": 2,
             "completion_tokens": 3, "finish_reason": "stop", "messages": [{"role": "user", "content": "q"}],
             "content": "a"}
            for i in range(3)
        ],
    )  # fmt: skip
    for fmt in ("eagle3", "sharegpt", "messages"):
        assert procs.run("export", out, "--format", fmt).returncode == 0
    (out / "other").mkdir()
    write_jsonl(out / "other" / "tokenized_data.jsonl", [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
    res = procs.run("stats", out, "--json")
    assert res.returncode == 0, res.stderr
    data = orjson.loads(res.stdout)["datasets"]
    assert (data["run"]["records"], data["run"]["completion_tokens"]) == (3, 9), data["run"]
    assert data["run"]["unrecognized"]["lines"] == 0, data["run"]
    assert data["other"]["records"] == 1
