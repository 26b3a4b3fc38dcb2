"""Rows enqueue cannot carry: rejected alone, named with file:line and why, kept in a rejects file,
and said by the exit status (issues #23 item 8, #26 items 10 and 11)."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest
from rq import Queue

from genq.keys import Keys
from tests.helpers import genq_argv, read_jsonl, write_jsonl

# (raw JSON of a row's extra field, what the rejection says): each in a field genq does not read,
# so only the reading of the row can refuse it.
BAD = [
    (rb'"a\ud800b"', "a lone surrogate in a string"),
    (b"123456789012345678901234567890", "the integer 123456789012345678901234567890 is beyond 64 bits"),
    (b"-9223372036854775809", "the integer -9223372036854775809 is beyond 64 bits"),
    (b"NaN", "NaN or Infinity is not a JSON value"),
    (b"-Infinity", "NaN or Infinity is not a JSON value"),
    (b'"caf\xe9"', "not valid UTF-8 text"),
]
EXIT_REJECTED = 3


def _rows() -> list[bytes]:
    """Good rows with each bad one between two of them: rows 0, 2, 4, ... are good."""
    rows = [orjson.dumps({"prompt": "row 0", "meta": 18446744073709551615})]  # u64 max: still fine
    for i, (value, _) in enumerate(BAD):
        rows.append(b'{"prompt": "bad", "meta": ' + value + b"}")
        rows.append(orjson.dumps({"prompt": f"row {2 * i + 2}"}))
    return rows


def _write(path, rows: list[bytes]) -> dict[int, int]:
    """Write rows as JSON Lines (.jsonl) or a JSON array (.json), one per line; returns each
    row's line number."""
    if path.suffix == ".jsonl":
        path.write_bytes(b"\n".join(rows) + b"\n")
        return {i: i + 1 for i in range(len(rows))}
    path.write_bytes(b"[\n" + b",\n".join(rows) + b"\n]\n")
    return {i: i + 2 for i in range(len(rows))}


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_each_bad_value_rejects_its_row_alone(procs, conn, namespace, tmp_path, suffix):
    data = tmp_path / f"bad{suffix}"
    rows = _rows()
    lines = _write(data, rows)
    rejects = tmp_path / "rejects.jsonl"
    res = procs.run("enqueue", data, "--dataset", "bad", "--rejects", rejects)
    assert res.returncode == EXIT_REJECTED, res.stderr
    assert f"bad: read {len(rows)}, enqueued {len(BAD) + 1}, skipped 0, rejected {len(BAD)}" in res.stdout
    for i, (_, why) in enumerate(BAD):
        assert f"rejected {data}:{lines[2 * i + 1]}: {why}" in res.stderr, res.stderr
    keys = Keys(namespace)
    queue = Queue(keys.queue_name("bad"), connection=conn, serializer="json")
    good = range(0, len(rows), 2)
    assert sorted(queue.job_ids) == sorted(keys.job_id(f"bad-{row}") for row in good)
    assert queue.fetch_job(keys.job_id("bad-12")).kwargs["text"] == "row 12"
    listed = read_jsonl(rejects)
    assert [e["line"] for e in listed] == [lines[2 * i + 1] for i in range(len(BAD))]
    for entry, (_, why), row in zip(listed, BAD, range(1, len(rows), 2), strict=True):
        assert entry["file"] == str(data) and entry["dataset_row"] == row
        assert entry["reason"].startswith(why)
        assert entry["raw"] == rows[row].decode("utf-8", "replace")


def test_an_enormous_row_is_rejected_without_being_held(procs, conn, namespace, tmp_path):
    """A 200 MB line and a 200 MB array element, with --max-row-bytes 1MiB: each rejected, the rows
    after them enqueued, and the enqueue's peak memory far below the row's size."""
    size = 200 << 20
    line = tmp_path / "huge.jsonl"
    with line.open("wb") as fh:
        fh.write(b'{"prompt": "first"}\n{"prompt": "')
        fh.write(b"x" * size)
        fh.write(b'"}\n{"prompt": "after"}\n')
    array = tmp_path / "huge.json"
    with array.open("wb") as fh:
        fh.write(b'[{"prompt": "first"},\n{"prompt": ["')
        # Brackets and escaped quotes inside a string are not structure.
        fh.write((b"x" * 4091 + b'\\"[{]') * (size >> 12))
        fh.write(b'", {"a": [1, 2]}]},\n{"prompt": "after"}]\n')
    keys = Keys(namespace)
    for data in (line, array):
        # A parent of its own: its RUSAGE_CHILDREN peak is the enqueue's alone.
        measure = "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]).returncode; "
        measure += "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r)"
        argv = genq_argv("enqueue", data, "--dataset", data.suffix[1:], "--max-row-bytes", "1MiB")
        res = subprocess.run(
            [sys.executable, "-c", measure, *argv], env=procs.env, capture_output=True, text=True, timeout=300
        )
        assert res.returncode == EXIT_REJECTED, res.stderr
        assert f"rejected {data}:2: the row is larger than --max-row-bytes 1048576" in res.stderr
        peak_kib = int(res.stdout.split()[-1])
        assert peak_kib < 120 << 10, f"{data.name}: the enqueue peaked at {peak_kib >> 10} MiB"
        queue = Queue(keys.queue_name(data.suffix[1:]), connection=conn, serializer="json")
        name = data.suffix[1:]
        assert sorted(queue.job_ids) == sorted([keys.job_id(f"{name}-0"), keys.job_id(f"{name}-2")])


