"""Faults: server down or sick, hangs, poison prompts, retry budgets, Redis restarts, a full disk,
and operators' tools run the wrong way. Each test checks the invariants on the files on disk."""

from __future__ import annotations

import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from rq import Queue

from genq.commands.embedded import EmbeddedRedis, free_port
from genq.keys import Keys
from tests.helpers import (
    assert_adds_up,
    check_records,
    genq_argv,
    log_of,
    read_jsonl,
    server_up,
    sigkill,
    sim_post,
    sim_stats,
    status_json,
    stop,
    wait_until,
    write_jsonl,
    write_prompts,
    written_lines,
)

PARAMS = {"max_new_tokens": 200}
RQ = str(Path(sys.executable).parent / "rq")


@pytest.mark.timeout(660)  # its waits add up to 570 s, and a burst collect
@pytest.mark.slow
def test_server_down_sends_no_job_to_the_failed_list(procs, out, tmp_path, conn, namespace):
    """The server process dies twice under running jobs and comes back on the same port; with
    only 2 attempts per job nothing fails: neither the dropped connections of a crash nor the
    refused ones while it is down cost an attempt, and the worker waits on /health."""
    port = free_port()
    sim_argv = [
        *genq_argv("sim-server", "--port", str(port), "--latency", "realistic", "--decode-step-ms", "5")
    ]
    sim = subprocess.Popen(sim_argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "down.jsonl"
    prompts = write_prompts(data, 300)
    failed = Queue(Keys(namespace).queue_name("down"), connection=conn, serializer="json").failed_job_registry
    try:
        wait_until(lambda: server_up(url), 30, "the simulator")
        assert procs.run("enqueue", data, "--max-new-tokens", "200").returncode == 0
        worker = procs.start(
            "worker", "--server", url, "--burst", "--max-attempts", "2", "--concurrency", "32"
        )
        for crash in (1, 2):
            # At the server: the dataset's in_flight counts results waiting in the stream too.
            wait_until(lambda: sim_stats(url)["in_flight"] >= 10, 60, "10 requests in flight at the server")
            before = _judged(worker)
            sigkill(sim)
            wait_until(lambda c=crash: log_of(worker).count("looks down") >= c, 30, "the worker to notice")
            # Down for a while: the worker has judged the requests the crash dropped (each one is where
            # it would charge an attempt, and with 2 attempts fail the job at the second crash).
            wait_until(
                lambda b=before: _judged(worker) >= b + 10, 60, "the worker to judge the dropped requests"
            )
            gave_up = [line for line in log_of(worker).splitlines() if "failed for good" in line]
            assert not gave_up, f"crash {crash} sent jobs to the failed list: {gave_up[:3]}"
            assert failed.get_job_ids(cleanup=False) == [], f"crash {crash} sent jobs to the failed list"
            sim = subprocess.Popen(sim_argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_until(lambda c=crash: log_of(worker).count("is up again") >= c, 60, "the worker to resume")
        assert worker.wait(120) == 0, log_of(worker)
    finally:
        sim.kill()
    assert failed.get_job_ids(cleanup=False) == [], "a job went to the failed list"
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    check_records(out, "down", prompts, PARAMS)
    assert not read_jsonl(out / "down" / "errors.jsonl")


def test_sick_server_503s_pause_the_worker_until_health_returns(procs, start_sim, out, tmp_path):
    """Sick from the start: the worker's start-up probe (a 1-token generation) is refused, and it
    probes again with backoff; not a single job is sent until the server is healthy."""
    url = start_sim()
    data = tmp_path / "sick.jsonl"
    prompts = write_prompts(data, 200)
    sim_post(url, "/sim/health", {"healthy": False})
    assert procs.run("enqueue", data, "--max-new-tokens", "200").returncode == 0
    worker = procs.start("worker", "--server", url, "--burst", "--max-attempts", "2")
    # Alive and polling: three probes refused (1 s, then 2 s apart), with 200 jobs queued meanwhile.
    probed = lambda: log_of(worker).count("not ready")  # noqa: E731
    wait_until(lambda: probed() >= 3, 60, "the worker to probe the sick server 3 times")
    sent = sim_stats(url)
    probes = probed()  # read after the counters: a probe not yet logged is one more
    assert sent["generations"] == 0, sent
    assert sent["requests"] <= probes + 1, f"{sent['requests']} requests for {probes} probes: jobs were sent"
    status = status_json(procs)["datasets"]["sick"]
    assert (status["queued"], status["in_flight"]) == (200, 0), f"the worker took jobs: {status}"
    sim_post(url, "/sim/health", {"healthy": True})
    assert worker.wait(120) == 0, log_of(worker)
    refused = sim_stats(url)["unhealthy"]
    assert refused == probed(), f"{refused} requests refused for {probed()} probes: a job was sent while sick"
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    check_records(out, "sick", prompts, PARAMS)


def test_hung_requests_are_aborted_and_retried(procs, start_sim, out, tmp_path):
    url = start_sim()
    data = tmp_path / "hang.jsonl"
    prompts = write_prompts(data, 40)
    # Not --burst: the worker must be serving (its probe done) before the server starts hanging.
    worker = procs.start("worker", "--server", url, "--request-timeout", "1", "--max-attempts", "10")
    wait_until(lambda: "serving" in log_of(worker), 30, "the worker to probe the server")
    sim_post(url, "/sim/faults", {"hang": 1.0})
    assert procs.run("enqueue", data, "--max-new-tokens", "200").returncode == 0
    wait_until(lambda: sim_stats(url)["aborted"] >= 40, 60, "the first attempts to be given up and aborted")
    sim_post(url, "/sim/faults", {"hang": 0.0})
    wait_until(lambda: _in_stream(procs) == 40, 120, "every job to finish")
    assert stop(worker) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    records = check_records(out, "hang", prompts, PARAMS)
    assert all(r["attempts"] >= 2 for r in records)
    assert sim_stats(url)["in_flight"] == 0, "every hung request was aborted on the server"


def test_sigterm_during_a_hung_start_up_probe_stops_the_worker_at_once(procs, start_sim):
    """A server that hangs every generation holds the worker's start-up probe (its 1-token
    generation waits out a 120 s deadline); a SIGTERM meanwhile must not wait for it."""
    url = start_sim("--fail-hang", "1")
    worker = procs.start("worker", "--server", url)
    wait_until(lambda: sim_stats(url)["faults"]["hang"] >= 1, 30, "the probe's generation to hang")
    assert stop(worker, timeout=20) == 0, log_of(worker)
    assert "serving" not in log_of(worker)


def test_too_long_prompts_are_rejected_at_enqueue_naming_the_row(procs, start_sim, tmp_path):
    url = start_sim("--context-length", "512")
    data = tmp_path / "ctx.jsonl"
    write_jsonl(
        data, [{"input_ids": [101] * 100}, {"input_ids": [101] * 400}, {"prompt": "text is not counted"}]
    )
    res = procs.run("enqueue", data, "--max-new-tokens", "200", "--server", url)
    assert res.returncode == 3, res.stderr  # rows rejected, the rest enqueued
    assert "enqueued 2, skipped 0, rejected 1" in res.stdout
    assert f"{data}:2: field 'input_ids': 400 prompt tokens + max_new_tokens 200 do not fit" in res.stderr
    res = procs.run(
        "enqueue", data, "--dataset", "ctx2", "--max-new-tokens", "200", "--context-length", "4096"
    )
    assert res.returncode == 0, res.stderr
    assert "enqueued 3" in res.stdout


@pytest.mark.timeout(420)  # three workers' runs of up to 120 s each
@pytest.mark.slow
def test_attempt_budget_then_failed_and_retry(procs, start_sim, out, tmp_path):
    url = start_sim("--fail-500", "1.0")
    data = tmp_path / "budget.jsonl"
    prompts = write_prompts(data, 30)
    assert procs.run("enqueue", data, "--max-new-tokens", "200").returncode == 0
    # Two workers share each job's budget of 3 attempts.
    workers = [procs.start("worker", "--server", url, "--burst", "--max-attempts", "3") for _ in range(2)]
    for w in workers:
        assert w.wait(120) == 0, log_of(w)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    errors = read_jsonl(out / "budget" / "errors.jsonl")
    assert len(errors) == 30 and {e["attempts"] for e in errors} == {3}
    assert {e["error"] for e in errors} == {"server_error"} and {e["status"] for e in errors} == {500}
    assert status_json(procs)["datasets"]["budget"]["failed"] == 30

    listing = procs.run("failed", "--json")
    groups = orjson.loads(listing.stdout)["groups"]
    assert [(g["error"], g["count"]) for g in groups] == [("server_error", 30)]
    assert "Internal server error" in groups[0]["message"]

    sim_post(url, "/sim/faults", {"error_500": 0.0})
    assert procs.run("retry", "--reason", "no such reason").stdout.strip() == "retried 0"
    assert procs.run("retry", "--reason", "server_error").stdout.strip() == "retried 30"
    assert procs.run("retry", "--all").stdout.strip() == "retried 0", "retry is idempotent"
    status = status_json(procs)["datasets"]["budget"]
    assert (status["queued"], status["failed"]) == (30, 0)
    worker = procs.start("worker", "--server", url, "--burst", "--max-attempts", "3")
    assert worker.wait(120) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    check_records(out, "budget", prompts, PARAMS)
    assert orjson.loads(procs.run("failed", "--json").stdout)["groups"] == []


@pytest.mark.timeout(540)  # its waits add up to 480 s
@pytest.mark.slow
def test_redis_restart_every_role_carries_on(procs, start_sim, out, tmp_path):
    """A Redis of its own (AOF on), restarted mid-run on the same port and folder."""
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    env = {"GENQ_REDIS_URL": url}
    sim = start_sim("--latency", "realistic", "--decode-step-ms", "5")
    data = tmp_path / "restart.jsonl"
    prompts = write_prompts(data, 600)
    try:
        assert procs.run("enqueue", data, "--max-new-tokens", "200", env=env).returncode == 0
        collector = procs.start("collect", "--out", out, "--burst", env=env)
        worker = procs.start("worker", "--server", sim, "--burst", "--concurrency", "64", env=env)
        raw = out / "restart" / "raw_responses.jsonl"
        wait_until(lambda: len(written_lines(raw)) > 100, 60, "progress")
        server.stop()
        assert len(written_lines(raw)) < 600, "Redis stopped after the run, not mid-run"
        for role in (worker, collector):
            wait_until(lambda r=role: "Redis unreachable" in log_of(r), 60, f"{role.args[3]} to notice")
        server = EmbeddedRedis(tmp_path / "redis", port=server.port)
        server.start()
        assert worker.wait(180) == 0, log_of(worker)
        assert collector.wait(120) == 0, log_of(collector)
        check_records(out, "restart", prompts, PARAMS)
        assert_adds_up(status_json(procs, env))
    finally:
        server.stop()


@pytest.mark.timeout(300)
def test_sigterm_while_redis_is_out_of_reach_stops_each_role_in_bounds(procs, start_sim, out, tmp_path):
    """docs/failures.md: a SIGTERM while Redis cannot be reached ends the collector at once (exit 0)
    and the worker by --grace + STOP_SLACK_S (exit 1, saying what it could not hand back), not
    whenever Redis returns. Started again once it is back, they write every prompt once, and the
    server generated again at most what was in flight when Redis went away."""
    server = EmbeddedRedis(tmp_path / "redis")
    env = {"GENQ_REDIS_URL": server.start()}
    sim = start_sim("--latency", "realistic", "--decode-step-ms", "5")
    data = tmp_path / "unreachable.jsonl"
    prompts = write_prompts(data, 300)
    try:
        assert procs.run("enqueue", data, "--max-new-tokens", "200", env=env).returncode == 0
        collector = procs.start("collect", "--out", out, env=env)
        worker_flags = ("--server", sim, "--concurrency", "16", "--heartbeat-ttl", "5")
        worker = procs.start("worker", *worker_flags, "--grace", "2", env=env)
        raw = out / "unreachable" / "raw_responses.jsonl"
        wait_until(lambda: len(written_lines(raw)) >= 50, 60, "progress")
        server.stop()
        for role in (worker, collector):
            wait_until(lambda r=role: "Redis unreachable" in log_of(r), 60, f"{role.args[3]} to notice")
        assert stop(collector, timeout=5) == 0, log_of(collector)
        assert "stopped while waiting" in log_of(collector)
        # --grace 2 + STOP_SLACK_S 15, and a connect attempt's own timeout (genq/connection.py, 10 s).
        assert stop(worker, timeout=2 + 15 + 10) == 1, log_of(worker)
        assert "were not handed back" in log_of(worker)
        # In flight: the 16 sending, and any that had finished and waited for their commit.
        held = int(re.search(r"draining (\d+) in flight", log_of(worker)).group(1))
        server = EmbeddedRedis(tmp_path / "redis", port=server.port)
        server.start()
        collector = procs.start("collect", "--out", out, "--burst", env=env)
        worker = procs.start("worker", *worker_flags, "--burst", env=env)
        assert worker.wait(180) == 0, log_of(worker)
        assert collector.wait(60) == 0, log_of(collector)
        check_records(out, "unreachable", prompts, PARAMS)
        # Two start-up probes, and what was in flight when Redis went away, generated again at most.
        assert sim_stats(sim)["generations"] <= len(prompts) + 2 + held, (held, sim_stats(sim))
    finally:
        server.stop()


def _collector_on_a_small_disk(procs, start_sim, out, tmp_path, give_up_after: str):
    """300 results waiting in the stream, and a collector whose writes past 150 kB fail with EFBIG,
    as on a full disk; (the prompts, the collector, its log file)."""
    url = start_sim()
    data = tmp_path / "full.jsonl"
    prompts = write_prompts(data, 300)
    assert procs.run("enqueue", data, "--max-new-tokens", "200").returncode == 0
    worker = procs.start("worker", "--server", url, "--burst")
    assert worker.wait(120) == 0, log_of(worker)

    def small_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, 150_000))

    log = tmp_path / "full-collector.log"
    with log.open("wb") as fh:
        collector = subprocess.Popen(
            genq_argv("collect", "--out", out, "--give-up-after", give_up_after, "--batch", "10"),
            env=procs.env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            preexec_fn=small_disk,
        )
    procs.procs.append(collector)
    return prompts, collector, log


