"""Partitions between a worker and Redis, on one machine (a TCP proxy the test cuts): the host
cut off loses no job and, when it comes back, queues nothing that finished elsewhere."""

from __future__ import annotations

import time
from urllib.parse import urlsplit

from tests.helpers import check_records, log_of, sim_stats, status_json, stop, wait_until, write_prompts
from tests.netproxy import Proxy

PARAMS = {"max_new_tokens": 300}
TTL = 5


def test_a_worker_cut_off_from_redis_queues_nothing_finished_when_it_returns(
    procs, start_sim, out, tmp_path, redis_url
):
    """gpu1 is cut off from Redis past the heartbeat TTL while it generates; its jobs run on gpu2;
    gpu1 keeps generating and, when the link returns, hands its late results over (dropped as
    duplicates). Nothing it held may be queued again afterwards: a finished job run twice is GPU
    time paid twice (before the fix, its late heartbeats put the finished jobs back in RQ's started
    registry, and the abandoned-job cleanup queued them again a TTL later)."""
    sim = start_sim("--latency", "realistic", "--decode-step-ms", "3", "--min-len", "200", "--max-len", "280")
    data = tmp_path / "cut.jsonl"
    prompts = write_prompts(data, 120)
    assert procs.run("enqueue", data, "--max-new-tokens", "300").returncode == 0
    proxy = Proxy(urlsplit(redis_url).port).start()
    try:
        args = ("worker", "--server", sim, "--concurrency", "30", "--heartbeat-ttl", str(TTL))
        gpu1 = procs.start(*args, env={"GENQ_REDIS_URL": f"redis://127.0.0.1:{proxy.port}/0"})
        wait_until(lambda: status_json(procs)["datasets"]["cut"]["in_flight"] >= 30, 60, "gpu1 busy")
        proxy.cut()
        gpu2 = procs.start(*args)
        time.sleep(TTL * 2.5)  # the partition itself: longer than the TTL, gpu2 takes gpu1's jobs
        proxy.restore()
        collector = procs.start("collect", "--out", out)
        wait_until(lambda: status_json(procs)["datasets"]["cut"]["done"] == 120, 120, "every record on disk")
        settled = sim_stats(sim)["generations"]
        time.sleep(TTL * 3)  # past the TTL of any execution a late heartbeat could have refreshed
        status = status_json(procs)["datasets"]["cut"]
        assert (status["queued"], status["in_flight"]) == (0, 0), status
        assert sim_stats(sim)["generations"] == settled, "a finished job was generated again"
        logs = log_of(gpu1) + log_of(gpu2)
        assert "no longer exists" not in logs and "has already finished" not in logs
        for proc in (gpu1, gpu2, collector):
            assert stop(proc) == 0, log_of(proc)
    finally:
        proxy.stop()
    check_records(out, "cut", prompts, PARAMS, min_len=200, max_len=280)
    names = [w["name"] for w in status_json(procs)["workers"]]
    assert len(names) == len(set(names)), "a worker shows twice"


def test_a_finished_jobs_stray_id_in_the_intermediate_list_is_not_queued_again(
    procs, start_sim, out, tmp_path, conn, namespace
):
    """After a partition, a job's id can be queued twice (RQ's abandoned-job cleanup, and a late
    copy); a worker that moved the second copy into RQ's intermediate list and died before it
    started leaves a finished job's id there. The reaper must drop it, not queue it (before the
    fix it queued it again, and the job ran a second time or was "queued but no longer exists")."""
    from rq import Queue

    from genq.keys import Keys

    sim = start_sim()
    data = tmp_path / "stray.jsonl"
    prompts = write_prompts(data, 20)
    assert procs.run("enqueue", data, "--max-new-tokens", "300").returncode == 0
    assert procs.run("worker", "--server", sim, "--burst").returncode == 0
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    keys = Keys(namespace)
    queue = Queue(keys.queue_name("stray"), connection=conn, serializer="json")
    finished = keys.job_id("stray-3")
    worker = procs.start("worker", "--server", sim, "--heartbeat-ttl", str(TTL))  # its reaper runs every 2 s
    wait_until(lambda: "serving" in log_of(worker), 30, "the worker's start-up probe")
    generations = sim_stats(sim)["generations"]
    conn.lpush(queue.intermediate_queue_key, finished)
    wait_until(lambda: conn.llen(queue.intermediate_queue_key) == 0, 60, "the stray id to be dealt with")
    time.sleep(2)
    assert conn.llen(queue.key) == 0, "a finished job was queued again"
    assert sim_stats(sim)["generations"] == generations, "a finished job was generated again"
    assert stop(worker) == 0, log_of(worker)
    check_records(out, "stray", prompts, PARAMS)


