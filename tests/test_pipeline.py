"""End to end on real Redis, real processes and the simulator over HTTP."""

from __future__ import annotations

import orjson
import pytest

from tests.helpers import (
    assert_adds_up,
    check_records,
    kill_collector_mid_write,
    log_of,
    read_jsonl,
    sigkill,
    sim_stats,
    status_json,
    stop,
    wait_all,
    wait_until,
    write_jsonl,
    write_prompts,
)

PARAMS = {"max_new_tokens": 200}
LONG = {"min_len": 1500, "max_len": 1600}  # matches the --min-len/--max-len below


@pytest.mark.slow
def test_thousand_prompts_two_workers_one_collector(procs, start_sim, out, tmp_path):
    url = start_sim(
        "--fail-500", "0.03", "--fail-reset", "0.01", "--fail-abort", "0.01", "--fail-truncate", "0.01"
    )
    data = tmp_path / "big.jsonl"
    prompts = write_prompts(data, 1200)
    assert procs.run("enqueue", data, "--max-new-tokens", "200").returncode == 0
    collector = procs.start("collect", "--out", out, "--burst")
    workers = [procs.start("worker", "--server", url, "--burst", "--concurrency", "64") for _ in range(2)]
    started = [*workers, collector]
    assert wait_all(started, 200) == [0, 0, 0], [log_of(p) for p in started]
    # The scenario happened: the server injected each kind of fault, and records needed retries.
    fired = sim_stats(url)["faults"]
    kinds = ("error_500", "reset", "abort", "truncate")
    assert all(fired[k] > 0 for k in kinds), f"faults injected by the server: {fired}; expected {kinds}"
    records = read_jsonl(out / "big" / "raw_responses.jsonl")
    assert any(r["attempts"] > 1 for r in records), "faults were injected: some records needed retries"
    records = check_records(out, "big", prompts, PARAMS)
    assert len({r["worker"] for r in records}) == 2, "both workers took jobs"
    assert not read_jsonl(out / "big" / "errors.jsonl")
    status = status_json(procs)
    states = ("total", "queued", "in_flight", "retrying", "done", "failed", "unaccounted")
    assert {k: status["datasets"]["big"][k] for k in states} == {
        "total": 1200,
        "queued": 0,
        "in_flight": 0,
        "retrying": 0,
        "done": 1200,
        "failed": 0,
        "unaccounted": 0,
    }
    assert status["stream"]["length"] == 0


def test_prompt_too_long_fails_at_once_with_the_servers_message(procs, start_sim, out, tmp_path):
    url = start_sim("--context-length", "256")
    data = write_jsonl(tmp_path / "long.jsonl", [{"input_ids": [101] * 10}, {"input_ids": [101] * 200}])
    assert procs.run("enqueue", data, "--max-new-tokens", "100").returncode == 0
    worker = procs.start("worker", "--server", url, "--burst")
    assert worker.wait(60) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    errors = read_jsonl(out / "long" / "errors.jsonl")
    assert [e["id"] for e in errors] == ["long-1"]
    assert errors[0]["error"] == "bad_request" and errors[0]["status"] == 400
    assert errors[0]["attempts"] == 1, "a 400 is never retried"
    assert "maximum context length of 256 tokens" in errors[0]["message"]
    assert [r["id"] for r in read_jsonl(out / "long" / "raw_responses.jsonl")] == ["long-0"]
    status = status_json(procs)["datasets"]["long"]
    assert (status["done"], status["failed"], status["total"]) == (1, 1, 2)


def test_collector_killed_mid_drain_loses_and_duplicates_nothing(procs, start_sim, out, tmp_path):
    url = start_sim()
    data = tmp_path / "k.jsonl"
    prompts = write_prompts(data, 1500)
    assert procs.run("enqueue", data, "--max-new-tokens", "200").returncode == 0
    worker = procs.start("worker", "--server", url, "--burst")
    assert worker.wait(120) == 0, log_of(worker)
    assert status_json(procs)["stream"]["length"] == len(prompts), "every result waits in the stream"
    raw = out / "k" / "raw_responses.jsonl"
    # Kill it three times while it drains that backlog, each time at another point: small batches
    # (an fsync each) keep it writing a while; each kill must leave lines still to write.
    kill_collector_mid_write(procs, out, raw, len(prompts))
    # A crash can also leave half a line behind.
    with raw.open("ab") as fh:
        fh.write(b'{"id": "k-torn", "dataset"')
    collector = procs.start("collect", "--out", out, "--burst")
    assert collector.wait(60) == 0, log_of(collector)
    assert "cut a torn last line" in log_of(collector)
    check_records(out, "k", prompts, PARAMS)
    assert_adds_up(status_json(procs))