def _only_what_is_on_disk_was_acknowledged(procs, out, prompts) -> None:
    """The lines written are whole and marked done, the rest still in the stream; a collector on a
    sound disk then writes every record once."""
    written = read_jsonl(out / "full" / "raw_responses.jsonl")  # whole lines only, no torn one
    assert 0 < len(written) < 300
    status = status_json(procs)
    assert status["datasets"]["full"]["done"] == len(written), "only what is on disk is marked done"
    assert status["stream"]["length"] == 300 - len(written), "nothing unwritten was acknowledged"
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    check_records(out, "full", prompts, PARAMS)


def test_collector_on_a_full_disk_acknowledges_nothing_and_exits_nonzero(procs, start_sim, out, tmp_path):
    prompts, collector, log = _collector_on_a_small_disk(procs, start_sim, out, tmp_path, "3")
    assert collector.wait(60) == 3, log.read_text()
    text = log.read_text()
    assert "nothing of it was acknowledged" in text and "giving up" in text
    _only_what_is_on_disk_was_acknowledged(procs, out, prompts)


def test_sigterm_stops_a_collector_waiting_on_a_full_disk(procs, start_sim, out, tmp_path, report):
    """docs/failures.md: SIGTERM ends a collector within a second even while its disk refuses
    writes (it waits between tries in slices that look at the stop), exit 0, nothing acknowledged
    that is not on disk; a collector started later writes the rest."""
    prompts, collector, log = _collector_on_a_small_disk(procs, start_sim, out, tmp_path, "600")
    # Past the first tries: the collector now sleeps for seconds between them.
    wait_until(lambda: log.read_text().count("nothing of it was acknowledged") >= 4, 60, "the disk to refuse")
    waiting = float(
        re.findall(r"nothing of it was acknowledged, retrying in ([\d.]+) s", log.read_text())[-1]
    )
    sent = time.monotonic()  # within a poll (50 ms) of the line: the sleep it announced has begun
    collector.send_signal(signal.SIGTERM)
    assert collector.wait(60) == 0, log.read_text()
    took = time.monotonic() - sent
    report(f"a collector waiting on a full disk stopped {took:.2f} s after SIGTERM (its sleep: {waiting} s)")
    # Not a speed: whether the stop waited out the sleep it came in (4 s at the fourth try).
    assert took < waiting / 2, f"stopped after {took:.1f} s: it waited out its {waiting:.1f} s sleep"
    assert "stopped while waiting" in log.read_text()
    _only_what_is_on_disk_was_acknowledged(procs, out, prompts)