def test_a_collector_cut_off_stops_writing_before_another_takes_over(
    procs, start_sim, out, tmp_path, redis_url
):
    """The collector's host is cut off from Redis past the lease: nothing it has not written may be
    acknowledged, a second collector waits out the lease and takes over the same folder, and the
    first — which may hold a batch read just before the cut — stops before writing it (it fences
    itself on its own clock, not when Redis next answers)."""
    sim = start_sim("--latency", "realistic", "--decode-step-ms", "3")
    data = tmp_path / "fence.jsonl"
    prompts = write_prompts(data, 800)
    assert procs.run("enqueue", data, "--max-new-tokens", "300").returncode == 0
    proxy = Proxy(urlsplit(redis_url).port).start()
    raw = out / "fence" / "raw_responses.jsonl"
    try:
        first = procs.start(
            "collect",
            "--out",
            out,
            "--batch",
            "20",
            env={"GENQ_REDIS_URL": f"redis://127.0.0.1:{proxy.port}/0"},
        )
        worker = procs.start("worker", "--server", sim, "--concurrency", "64")
        wait_until(
            lambda: raw.exists() and len(raw.read_bytes().splitlines()) >= 100,
            60,
            "the first collector writing",
        )
        proxy.cut()
        cut_at = len(raw.read_bytes().splitlines())
        second = procs.start("collect", "--out", out)  # waits out the first one's lease
        wait_until(lambda: "draining" in log_of(second), 60, "the second collector to take the lease")
        wait_until(
            lambda: len(raw.read_bytes().splitlines()) >= cut_at + 100, 60, "the second collector writing"
        )
        proxy.restore()
        assert first.wait(60) == 2, log_of(first)
        assert "lost the collector lease" in log_of(first) or "not writing" in log_of(first)
        wait_until(
            lambda: status_json(procs)["datasets"]["fence"]["done"] == 800, 120, "every record on disk"
        )
        assert stop(worker) == 0 and stop(second) == 0
    finally:
        proxy.stop()
    check_records(out, "fence", prompts, PARAMS)


def test_a_worker_cut_off_from_its_own_server_burns_no_attempts(procs, start_sim, out, tmp_path):
    """Only the link to the inference server breaks: requests hang past their deadline and /health
    does not answer either. The gate closes, no attempt is charged (one attempt per job here: a
    charged one would fail the job), and work resumes when the link returns."""
    sim = start_sim("--latency", "realistic", "--decode-step-ms", "3", "--min-len", "16", "--max-len", "64")
    proxy = Proxy(int(sim.rsplit(":", 1)[1])).start()
    data = tmp_path / "server.jsonl"
    prompts = write_prompts(data, 300)
    assert procs.run("enqueue", data, "--max-new-tokens", "300").returncode == 0
    try:
        worker = procs.start(
            "worker", "--server", f"http://127.0.0.1:{proxy.port}", "--concurrency", "32",
            "--request-timeout", "3", "--max-attempts", "1", "--burst",
        )  # fmt: skip
        wait_until(lambda: status_json(procs)["datasets"]["server"]["in_flight"] >= 16, 60, "jobs in flight")
        proxy.cut()
        wait_until(lambda: "looks down" in log_of(worker), 90, "the gate to close")
        proxy.restore()
        assert worker.wait(180) == 0, log_of(worker)
        assert "is up again" in log_of(worker)
    finally:
        proxy.stop()
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    check_records(out, "server", prompts, PARAMS, min_len=16, max_len=64)