def test_the_exit_status_says_rows_were_rejected_unless_allowed(procs, conn, namespace, tmp_path):
    data = write_jsonl(tmp_path / "some.jsonl", [{"prompt": "good"}, {"text": "no prompt"}])
    res = procs.run("enqueue", data)
    assert res.returncode == EXIT_REJECTED
    assert "some: read 2, enqueued 1, skipped 0, rejected 1" in res.stdout
    assert res.stderr.splitlines()[-1] == (
        "Error: some: 1 rows rejected (listed above; --rejects FILE keeps them); the other rows are "
        f"enqueued. Fix them and run again, or pass --allow-rejects to accept (exit {EXIT_REJECTED})"
    )
    rejects = tmp_path / "env-rejects.jsonl"
    res = procs.run("enqueue", data, "--allow-rejects", env={"GENQ_REJECTS": str(rejects)})
    assert res.returncode == 0, res.stderr
    assert "some: read 2, enqueued 0, skipped 1, rejected 1" in res.stdout
    [entry] = read_jsonl(rejects)
    assert entry == {
        "file": str(data),
        "line": 2,
        "dataset_row": 1,
        "field": None,
        "reason": entry["reason"],
        "raw": '{"text":"no prompt"}',
    }
    assert entry["reason"].startswith("no prompt: expected field")
    clean = write_jsonl(tmp_path / "clean.jsonl", [{"prompt": "good"}])
    assert procs.run("enqueue", clean).returncode == 0


def test_row_messages_say_what_is_missing_and_the_fix(procs, tmp_path, tokenizer_dir):
    data = write_jsonl(
        tmp_path / "msgs.jsonl",
        [
            {"convos": [{"from": "human", "value": "hi"}], "id": 1},
            {"conversations": [{"from": "human"}]},
            {"messages": [{"role": "user"}]},
            {"Prompt": "hello"},
        ],
    )
    rejects = tmp_path / "r.jsonl"
    res = procs.run("enqueue", data, "--tokenizer", tokenizer_dir, "--rejects", rejects)
    assert res.returncode == EXIT_REJECTED, res.stderr
    err = res.stderr
    assert (
        "(fields present: convos, id); if 'convos' holds the sharegpt rows, pass --field conversations=convos"
        in err
    )
    assert f"{data}:2: field 'conversations'[0].value: missing (the turn has 'from')" in err
    assert f"{data}:3: field 'messages'[0].content: missing (the turn has 'role')" in err
    assert "(fields present: Prompt); if 'Prompt' holds the prompt rows, pass --field prompt=Prompt" in err
    fields = [e["field"] for e in read_jsonl(rejects)]
    assert fields == [None, "conversations[0].value", "messages[0].content", None]


@pytest.mark.timeout(300)
def test_genq_run_keeps_and_reports_its_rejects(tmp_path):
    data = write_jsonl(
        tmp_path / "mixed.jsonl", [{"prompt": "one"}, {"text": "no prompt"}, {"prompt": "two"}]
    )
    out = tmp_path / "out"
    argv = genq_argv("run", data, "--out", out, "--simulate", "--sim-latency", "zero", "--workers", "1")
    res = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert res.returncode == EXIT_REJECTED, res.stderr[-3000:]
    rejects = out / "mixed" / "rejected.jsonl"
    assert f"genq run: mixed: 1 rows rejected, listed in {rejects}; the other rows run" in res.stderr
    assert f"mixed: 1 rows rejected at enqueue -> {rejects}" in res.stdout
    assert "mixed: 2 done, 0 failed of 2" in res.stdout
    assert [e["line"] for e in read_jsonl(rejects)] == [2]
    res = subprocess.run([*argv, "--allow-rejects"], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"mixed: 1 rows rejected at enqueue -> {rejects}" in res.stdout