@pytest.mark.slow
def test_worker_sigterm_drains_and_puts_back_what_is_left(procs, start_sim, out, tmp_path):
    # Realistic latency: 1,500-token outputs take several seconds, so jobs are in flight at SIGTERM.
    url = start_sim(
        "--latency", "realistic", "--min-len", "1500", "--max-len", "1600", "--decode-step-ms", "5"
    )
    data = tmp_path / "slow.jsonl"
    prompts = write_prompts(data, 40)
    assert procs.run("enqueue", data, "--max-new-tokens", "2000").returncode == 0
    worker = procs.start("worker", "--server", url, "--concurrency", "16", "--grace", "1")
    # 16 sent, 4 taken ahead for the next free slots (WorkerConfig.prefetch: concurrency // 4).
    wait_until(lambda: status_json(procs)["datasets"]["slow"]["in_flight"] == 20, 30, "20 jobs in flight")
    assert stop(worker, timeout=30) == 0, log_of(worker)
    status = status_json(procs)["datasets"]["slow"]
    assert status["in_flight"] == 0 and status["queued"] == 40, status
    assert "put 4 jobs taken ahead back" in log_of(worker) and "put 16 jobs back" in log_of(worker)
    # Everything still completes, once.
    worker = procs.start("worker", "--server", url, "--burst", "--concurrency", "40")
    assert worker.wait(120) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    check_records(out, "slow", prompts, {"max_new_tokens": 2000}, **LONG)


@pytest.mark.slow
def test_worker_sigkill_its_jobs_run_again_elsewhere(procs, start_sim, out, tmp_path):
    url = start_sim(
        "--latency", "realistic", "--min-len", "1500", "--max-len", "1600", "--decode-step-ms", "5"
    )
    data = tmp_path / "dead.jsonl"
    prompts = write_prompts(data, 30)
    assert procs.run("enqueue", data, "--max-new-tokens", "2000").returncode == 0
    victim = procs.start("worker", "--server", url, "--concurrency", "10", "--heartbeat-ttl", "5")
    # 10 sent and 2 taken ahead (WorkerConfig.prefetch): all 12 die with the worker.
    wait_until(lambda: status_json(procs)["datasets"]["dead"]["in_flight"] == 12, 30, "12 jobs in flight")
    sigkill(victim)
    collector = procs.start("collect", "--out", out, "--burst")
    survivor = procs.start(
        "worker", "--server", url, "--burst", "--concurrency", "30", "--heartbeat-ttl", "5"
    )
    assert survivor.wait(180) == 0, log_of(survivor)
    assert collector.wait(60) == 0, log_of(collector)
    check_records(out, "dead", prompts, {"max_new_tokens": 2000}, **LONG)


def test_collector_started_before_the_dataset_marks_its_files_before_writing(
    procs, start_sim, out, tmp_path, redis_url
):
    """A dataset first seen mid-run whose folder already holds results (a wiped Redis, a new
    namespace): the collector reads what is on disk before appending, so nothing is written twice."""
    url = start_sim()
    data = tmp_path / "seen.jsonl"
    prompts = write_prompts(data, 200)
    for namespace in ("before", "after"):
        env = {"GENQ_NAMESPACE": namespace}
        collector = procs.start("collect", "--out", out, env=env)
        wait_until(lambda c=collector: "draining" in log_of(c), 30, "the collector to start")
        assert procs.run("enqueue", data, "--max-new-tokens", "200", env=env).returncode == 0
        assert procs.run("worker", "--server", url, "--burst", env=env).returncode == 0
        wait_until(
            lambda e=env: (
                orjson.loads(procs.run("status", "--json", env=e).stdout)["totals"]["in_flight"] == 0
            ),
            60,
            "the stream to drain",
        )
        assert stop(collector) == 0, log_of(collector)
    assert "marked 200 ids found on disk" in log_of(collector)
    check_records(out, "seen", prompts, PARAMS)


def test_two_namespaces_with_a_dataset_of_the_same_name_do_not_mix(procs, start_sim, tmp_path):
    """RQ keeps jobs at rq:job:<id> whatever the queue: genq's job ids carry the namespace."""
    url = start_sim()
    runs = {}
    for namespace, offset in (("alpha", 0), ("beta", 5000)):
        folder = tmp_path / namespace
        folder.mkdir()
        data = folder / "same.jsonl"
        runs[namespace] = (write_prompts(data, 150, start=offset), folder / "out")
        env = {"GENQ_NAMESPACE": namespace}
        assert procs.run("enqueue", data, "--max-new-tokens", "200", env=env).returncode == 0
    # Both queued at once, then both run at once.
    procs_started = []
    for namespace, (_, out) in runs.items():
        env = {"GENQ_NAMESPACE": namespace}
        procs_started.append(procs.start("worker", "--server", url, "--burst", env=env))
        procs_started.append(procs.start("collect", "--out", out, "--burst", env=env))
    assert wait_all(procs_started, 120) == [0] * 4, [log_of(p) for p in procs_started]
    for prompts, out in runs.values():
        check_records(out, "same", prompts, PARAMS)
