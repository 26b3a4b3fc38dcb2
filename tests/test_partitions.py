"""Partitions between a worker and Redis, on one machine (a TCP proxy the test cuts): the host
cut off loses no job and, when it comes back, queues nothing that finished elsewhere."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import orjson
import pytest

from genq.bitmaps import is_set
from genq.clock import redis_time
from genq.keys import Keys
from tests.helpers import (
    check_records,
    log_of,
    read_jsonl,
    sim_stats,
    started_jobs,
    status_json,
    stop,
    wait_until,
    worker_name,
    write_prompts,
)
from tests.netproxy import Proxy

pytestmark = pytest.mark.slow  # partitions wait out heartbeat TTLs and leases
PARAMS = {"max_new_tokens": 300}
TTL = 5


def _done_rows(conn, namespace: str, dataset: str) -> set[int]:
    bits = conn.get(Keys(namespace).done(dataset)) or b""
    return {i for i in range(len(bits) * 8) if is_set(bits, i)}


def _row(namespace: str, job_id: str) -> int:
    return int(Keys(namespace).record_id(job_id).rsplit("-", 1)[1])  # type: ignore[union-attr]


def _idle(conn, namespace: str, dataset: str) -> bool:
    """No worker holds a job, and RQ's queue, intermediate list and started registry are empty: a
    reaper pass has nothing it could queue again."""
    from rq import Queue, Worker

    from genq.progress import worker_names

    keys = Keys(namespace)
    queue = Queue(keys.queue_name(dataset), connection=conn, serializer="json")
    with conn.pipeline(transaction=False) as pipe:
        for name in worker_names(conn, keys):
            pipe.hget(Worker.redis_worker_namespace_prefix + name, "genq_in_flight")
        pipe.llen(queue.key)
        pipe.llen(queue.intermediate_queue_key)
        pipe.zcard(queue.started_job_registry.key)
        *in_flight, queued, moving, started = pipe.execute()
    return not any(int(n or 0) for n in in_flight) and (queued, moving, started) == (0, 0, 0)


def _reaper_ran_since(conn, namespace: str, at: float) -> bool:
    """A reaper pass (genq/reaper.py, every 2 s in a worker with this TTL) began after ``at``,
    by Redis's clock."""
    return float(conn.get(Keys(namespace).maintenance_lock) or 0) > at


@pytest.mark.timeout(720)  # its waits and stops add up to 630 s
def test_a_worker_cut_off_from_redis_queues_nothing_finished_when_it_returns(
    procs, start_sim, out, tmp_path, redis_url, conn, namespace
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
    collector = procs.start("collect", "--out", out)
    proxy = Proxy(urlsplit(redis_url).port).start()
    try:
        args = ("worker", "--server", sim, "--concurrency", "30", "--heartbeat-ttl", str(TTL))
        gpu1 = procs.start(*args, env={"GENQ_REDIS_URL": f"redis://127.0.0.1:{proxy.port}/0"})
        name1 = worker_name(procs, gpu1, 30)

        def held_by(name: str) -> set[str]:
            return {j for j, w in started_jobs(conn, namespace, "cut").items() if w == name}

        wait_until(lambda: len(held_by(name1)) >= 20, 60, "gpu1 to hold 20 jobs")
        proxy.cut()
        held = held_by(name1)  # gpu1 can start and finish nothing more in Redis now
        assert len(held) >= 20, f"the cut caught gpu1 holding only {len(held)} jobs"
        gpu2 = procs.start(*args)
        name2 = worker_name(procs, gpu2, 30)

        # The partition: past the TTL gpu1's jobs go back to the queue and gpu2 runs them, all while
        # gpu1 is still cut off (so what reaches the disk of them is gpu2's).
        def on_gpu2() -> bool:
            running, rows = started_jobs(conn, namespace, "cut"), _done_rows(conn, namespace, "cut")
            return all(running.get(j) == name2 or _row(namespace, j) in rows for j in held)

        wait_until(on_gpu2, 60, "gpu1's jobs to go back to the queue and run on gpu2")
        rows = {_row(namespace, j) for j in held}
        wait_until(lambda: rows <= _done_rows(conn, namespace, "cut"), 60, "gpu1's jobs on disk, from gpu2")
        owners = {j: w for j, w in zip(held, _job_workers(conn, held), strict=True)}
        moved = [j for j, w in owners.items() if w == name2]
        assert len(moved) >= len(held) // 2, (
            f"gpu2 ran only {len(moved)} of the {len(held)} jobs gpu1 held at the cut: the partition moved "
            f"nothing (who ran them: {sorted(set(owners.values()))})"
        )
        proxy.restore()

        wait_until(lambda: status_json(procs)["datasets"]["cut"]["done"] == 120, 120, "every record on disk")
        settled = sim_stats(sim)["generations"]
        # A late heartbeat of gpu1 would have put an execution back in RQ's started registry: the
        # queue is idle only once none is left, and a reaper pass after that finds nothing to queue.
        wait_until(lambda: _idle(conn, namespace, "cut"), 60, "no job left in RQ's queue or registries")
        idle_at = redis_time(conn)
        wait_until(lambda: _reaper_ran_since(conn, namespace, idle_at), 30, "a reaper pass after that")
        status = status_json(procs)["datasets"]["cut"]
        assert (status["queued"], status["in_flight"]) == (0, 0), status
        assert _idle(conn, namespace, "cut"), "the reaper queued a job again"
        assert sim_stats(sim)["generations"] == settled, "a finished job was generated again"
        logs = log_of(gpu1) + log_of(gpu2)
        assert "no longer exists" not in logs and "has already finished" not in logs, logs
        for proc in (gpu1, gpu2, collector):
            assert stop(proc) == 0, log_of(proc)
    finally:
        proxy.stop()
    dropped = re.search(r"(\d+) duplicates dropped", log_of(collector))
    assert dropped, log_of(collector)
    assert int(dropped.group(1)) >= 1, "gpu1's late results never reached the collector as duplicates"
    check_records(out, "cut", prompts, PARAMS, min_len=200, max_len=280)
    names = [w["name"] for w in status_json(procs)["workers"]]
    assert len(names) == len(set(names)), "a worker shows twice"


