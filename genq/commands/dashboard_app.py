"""`genq dashboard`: rq-dashboard 0.9, configured for genq, with what breaks on JSON jobs fixed.

Built from rq-dashboard's own blueprint; only these are replaced (FACTS.md, checked against its
``web.py``):

- the JSON serializer everywhere it takes one (``rq_dashboard.web.config.serializer``);
- ``workers.json``: rq-dashboard calls ``Worker.all()`` without the serializer, and reading a busy
  worker's current job then fails (HTTP 500). Ours passes it, and a current job that has already
  expired shows as idle instead of failing the page;
- requeue (one job, or a queue's failed jobs): rq-dashboard's re-saves the job's meta as pickle
  and leaves genq's bookkeeping behind (the ``failed`` bit, the attempt count). Ours does what
  `genq retry` does, for failures already in ``errors.jsonl``; jobs outside genq's queues are
  refused (403);
- deleting jobs and emptying registries is off: a deleted job is a job `genq status` can no
  longer account for;
- one Redis connection made by genq (password file, TLS) instead of one per request.

The command is genq/commands/dashboard.py; this module (Flask, rq-dashboard) is imported only by it.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

import rq_dashboard
from flask import Flask, Response, abort, current_app, jsonify, request
from rq import Worker
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer
from rq_dashboard import web

from genq import datasets, failures
from genq.connection import connect, redact
from genq.keys import Keys, validate_name

log = logging.getLogger("genq.dashboard")
BLUEPRINT = "rq_dashboard"


def create_app(redis_url: str, username: str = "genq", password: str | None = None) -> Flask:
    web.config.serializer = JSONSerializer
    # Named after rq_dashboard so its static folder (the favicon its pages link to) is the app's.
    app = Flask(BLUEPRINT)
    app.config.from_object(rq_dashboard.default_settings)
    app.config.update(
        # Shown on its pages only (its own connect, rq_dashboard/web.py push_rq_connection, is
        # replaced by _one_instance below; genq's connection is app.redis_conn): no password.
        RQ_DASHBOARD_REDIS_URL=(redact(redis_url),),
        RQ_DASHBOARD_DISABLE_DELETE=True,
        RQ_DASHBOARD_POLL_INTERVAL=2500,
    )
    app.register_blueprint(rq_dashboard.blueprint, url_prefix="")
    app.redis_conn = connect(redis_url)
    app.before_request_funcs[BLUEPRINT] = [_one_instance]
    app.view_functions[f"{BLUEPRINT}.list_workers"] = list_workers
    app.view_functions[f"{BLUEPRINT}.requeue_job_view"] = requeue_job
    app.view_functions[f"{BLUEPRINT}.requeue_all"] = requeue_queue
    if password:
        app.before_request(_basic_auth(username, password))
    return app


def _one_instance() -> None:
    """rq-dashboard opens a new connection per request for /<n>/ pages; genq serves its one Redis."""
    if (request.view_args or {}).get("instance_number", 0) != 0:
        abort(404)


def _basic_auth(username: str, password: str):
    def check() -> Response | None:
        auth = request.authorization
        ok = (
            auth is not None
            and hmac.compare_digest((auth.username or "").encode(), username.encode())
            and hmac.compare_digest((auth.password or "").encode(), password.encode())
        )
        if ok:
            return None
        return Response("genq dashboard: log in", 401, {"WWW-Authenticate": 'Basic realm="genq"'})

    return check


# -- replaced views -----------------------------------------------------------------------------


def list_workers(instance_number: int) -> tuple[Response, dict[str, str]]:
    workers = [_worker(w) for w in Worker.all(connection=current_app.redis_conn, serializer=JSONSerializer)]
    workers.sort(key=lambda w: (w["state"], w["queues"], w["name"]))
    return jsonify(workers=workers), {"Cache-Control": "no-store"}


def _worker(worker: Worker) -> dict[str, Any]:
    try:
        current = web.serialize_current_job(worker.get_current_job())
    except NoSuchJobError:  # finished, and its short result TTL ran out
        current = "idle"
    return {
        "name": worker.name,
        "pid": worker.pid,
        "queues": [q.name for q in worker.queues],
        "state": str(worker.get_state()),
        "current_job": current,
        "last_heartbeat": worker.last_heartbeat,
        "birth_date": worker.birth_date,
        "successful_job_count": worker.successful_job_count,
        "failed_job_count": worker.failed_job_count,
        "total_working_time": worker.total_working_time,
        "version": getattr(worker, "version", ""),
        "python_version": getattr(worker, "python_version", ""),
    }


def _genq_queue(queue_name: str) -> tuple[Keys, str] | None:
    """(keys, dataset) of one of genq's queues ``<namespace>.<dataset>``, else None."""
    namespace, _, dataset = queue_name.partition(".")
    try:
        keys = Keys(validate_name(namespace, "namespace"))
    except ValueError:
        return None
    if not dataset or datasets.load(current_app.redis_conn, keys, dataset) is None:
        return None
    return keys, dataset


def _retry(queue_name: str, job_id: str | None) -> tuple[Response, int]:
    found = _genq_queue(queue_name)
    if found is None:
        message = f"{queue_name!r} is not a genq queue: requeue it with RQ's own tools"
        return jsonify(status="REFUSED", message=message), 403
    keys, dataset = found
    conn = current_app.redis_conn
    chosen = [f for f in failures.failures(conn, keys, dataset) if job_id is None or f.job_id == job_id]
    retried, waiting = failures.retry(conn, keys, chosen)
    log.info("dashboard: requeued %d failed jobs of %s (%d not on disk yet)", retried, queue_name, waiting)
    return jsonify(status="OK", count=retried, waiting=waiting), 200


def requeue_job(job_id: str) -> tuple[Response, int]:
    try:
        job = Job.fetch(job_id, connection=current_app.redis_conn, serializer=JSONSerializer)
    except NoSuchJobError:
        return jsonify(status="ERROR", message=f"no job {job_id!r}"), 404
    return _retry(job.origin, job_id)


def requeue_queue(queue_name: str) -> tuple[Response, int]:
    return _retry(queue_name, None)