@pytest.mark.parametrize("serializer_flag", [(), ("-S", "json")])
@pytest.mark.slow
def test_rq_info_reaping_abandoned_jobs_loses_nothing(
    procs, start_sim, out, tmp_path, redis_url, conn, namespace, serializer_flag
):
    """`rq info` requeues a dead worker's jobs itself; without the JSON serializer it re-saves
    their meta as pickle. The jobs must still run, once each."""
    url = start_sim(
        "--latency", "realistic", "--min-len", "1500", "--max-len", "1600", "--decode-step-ms", "5"
    )
    data = tmp_path / "reaped.jsonl"
    prompts = write_prompts(data, 20)
    assert procs.run("enqueue", data, "--max-new-tokens", "2000").returncode == 0
    victim = procs.start("worker", "--server", url, "--concurrency", "10", "--heartbeat-ttl", "5")
    # 10 sent and 2 taken ahead (WorkerConfig.prefetch): all 12 die with the worker.
    wait_until(lambda: status_json(procs)["datasets"]["reaped"]["in_flight"] == 12, 30, "12 jobs in flight")
    sigkill(victim)
    # Past the heartbeat TTL the 12 executions in RQ's started registry have lapsed: abandoned, and
    # nobody has reaped them yet (no genq worker or collector runs).
    registry = f"rq:wip:{Keys(namespace).queue_name('reaped')}"
    lapsed = lambda: conn.zcount(registry, "-inf", time.time()) == conn.zcard(registry) == 12  # noqa: E731
    wait_until(lapsed, 30, "the dead worker's 12 executions to lapse")
    assert status_json(procs)["datasets"]["reaped"]["queued"] == 8, "nobody reaped them before rq info"
    info = subprocess.run(
        [RQ, "info", "-u", redis_url, *serializer_flag], capture_output=True, text=True, timeout=60
    )
    assert info.returncode == 0, info.stderr
    assert status_json(procs)["datasets"]["reaped"]["queued"] == 20, "rq info put the 12 back"
    worker = procs.start("worker", "--server", url, "--burst", "--concurrency", "20")
    assert worker.wait(120) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    check_records(out, "reaped", prompts, {"max_new_tokens": 2000}, min_len=1500, max_len=1600)


def _judged(worker) -> int:
    """Failed sends the worker has judged: kept for a retry, or failed for good."""
    log = log_of(worker)
    return log.count("; retrying in ") + log.count("failed for good")


def _in_stream(procs) -> int:
    return status_json(procs)["stream"]["length"]
