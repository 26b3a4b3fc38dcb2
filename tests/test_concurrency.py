"""``--concurrency auto`` (worker/concurrency.py) against the simulator's KV-cache model.

The simulator over-admits and retracts when its KV cache runs out (sim/scheduler.py), and says so
on /v1/loads and /metrics as SGLang does; its capacity changes at run time (POST /sim/kv-tokens).
The worker's target is read where `genq status` reads it (the worker hash). Assertions are on the
target's trajectory and on the records (each prompt exactly once), never on timings.
"""

from __future__ import annotations

import statistics

import pytest

from tests.helpers import (
    assert_verified,
    finish_run,
    log_of,
    sim_post,
    sim_stats,
    status_json,
    wait_until,
    write_jsonl,
    write_prompts,
)

# Outputs of 100-200 tokens at 10 ms a step: each job holds its KV for seconds, so the cache,
# not the batch slots (256), bounds how many run at once.
SIM = ("--latency", "realistic", "--decode-step-ms", "10", "--min-len", "100", "--max-len", "200")


def targets(procs, n: int = 1) -> list[int] | None:
    """Each worker's target, once all n have reported one."""
    found = [w["target"] for w in status_json(procs)["workers"] if w["target"] is not None]
    return sorted(found) if len(found) == n else None


def settled(procs, samples: int, n: int = 1) -> list[list[int]]:
    """The next ``samples`` readings of the targets, one per report (every 2 s)."""
    seen: list[list[int]] = []

    def more() -> bool:
        now = targets(procs, n)
        if now is not None:
            seen.append(now)
        return len(seen) >= samples

    wait_until(more, 30 + 3 * samples, f"{samples} readings of the target", interval=2.0)
    return seen


def test_fixed_concurrency_is_the_target_and_never_moves(procs, start_sim, tmp_path):
    url = start_sim(*SIM)
    data = tmp_path / "fixed.jsonl"
    write_prompts(data, 40)
    assert procs.run("enqueue", data, "--max-new-tokens", "200").returncode == 0
    worker = procs.start("worker", "--server", url, "--concurrency", "12")
    assert wait_until(lambda: targets(procs), 30, "the worker's report") == [12]
    assert all(t == [12] for t in settled(procs, 4)), "a fixed --concurrency is never steered"
    assert "concurrency " not in log_of(worker)


@pytest.mark.slow
@pytest.mark.timeout(600)  # its waits: 60 + 54 + 60 + 48 + 60 + 240 s
def test_auto_follows_the_kv_capacity_and_loses_nothing(procs, start_sim, out, tmp_path):
    url = start_sim(*SIM, "--kv-tokens", "6000", "--enable-metrics")
    data = tmp_path / "auto.jsonl"
    total = 1500
    write_prompts(data, total)
    assert procs.run("enqueue", data, "--max-new-tokens", "200").returncode == 0
    worker = procs.start("worker", "--server", url, "--concurrency", "auto", "--max-concurrency", "400")
    collector = procs.start("collect", "--out", out)

    # Grows from its start (32) until the cache is full, then holds near what fits (~6000 / 170).
    wait_until(lambda: (targets(procs) or [0])[0] > 40, 60, "the target to grow past its start")
    level = statistics.median(t for (t,) in settled(procs, 8))
    assert 20 <= level <= 200, level

    # Half the cache: retractions and a queue, so the target shrinks.
    sim_post(url, "/sim/kv-tokens", {"kv_tokens": 3000})
    wait_until(lambda: targets(procs)[0] <= 0.7 * level, 60, f"the target to shrink below {0.7 * level}")
    assert sim_stats(url)["retracted"] > 0
    low = statistics.median(t for (t,) in settled(procs, 6))

    # Four times that: room again, so it grows past where it was.
    sim_post(url, "/sim/kv-tokens", {"kv_tokens": 12000})
    wait_until(lambda: targets(procs)[0] >= 1.5 * low, 60, f"the target to grow past {1.5 * low}")
    assert "concurrency " in log_of(worker), "the moves are logged"

    finish_run(procs, "auto", total, 240, worker, collector)
    assert_verified(procs, out, data)


@pytest.mark.slow
@pytest.mark.timeout(480)  # its waits: 90 + 60 + 240 s
def test_two_workers_on_one_server_settle_without_oscillating(procs, start_sim, out, tmp_path):
    url = start_sim(*SIM, "--kv-tokens", "8000", "--enable-metrics")
    data = tmp_path / "two.jsonl"
    total = 1200
    write_prompts(data, total)
    assert procs.run("enqueue", data, "--max-new-tokens", "200").returncode == 0
    auto = ("--concurrency", "auto", "--max-concurrency", "400")
    workers = [procs.start("worker", "--server", url, *auto) for _ in range(2)]
    collector = procs.start("collect", "--out", out)
    wait_until(lambda: sim_stats(url)["retracted"] > 0 or sim_stats(url)["queued"] > 0, 90, "a full cache")
    readings = settled(procs, 10, n=2)
    both = [sum(r) for r in readings]
    # Together they hold near what the cache fits (~8000 / 170 running, a small queue), each
    # moving within a band rather than swinging between the floor and the ceiling.
    assert 20 <= statistics.median(both) <= 250, readings
    for i in range(2):
        mine = [r[i] for r in readings]
        assert max(mine) <= 3 * min(mine), readings
    finish_run(procs, "two", total, 240, *workers, collector)
    assert_verified(procs, out, data)


@pytest.mark.slow
@pytest.mark.timeout(360)  # its waits: 60 + 180 s
def test_without_a_load_signal_429s_shrink_it(procs, start_sim, out, tmp_path):
    """A hosted chat API says nothing of its load: answers' latency and 429s steer instead."""
    lengths = ("--min-len", "20", "--max-len", "40")
    url = start_sim("--api", "openai-chat", *SIM[:4], *lengths, "--fail-429", "0.5")
    data = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": f"question {i}"} for i in range(400)])
    assert procs.run("enqueue", data, "--server", url, "--max-new-tokens", "40").returncode == 0
    worker = procs.start(
        "worker", "--server", url, "--concurrency", "auto", "--max-attempts", "50", "--max-concurrency", "64"
    )
    collector = procs.start("collect", "--out", out)
    wait_until(lambda: targets(procs) == [8], 60, "the target down to the floor under 429s")
    sim_post(url, "/sim/faults", {"error_429": 0.0})
    finish_run(procs, "chat", 400, 180, worker, collector)
    assert_verified(procs, out, data)
