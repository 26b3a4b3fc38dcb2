"""Operators poke at the queue with RQ's own tools, the plain way: nothing may be lost or doubled."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from genq.commands.embedded import free_port
from tests.helpers import (
    check_records,
    http,
    http_status,
    log_of,
    read_jsonl,
    sim_post,
    status_json,
    wait_until,
    write_prompts,
)

DASHBOARD = str(Path(sys.executable).parent / "rq-dashboard")


@pytest.mark.timeout(390)  # its waits and two workers' runs add up to 330 s
@pytest.mark.slow
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
        # 16 in flight: the run lasts long enough to be looked at mid-run on a loaded machine.
        worker = procs.start(
            "worker", "--server", url, "--burst", "--max-attempts", "1", "--concurrency", "16"
        )
        wait_until(lambda: _busy(procs), 30, "the worker busy with jobs")
        # What the plain dashboard shows mid-run, read as an operator's browser would.
        code, body = http(f"{base}/0/data/queues.json")
        assert code == 200, body[:500]
        (shown,) = [q for q in orjson.loads(body)["queues"] if q["name"] == queue]
        assert 0 < shown["count"] < 200, f"the queue's depth mid-run: {shown}"
        for registry in ("queued", "started"):
            code, body = http(f"{base}/0/data/jobs/{queue}/{registry}/20/asc/1.json")
            assert code == 200, (registry, body[:500])
            listing = orjson.loads(body)
            ids = [j["id"] for j in listing["jobs"]]
            assert listing["name"] == queue and ids, (registry, listing)
            assert all(i.startswith(f"{namespace}--dash-") for i in ids), (registry, ids)
        job_id = f"{namespace}--dash-0"
        code, body = http(f"{base}/0/data/job/{job_id}.json")
        assert code == 200, body[:500]
        job = orjson.loads(body)
        assert (job["id"], job["origin"], job["description"]) == (job_id, queue, "dash row 0"), job
        # Plain rq-dashboard reads workers with pickle: it answers 500 when the worker's current job
        # is a JSON job it fetches (docs/views.md; `genq dashboard` fixes it, tests/test_dashboard.py),
        # else the worker.
        code, body = http(f"{base}/0/data/workers.json")
        if code == 500:
            assert b"Internal Server Error" in body, body[:500]
        else:
            assert code == 200, (code, body[:500])
            ours = [w for w in orjson.loads(body)["workers"] if w["name"].startswith(f"genq.{namespace}.")]
            assert [w["queues"] for w in ours] == [[queue]], ours
        assert worker.wait(120) == 0, log_of(worker)
        assert procs.run("collect", "--out", out, "--burst").returncode == 0
        failed = read_jsonl(out / "dash" / "errors.jsonl")
        assert failed, "with a 30 % failure rate and one attempt, some jobs failed"
        sim_post(url, "/sim/faults", {"error_500": 0.0})
        # Requeue from the dashboard: one job, then all of them (meta re-saved as pickle).
        code, body = http(f"{base}/job/{namespace}--{failed[0]['id']}/requeue", "POST")
        assert (code, orjson.loads(body)) == (200, {"status": "OK"}), body[:500]
        code, body = http(f"{base}/requeue/{queue}", "POST")
        assert (code, orjson.loads(body)) == (200, {"status": "OK", "count": len(failed) - 1}), body[:500]
        wait_until(lambda: status_json(procs)["datasets"]["dash"]["queued"] == len(failed), 30, "the requeue")
    finally:
        dashboard.kill()
        dashboard.wait(10)
    worker = procs.start("worker", "--server", url, "--burst")
    assert worker.wait(120) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    check_records(out, "dash", prompts, {"max_new_tokens": 200})
    status = status_json(procs)["datasets"]["dash"]
    assert (status["done"], status["failed"], status["total"]) == (200, 0, 200), status


def _busy(procs) -> bool:
    return any(w["state"] == "busy" and w["in_flight"] for w in status_json(procs)["workers"])
