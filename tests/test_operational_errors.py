"""Every operational error of every command is one line with what to do, never a traceback
(genq/commands/cli.py LazyGroup.invoke): a Redis nothing listens on, a Redis URL without a scheme."""

from __future__ import annotations

import pytest

from tests.helpers import write_jsonl

COMMANDS = [("status",), ("failed",), ("retry", "--all"), ("verify", "--out", "OUT", "DATA")]


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:1", "localhost:6379"], ids=["nothing-listens", "no-scheme"]
)
@pytest.mark.parametrize("command", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_one_line_with_what_to_do(procs, tmp_path, url, command):
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "hello"}])
    argv = [str(data) if a == "DATA" else str(tmp_path) if a == "OUT" else a for a in command]
    res = procs.run(*argv, env={"GENQ_REDIS_URL": url}, timeout=90)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    assert len([line for line in lines if line.startswith("Error: ")]) == 1, res.stderr
    hint = "redis://localhost:6379" if url == "localhost:6379" else "is redis-server running"
    assert hint in res.stderr, res.stderr


def test_enqueue_says_how_long_it_waits_for_redis_and_then_what_to_do(procs, tmp_path):
    """A Redis nothing listens on: enqueue says it retries and for how long (--redis-wait), then
    gives up with one line naming the URL and the three ways on."""
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "hello"}])
    res = procs.run(
        "enqueue", data, "--redis-wait", "2", env={"GENQ_REDIS_URL": "redis://127.0.0.1:1"}, timeout=60
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    # One line when the wait starts (not one per try), then the error.
    assert res.stderr.count("waiting for it, giving up after 2 s") == 1, res.stderr
    assert len(res.stderr.strip().splitlines()) == 2, res.stderr
    (error,) = [line for line in res.stderr.splitlines() if line.startswith("Error: ")]
    assert "Redis unreachable at redis://127.0.0.1:1" in error, error
    for way in ("Start redis-server there", "--redis", "GENQ_REDIS_URL", "`genq run`"):
        assert way in error, error
