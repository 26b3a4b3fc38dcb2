"""Several collectors on one namespace: a lease per dataset shares the datasets out, and a standby
takes over a dataset whose collector died; files changed under a collector are reconciled once,
and an old lease holder that resumes late on a shared folder duplicates nothing."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from genq.keys import Keys
from genq.logprobs import FILE, frames, valid_end
from tests.helpers import (
    check_records,
    log_of,
    read_jsonl,
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
    # The standby first: it would take up the leases the first collector gives back as it stops
    # (as it should), while the first, held to a and b, never takes c.
    assert stop(standby) == 0 and stop(first) == 0, log_of(first) + log_of(standby)
    for name in names:
        check_records(out, name, prompts[name], PARAMS)
    assert "holds dataset c" in log_of(standby)
    written = re.search(r"stopped \((\d+) written", log_of(standby))
    assert written and int(written.group(1)) >= left, f"the standby wrote the {left} records of c left"
    assert "holds dataset a" not in log_of(standby) and "holds dataset b" not in log_of(standby)
    assert "holds dataset c" not in log_of(first)


def _done(procs, *names: str) -> dict[str, int]:
    datasets = status_json(procs)["datasets"]
    return {name: datasets[name]["done"] if name in datasets else 0 for name in names}


def _produce(procs, url: str, tmp_path: Path, rows: int) -> tuple[list, list]:
    """Rows 0..rows-1 of dataset a (with logprobs) and b (without), enqueued (rows already there
    are skipped) and answered; the prompts of each."""
    a = write_prompts(tmp_path / "a.jsonl", rows)
    b = write_prompts(tmp_path / "b.jsonl", rows, start=1000)
    assert (
        procs.run("enqueue", tmp_path / "a.jsonl", "--max-new-tokens", "50", "--logprobs", "3").returncode
        == 0
    )
    assert procs.run("enqueue", tmp_path / "b.jsonl", "--max-new-tokens", "50").returncode == 0
    assert procs.run("worker", "--server", url, "--burst").returncode == 0
    return a, b


def test_a_removed_logprobs_file_is_reconciled_once_and_the_other_dataset_keeps_landing(
    procs, start_sim, out, tmp_path
):
    """logprobs.bin of dataset a removed while the collector holds it open, then again while no
    collector runs (its checkpoint still says otherwise): each time it is started afresh with one
    warning, a's records keep their frames from then on, and b keeps landing."""
    url = start_sim()
    params = {"max_new_tokens": 50}
    collector = procs.start("collect", "--out", out, "--batch", "10")
    _produce(procs, url, tmp_path, 30)
    wait_until(lambda: _done(procs, "a", "b") == {"a": 30, "b": 30}, 60, "the first 30 rows of each")
    lp = out / "a" / FILE
    first = {record_id for _, _, record_id, _ in frames(lp)}
    assert len(first) == 30
    lp.unlink()  # removed while open
    a, b = _produce(procs, url, tmp_path, 60)
    wait_until(lambda: _done(procs, "a", "b") == {"a": 60, "b": 60}, 60, "rows 30-59 of each")
    assert stop(collector) == 0, log_of(collector)
    records = check_records(out, "a", a, params)
    check_records(out, "b", b, params)
    later = {r["id"] for r in records} - first
    assert {record_id for _, _, record_id, _ in frames(lp)} == later, "each later record has its frame"
    assert valid_end(lp) == lp.stat().st_size
    log = log_of(collector)
    assert log.count("was removed while open") == 1 and log.count("is missing while its checkpoint") == 1, log

    lp.unlink()  # removed while no collector runs: its checkpoint says otherwise
    a, b = _produce(procs, url, tmp_path, 80)
    res = procs.run("collect", "--out", out, "--burst", timeout=60)
    assert res.returncode == 0, res.stderr
    check_records(out, "a", a, params)
    check_records(out, "b", b, params)
    assert len({record_id for _, _, record_id, _ in frames(lp)}) == 20, "rows 60-79 have their frames"
    assert res.stderr.count("is missing while its checkpoint") == 1, res.stderr