def _job_workers(conn, job_ids: set[str]) -> list[str]:
    """The worker each job last started on (RQ's job hash), in ``job_ids``'s iteration order."""
    from rq.job import Job

    with conn.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hget(Job.key_for(job_id), "worker_name")
        return [(n or b"").decode() for n in pipe.execute()]


def test_a_finished_jobs_stray_id_in_the_intermediate_list_is_not_queued_again(
    procs, start_sim, out, tmp_path, conn, namespace
):
    """After a partition, a job's id can be queued twice (RQ's abandoned-job cleanup, and a late
    copy); a worker that moved the second copy into RQ's intermediate list and died before it
    started leaves a finished job's id there. The reaper must drop it, not queue it (before the
    fix it queued it again, and the job ran a second time or was "queued but no longer exists")."""
    from rq import Queue

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
    # A job queued now is taken and run: had the reaper queued the stray id (a moment ago, in the
    # same transaction that took it out of the list), this worker would have taken it too by then.
    canary = tmp_path / "canary.jsonl"
    write_prompts(canary, 3, start=100)
    assert procs.run("enqueue", canary, "--max-new-tokens", "300").returncode == 0
    wait_until(lambda: sim_stats(sim)["generations"] >= generations + 3, 60, "the worker to run 3 new jobs")
    assert "was queued but" not in log_of(worker), "the reaper queued the finished job again"
    assert conn.llen(queue.key) == 0, "a finished job was queued again"
    assert sim_stats(sim)["generations"] == generations + 3, "a finished job was generated again"
    assert stop(worker) == 0, log_of(worker)
    check_records(out, "stray", prompts, PARAMS)


@pytest.mark.timeout(540)  # its waits and stops add up to 480 s
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
        assert cut_at < 800, "the cut came after the first collector had written everything"
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


@pytest.mark.timeout(420)  # its waits add up to 330 s, and a burst collect
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
        # At the server: the dataset's in_flight counts results waiting in the stream too (no collector).
        wait_until(lambda: sim_stats(sim)["in_flight"] >= 16, 60, "16 requests in flight at the server")
        proxy.cut()
        wait_until(lambda: "looks down" in log_of(worker), 90, "the gate to close")
        proxy.restore()
        assert worker.wait(180) == 0, log_of(worker)
        assert "is up again" in log_of(worker)
    finally:
        proxy.stop()
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    assert read_jsonl(out / "server" / "errors.jsonl") == [], "a job was charged for the partition"
    check_records(out, "server", prompts, PARAMS, min_len=16, max_len=64)


def test_a_failure_whose_reply_is_lost_is_written_once(
    procs, start_sim, out, tmp_path, redis_url, conn, namespace
):
    """The link to Redis drops just as Redis answers the commit that fails a job for good (its
    error's stream entry, RQ's failed state and the counters: one script call). The worker sends
    that commit again with the same token, and it is applied once: one stream entry for the job,
    one failed job in RQ, its error in errors.jsonl once and no record of it on disk."""
    from collections import Counter

    from rq import Queue

    sim = start_sim("--context-length", "200", "--min-len", "8", "--max-len", "32")
    data = tmp_path / "lost.jsonl"
    prompts = write_prompts(data, 20)
    poison = 7
    prompts[poison] = [100 + j for j in range(300)]  # over the context: a 400, a failure at once
    data.write_bytes(b"".join(orjson.dumps({"input_ids": ids}) + b"\n" for ids in prompts))
    assert procs.run("enqueue", data, "--max-new-tokens", "50").returncode == 0
    keys = Keys(namespace)
    record_id = f"lost-{poison}"
    # The error's stream entry in the request, as redis-py writes its words (RESP).
    proxy = Proxy(urlsplit(redis_url).port).start()
    proxy.lose_reply(b"$5\r\nerror\r\n$2\r\nid\r\n$%d\r\n%s\r\n" % (len(record_id), record_id.encode()))
    try:
        worker = procs.start(
            "worker", "--server", sim, "--concurrency", "4", "--burst",
            env={"GENQ_REDIS_URL": f"redis://127.0.0.1:{proxy.port}/0"},
        )  # fmt: skip
        assert worker.wait(120) == 0, log_of(worker)
    finally:
        proxy.stop()
    assert proxy.lost.is_set(), "no reply was lost: the scenario did not happen"
    assert proxy.sent >= 2, "the commit whose reply was lost was not sent again"
    entries = Counter(e[b"id"].decode() for _, e in conn.xrange(keys.results("lost")))
    assert entries == Counter(f"lost-{row}" for row in range(20)), "a job's ending entered the stream twice"
    assert int(conn.hget(keys.in_stream, "lost")) == 20
    queue = Queue(keys.queue_name("lost"), connection=conn, serializer="json")
    assert queue.failed_job_registry.get_job_ids() == [keys.job_id(record_id)]
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    errors = read_jsonl(out / "lost" / "errors.jsonl")
    assert [(e["row"], e["error"]) for e in errors] == [(poison, "bad_request")]
    check_records(
        out, "lost", prompts, {"max_new_tokens": 50}, skip_rows=frozenset({poison}), min_len=8, max_len=32
    )
