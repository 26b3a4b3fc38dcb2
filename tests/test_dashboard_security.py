"""`genq dashboard` against an attacker who can write to Redis or lead the operator's browser: it
never unpickles a job, changes nothing on a GET or a cross-site POST, answers only to its own Host
names, and does not serve a non-loopback address without a password unless told to."""

from __future__ import annotations

import os
import pickle
import urllib.request
from pathlib import Path

import pytest
from flask import url_for
from rq import Worker
from rq.executions import Execution
from rq.registry import FailedJobRegistry, FinishedJobRegistry
from rq.serializers import JSONSerializer

from genq.commands.dashboard_app import ROUTES, STATE_CHANGING, UNREADABLE, create_app
from genq.commands.embedded import free_port
from genq.keys import Keys
from genq.worker import rq_batch
from tests.helpers import one_failure, status_json, wait_until, write_prompts

REGISTRIES = ("queued", "failed", "started", "finished", "deferred", "scheduled", "canceled")


class Touch:
    """Unpickled, it runs ``touch PATH``: what a job planted in Redis would do on the dashboard's host."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def urls(app, job_ids: list[str], queue: str) -> list[str]:
    """Every URL of every route of the app, with each job id and the queue in every registry."""
    out = []
    for rule in app.url_map.iter_rules():
        values: list[dict] = [{}]
        for arg in rule.arguments - set(rule.defaults or {}):
            choices = {
                "instance_number": [0],
                "job_id": job_ids,
                "queue_name": [queue],
                "registry_name": REGISTRIES,
                "per_page": [20],
                "order": ["asc"],
                "page": [1],
                "filename": ["js/jquery-3.5.1.min.js"],
            }[arg]
            values = [{**v, arg: c} for v in values for c in choices]
        with app.test_request_context():
            out += [url_for(rule.endpoint, **v) for v in values]
    return sorted(set(out))


def test_every_route_of_rq_dashboard_is_reviewed(redis_url):
    """ROUTES (what genq does with each route, docs/views.md's table) is exactly rq-dashboard's."""
    app = create_app(redis_url)
    served = {
        r.endpoint.partition(".")[2]
        for r in app.url_map.iter_rules()
        if r.endpoint.startswith("rq_dashboard.")
    }
    assert served == set(ROUTES)


def test_no_route_unpickles_a_planted_job(procs, tmp_path, conn, redis_url, namespace):
    assert (
        procs.run("enqueue", write_prompts(tmp_path / "d.jsonl", 2) and tmp_path / "d.jsonl").returncode == 0
    )
    queue = f"{namespace}.d"
    keys = Keys(namespace)
    real = conn.hgetall(f"rq:job:{keys.job_id('d-0')}")
    marker = tmp_path / "MARKER"
    evil = pickle.dumps(Touch(marker))
    planted = {keys.job_id("d-meta"): {b"meta": evil}, keys.job_id("d-data"): {b"data": evil}}
    for job_id, fields in planted.items():
        conn.hset(f"rq:job:{job_id}", mapping={**real, **fields})
        conn.rpush(f"rq:queue:{queue}", job_id)
        for registry in (FailedJobRegistry, FinishedJobRegistry):
            conn.zadd(registry(queue, connection=conn).key, {job_id: 2**40})
    worker = Worker([queue], connection=conn, serializer=JSONSerializer, name=f"{namespace}-planted")
    worker.register_birth()
    with conn.pipeline() as pipe:  # the worker busy with the planted job, as RQ names it
        if rq_batch.INDEXED:  # RQ 3: its execution index (rq/executions.py)
            execution = Execution("planted", keys.job_id("d-data"), conn, worker_name=worker.name)
            execution.save(60, pipeline=pipe)
            pipe.sadd(rq_batch.executions_index(worker.name), execution.composite_key)
        else:  # RQ 2: the worker hash's current_job (rq/worker/base.py)
            worker.set_current_job_id(keys.job_id("d-data"), pipeline=pipe)
        pipe.execute()
    origin = {"Origin": "http://localhost"}
    try:
        app = create_app(redis_url)
        client = app.test_client()
        requested = urls(app, list(planted), queue)
        assert any("/view/job/" in u for u in requested) and any("/requeue/" in u for u in requested)
        for url in requested:
            for method in (client.get, client.post):
                res = method(url, headers=origin)
                assert res.status_code < 500, (url, res.status_code, res.text[-500:])
                assert not marker.exists(), f"{url} unpickled a job"

        for job_id in planted:
            info = client.get(f"/0/data/job/{job_id}.json").json
            assert (info["id"], info["description"], info["metadata"]) == (job_id, UNREADABLE, UNREADABLE)
        readable = client.get(f"/0/data/job/{keys.job_id('d-0')}.json").json
        assert readable["description"] != UNREADABLE and readable["origin"] == queue
        for registry in ("queued", "failed"):
            rows = client.get(f"/0/data/jobs/{queue}/{registry}/20/asc/1.json").json["jobs"]
            shown = {row["id"]: row["description"] for row in rows}
            assert all(shown[job_id] == UNREADABLE for job_id in planted), shown
            assert all(d != UNREADABLE for i, d in shown.items() if i not in planted), shown
        workers = client.get("/0/data/workers.json").json["workers"]
        (mine,) = [w for w in workers if w["name"] == worker.name]
        assert mine["current_job"]["job_id"] == keys.job_id("d-data")
        assert mine["current_job"]["description"] == UNREADABLE
        assert client.get(f"/0/view/job/{keys.job_id('d-meta')}").status_code == 200
        assert not marker.exists()
    finally:
        worker.register_death()


def keys_of(conn, namespace: str) -> dict[bytes, bytes]:
    """Every key of the namespace (RQ's and genq's), dumped: what a refused request must not change."""
    return {k: conn.dump(k) for k in sorted(conn.scan_iter(f"*{namespace}*"))}


def test_state_changes_are_post_only_and_same_origin(
    procs, start_sim, out, tmp_path, conn, redis_url, namespace
):
    one_failure(procs, start_sim("--context-length", "256"), out, tmp_path)
    queue, job_id = f"{namespace}.rq", Keys(namespace).job_id("rq-1")

    app = create_app(redis_url)
    client = app.test_client()
    changing = {
        "rq_dashboard.requeue_job_view": f"/job/{job_id}/requeue",
        "rq_dashboard.requeue_all": f"/requeue/{queue}",
        "rq_dashboard.delete_job_view": f"/job/{job_id}/delete",
        "rq_dashboard.empty_queue": f"/queue/{queue}/failed/empty",
        "rq_dashboard.compact_queue": f"/queue/{queue}/compact",
    }
    assert set(changing) == STATE_CHANGING
    for endpoint, path in changing.items():
        assert app.url_map.bind("localhost").match(path, method="POST")[0] == endpoint
    before = keys_of(conn, namespace)
    foreign = [
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
        {"Referer": "http://evil.example/page"},
        {"Origin": "http://localhost.evil.example"},
        {},
    ]
    for path in changing.values():
        for method in ("GET", "HEAD", "PUT"):
            res = client.open(path, method=method, headers={"Origin": "http://localhost"})
            assert res.status_code == 405, (method, path, res.status_code)
        for headers in foreign:
            res = client.post(path, headers=headers)
            assert res.status_code == 403, (path, headers, res.status_code)
        for path_off in ("delete", "empty", "compact"):
            if path_off in path:
                res = client.post(path, headers={"Origin": "http://localhost"})
                assert res.status_code == 403 and res.json["status"] == "DISABLED", res.json
    assert keys_of(conn, namespace) == before, "a refused request changed Redis"
    assert status_json(procs)["datasets"]["rq"]["failed"] == 1

    res = client.post(
        f"/requeue/{queue}", headers={"Referer": f"http://localhost/0/view/jobs/{queue}/failed"}
    )
    assert res.status_code == 200 and res.json["count"] == 1, res.json
    counts = status_json(procs)["datasets"]["rq"]
    assert (counts["queued"], counts["failed"]) == (1, 0)


def get(url: str, host: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except urllib.error.URLError:
        return 0


def test_only_its_own_host_names(procs, redis_url):
    client = create_app(redis_url, allow_hosts=["dash.example"]).test_client()
    for host in ("localhost:9181", "127.0.0.1:1234", "[::1]:9181", "dash.example", "DASH.example:443"):
        assert client.get("/0/data/queues.json", headers={"Host": host}).status_code == 200, host
    for host in ("evil.example:9181", "evil.example", "dash.example.evil.example", "localhost.evil"):
        res = client.get("/0/data/queues.json", headers={"Host": host})
        assert res.status_code == 400 and b"--allow-host" in res.data, host
        assert (
            client.post("/requeue/q", headers={"Host": host, "Origin": f"http://{host}"}).status_code == 400
        )

    port = free_port()
    dashboard = procs.start(
        "dashboard", "--port", str(port), env={"GENQ_DASHBOARD_ALLOW_HOST": "a.example, b.example:8443"}
    )
    base = f"http://127.0.0.1:{port}/0/data/queues.json"
    wait_until(lambda: get(base) == 200, 30, "the dashboard")
    assert get(base, "a.example") == get(base, f"b.example:{port}") == 200
    assert get(base, f"evil.example:{port}") == 400
    assert dashboard.poll() is None


@pytest.mark.parametrize("bind", ["0.0.0.0", "::"])
def test_no_password_no_open_bind(procs, bind):
    res = procs.run("dashboard", "--bind", bind, "--port", str(free_port()), timeout=30)
    assert res.returncode == 2, res
    assert len(res.stderr.strip().splitlines()) == 1 and "without a password" in res.stderr, res.stderr


def test_insecure_no_auth_serves_an_open_bind(procs):
    port = free_port()
    dashboard = procs.start(
        "dashboard",
        "--bind",
        "0.0.0.0",
        "--port",
        str(port),
        "--insecure-no-auth",
        "--allow-host",
        "dash.example",
    )
    base = f"http://127.0.0.1:{port}/0/data/queues.json"
    wait_until(lambda: get(base) == 200 or dashboard.poll() is not None, 30, "the dashboard")
    assert get(base) == 200 and get(base, f"dash.example:{port}") == 200
    assert get(base, f"evil.example:{port}") == 400