def test_a_file_that_does_not_match_its_checkpoint_sets_its_dataset_aside_once(
    procs, start_sim, out, tmp_path
):
    """A line past a's checkpoint that is not one of its results: a is set aside with one error
    line (its results wait in Redis), b drains, and --burst exits 5 instead of waiting forever."""
    url = start_sim()
    _produce(procs, url, tmp_path, 20)
    assert procs.run("collect", "--out", out, "--burst", timeout=60).returncode == 0
    raw = out / "a" / "raw_responses.jsonl"
    with raw.open("ab") as fh:
        fh.write(b'{"note": "another tool wrote here"}\n')
    a, b = _produce(procs, url, tmp_path, 40)
    res = procs.run("collect", "--out", out, "--burst", timeout=60)
    assert res.returncode == 5, res.stderr
    assert res.stderr.count("dataset a set aside") == 1 and "is not a result of dataset a" in res.stderr
    check_records(out, "b", b, {"max_new_tokens": 50})
    assert len(read_jsonl(raw)) == 21, "a's file is left as it was"
    assert status_json(procs)["stream"]["collectors"].get("a") is None, "its lease is given up"


# Stops the collector it is loaded into (PYTHONPATH) just before its first write to
# raw_responses.jsonl, after every check it makes before writing: the seam is the write (or
# flush) called by collector/files.py Appender.sync, seen by a profile hook.
_STOP_BEFORE_WRITE = """
import os, signal, sys

def _hook(frame, event, arg):
    if event == "c_call" and arg.__name__ in ("write", "flush") and frame.f_code.co_name == "sync":
        if str(frame.f_locals["self"].path).endswith("raw_responses.jsonl"):
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGSTOP)

sys.setprofile(_hook)
"""


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_an_old_holder_appending_after_a_takeover_duplicates_nothing(
    procs, start_sim, out, tmp_path, conn, namespace
):
    """Collector A is stopped between its last check and its write; its lease lapses (expired at
    once here, as 15 s would); B takes the dataset over and writes everything, A's batch too.
    Then A resumes and appends its batch after B's lines. A commits nothing (its lease is gone),
    and B, finding bytes past the checkpoint it verified, drops the copies."""
    n = 100
    data = tmp_path / "t.jsonl"
    prompts = write_prompts(data, n)
    assert procs.run("enqueue", data, "--max-new-tokens", "50").returncode == 0
    assert procs.run("worker", "--server", start_sim(), "--burst").returncode == 0
    seam = tmp_path / "seam"
    seam.mkdir()
    (seam / "sitecustomize.py").write_text(_STOP_BEFORE_WRITE)
    old = procs.start("collect", "--out", out, "--batch", "20", env={"PYTHONPATH": str(seam)})
    wait_until(lambda: _stopped(old.pid), 30, "the old holder to stop before its first write")
    keys = Keys(namespace)
    conn.pexpire(keys.collector_lease("t"), 1)  # its lease lapses
    new = procs.start("collect", "--out", out, "--batch", "20")
    raw = out / "t" / "raw_responses.jsonl"
    wait_until(lambda: len(written_lines(raw)) == n, 60, "the new holder to write every record")
    os.kill(old.pid, signal.SIGCONT)
    assert old.wait(30) == 2, log_of(old)
    assert "lost the collector lease" in log_of(old)
    wait_until(lambda: len(written_lines(raw)) == n, 30, "the old holder's late copies dropped")
    assert stop(new) == 0, log_of(new)
    check_records(out, "t", prompts, {"max_new_tokens": 50})
    assert "that were on disk already" in log_of(new)
    checkpoint = int(conn.hget(keys.collector_offsets, str(raw)))
    assert checkpoint == raw.stat().st_size and len(read_jsonl(raw)) == n
    assert status_json(procs)["datasets"]["t"]["done"] == n
