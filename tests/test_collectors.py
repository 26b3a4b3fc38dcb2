"""Several collectors on one namespace: a lease per dataset shares the datasets out, and a standby
takes over a dataset whose collector died."""

from __future__ import annotations

import re

import pytest

from tests.helpers import (
    check_records,
    log_of,
    sigkill,
    status_json,
    stop,
    wait_until,
    write_prompts,
    written_lines,
)

PARAMS = {"max_new_tokens": 300}


def _lease_of(proc) -> str:
    """The lease id a collector logs at start: ``collector <host:pid:nonce>: draining ...``."""
    line = next(line for line in log_of(proc).splitlines() if ": draining " in line)
    return line.split("collector ", 1)[1].split(": draining", 1)[0]


@pytest.mark.timeout(660)  # its waits and stops add up to 600 s
@pytest.mark.slow
def test_datasets_drain_through_their_own_collectors_and_a_standby_takes_over(
    procs, start_sim, out, tmp_path
):
    sim = start_sim("--latency", "realistic", "--decode-step-ms", "2")
    names = ("a", "b", "c")
    prompts = {}
    for name in names:
        prompts[name] = write_prompts(tmp_path / f"{name}.jsonl", 300, start=names.index(name) * 1000)
        assert procs.run("enqueue", tmp_path / f"{name}.jsonl", "--max-new-tokens", "300").returncode == 0
    first = procs.start("collect", "--out", out, "--dataset", "a", "--dataset", "b")
    second = procs.start("collect", "--out", out, "--dataset", "c")
    holders = lambda: status_json(procs)["stream"]["collectors"]  # noqa: E731
    wait_until(
        lambda: set(holders()) == set(names) and all(holders().values()), 30, "a collector for each dataset"
    )
    wait_until(lambda: all(": draining " in log_of(c) for c in (first, second)), 30, "the collectors' start")
    ids = {"first": _lease_of(first), "second": _lease_of(second)}
    assert holders() == {"a": ids["first"], "b": ids["first"], "c": ids["second"]}
    standby = procs.start("collect", "--out", out)  # every dataset, all held: it waits
    wait_until(lambda: "standing by" in log_of(standby), 30, "the standby")

    worker = procs.start("worker", "--server", sim, "--burst", "--concurrency", "64")
    c_raw = out / "c" / "raw_responses.jsonl"
    wait_until(lambda: c_raw.exists() and c_raw.stat().st_size > 0, 60, "records of c on disk")
    sigkill(second)  # a dead holder on this host: the standby takes its dataset at once
    left = 300 - len(written_lines(c_raw))
    assert left > 0, "the holder of c died after writing all of c: nothing was left to take over"
    wait_until(lambda: holders()["c"] == _lease_of(standby), 30, "the standby to hold c")
    assert holders()["a"] == holders()["b"] == ids["first"], "the live collector keeps its datasets"

    assert worker.wait(180) == 0, log_of(worker)
    done = lambda: all(status_json(procs)["datasets"][n]["done"] == 300 for n in names)  # noqa: E731
    wait_until(done, 120, "every record on disk")
    assert stop(first) == 0 and stop(standby) == 0, log_of(first) + log_of(standby)
    for name in names:
        check_records(out, name, prompts[name], PARAMS)
    assert "holds dataset c" in log_of(standby)
    written = re.search(r"stopped \((\d+) written", log_of(standby))
    assert written and int(written.group(1)) >= left, f"the standby wrote the {left} records of c left"
    assert "holds dataset a" not in log_of(standby) and "holds dataset b" not in log_of(standby)
    assert "holds dataset c" not in log_of(first)
