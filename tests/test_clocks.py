"""Hosts whose clocks disagree (GPU hosts without NTP) change nothing: every time one host writes
for another to compare (heartbeat deadlines, registry scores, the reaper's checks) is Redis's
(genq/clock.py). Workers run under libfaketime, 100 s behind and 100 s ahead of the collector's
clock, their monotonic clocks untouched."""

from __future__ import annotations

import glob

import pytest

from tests.helpers import (
    assert_verified,
    check_records,
    log_of,
    need,
    sim_stats,
    status_json,
    stop,
    wait_until,
    write_prompts,
)

N = 160
PARAMS = {"max_new_tokens": 2000}
LONG = {"min_len": 600, "max_len": 900}  # a few seconds a job: long enough to be reaped in flight


def _faked(offset_s: int) -> dict[str, str]:
    """The environment that shifts a process's wall clock by ``offset_s`` (libfaketime)."""
    need("faketime")  # Debian's faketime brings libfaketime; .ci/run installs it
    (lib,) = glob.glob("/usr/lib/*/faketime/libfaketime.so.1") or [None]
    assert lib, "libfaketime.so.1 not found beside the faketime command"
    return {
        "LD_PRELOAD": lib,
        "FAKETIME": f"{offset_s:+d}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",  # asyncio's timers and genq's own intervals stay true
        "FAKETIME_NO_CACHE": "1",
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_workers_100_s_behind_and_ahead_generate_nothing_twice(procs, start_sim, out, tmp_path, report):
    sim = start_sim("--latency", "realistic", "--decode-step-ms", "4", "--min-len", "600", "--max-len", "900")
    data = tmp_path / "clocks.jsonl"
    prompts = write_prompts(data, N)
    assert procs.run("enqueue", data, "--max-new-tokens", "2000").returncode == 0
    collector = procs.start("collect", "--out", out)
    # The worker 100 s ahead reaps every 2 s (TTL 5 s), the one behind every 15 s (TTL 60 s), so
    # the reaper that runs is the one whose clock is ahead: every deadline the other writes by its
    # own clock would look 40 s lapsed to it.
    workers = [
        procs.start(
            "worker", "--server", sim, "--concurrency", "16", "--heartbeat-ttl", ttl, env=_faked(offset)
        )
        for offset, ttl in ((-100, "60"), (+100, "5"))
    ]
    wait_until(lambda: status_json(procs)["datasets"]["clocks"]["done"] == N, 240, "every record on disk")
    assert [w.poll() for w in workers] == [None, None], log_of(workers[0]) + log_of(workers[1])
    for role in (*workers, collector):
        assert stop(role) == 0, log_of(role)
    records = check_records(out, "clocks", prompts, PARAMS, **LONG)
    assert_verified(procs, out, data)
    generations = sim_stats(sim)["generations"]
    report(f"clocks ±100 s: {N} prompts, {generations} generations at the simulator")
    # Beside the records, each worker's start-up probe: a 1-token generation (worker/gate.py).
    assert generations == len(records) + len(workers), f"{generations - N - 2} prompts generated twice"
