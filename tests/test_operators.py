"""Operators poke at the queue with RQ's own tools, the plain way: nothing may be lost or doubled."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from genq.embedded import free_port
from tests.helpers import (
    check_records,
    http_status,
    log_of,
    read_jsonl,
    sim_post,
    status_json,
    wait_until,
    write_prompts,
)

DASHBOARD = str(Path(sys.executable).parent / "rq-dashboard")


def test_plain_rq_dashboard_during_a_run_corrupts_and_loses_nothing(
    procs, start_sim, out, tmp_path, redis_url, namespace
):
    url = start_sim("--latency", "realistic", "--decode-step-ms", "4", "--fail-500", "0.3")
    data = tmp_path / "dash.jsonl"
    prompts = write_prompts(data, 200)
    assert procs.run("enqueue", data, "--max-new-tokens", "200").returncode == 0
    port = free_port()
    # As an operator would start it: no --json, so it reads and re-saves with pickle.
    with (tmp_path / "dashboard.log").open("wb") as log:
        dashboard = subprocess.Popen(
            [DASHBOARD, "-u", redis_url, "-b", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    queue = f"{namespace}.dash"
    try:
        wait_until(lambda: http_status(f"{base}/0/data/queues.json") == 200, 30, "the dashboard")
        worker = procs.start(
            "worker", "--server", url, "--burst", "--max-attempts", "1", "--concurrency", "32"
        )
        wait_until(lambda: status_json(procs)["datasets"]["dash"]["in_flight"] > 0, 30, "jobs in flight")
        seen = {
            path: http_status(base + path)
            for path in (
                "/0/data/queues.json",
                "/0/data/workers.json",
                f"/0/data/jobs/{queue}/queued/20/asc/1.json",
                f"/0/data/jobs/{queue}/started/20/asc/1.json",
                "/0/data/job/dash-0.json",
            )
        }
        assert seen["/0/data/queues.json"] == 200, seen
        assert worker.wait(120) == 0, log_of(worker)
        assert procs.run("collect", "--out", out, "--burst").returncode == 0
        failed = read_jsonl(out / "dash" / "errors.jsonl")
        assert failed, "with a 30 % failure rate and one attempt, some jobs failed"
        sim_post(url, "/sim/faults", {"error_500": 0.0})
        # Requeue from the dashboard: one job, then all of them (meta re-saved as pickle).
        assert http_status(f"{base}/job/{namespace}--{failed[0]['id']}/requeue", "POST") == 200
        assert http_status(f"{base}/requeue/{queue}", "POST") == 200
        wait_until(lambda: status_json(procs)["datasets"]["dash"]["queued"] == len(failed), 10, "the requeue")
    finally:
        dashboard.kill()
        dashboard.wait(10)
    worker = procs.start("worker", "--server", url, "--burst")
    assert worker.wait(120) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    check_records(out, "dash", prompts, {"max_new_tokens": 200})
    status = status_json(procs)["datasets"]["dash"]
    assert (status["done"], status["failed"], status["total"]) == (200, 0, 200), status
