"""`genq dashboard`: rq-dashboard 0.9, configured for genq, reading jobs as JSON only.

Built from rq-dashboard's own blueprint (rq_dashboard/web.py). :data:`ROUTES` says what genq does
with each of its routes; an rq-dashboard with a route not in it is refused at start, so an upgrade
cannot bring an unreviewed page. What genq changes:

- jobs are read as JSON only, never with pickle (anyone who can write to Redis could plant a
  pickle that runs on this host): the JSON serializer everywhere rq-dashboard takes one
  (``rq_dashboard.web.config.serializer``), and genq's own views where it does not (the job page,
  ``workers.json``). A job whose meta, data or result is not JSON shows as :data:`UNREADABLE`;
- ``workers.json``: rq-dashboard calls ``Worker.all()`` without the serializer, and reading a busy
  worker's current job then fails (HTTP 500). Ours passes it, and a current job that has already
  expired shows as idle instead of failing the page;
- requeue (one job, or a queue's failed jobs): rq-dashboard's re-saves the job's meta as pickle
  and leaves genq's bookkeeping behind (the ``failed`` bit, the attempt count). Ours does what
  `genq retry` does, for failures already in ``errors.jsonl``; jobs outside genq's queues are
  refused (403);
- deleting jobs, emptying registries and compacting queues are off (403);
- Host, basic auth, POST-only state changes from the dashboard's own pages: dashboard_guard.py;
- one Redis connection made by genq (password file, TLS) instead of one per request.

The command is genq/commands/dashboard.py; this module (Flask, rq-dashboard) is imported only by it.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable
from typing import Any

import rq_dashboard
from flask import (
    Flask,
    Response,
    abort,
    current_app,
    jsonify,
    make_response,
    render_template,
    request,
    url_for,
)
from rq import VERSION as rq_version
from rq import Worker
from rq.exceptions import DeserializationError, NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer
from rq_dashboard import web
from rq_dashboard.version import VERSION as rq_dashboard_version

from genq import datasets, failures
from genq.commands.dashboard_guard import allowed_names, basic_auth, check_host, check_state_change
from genq.connection import connect, redact
from genq.keys import Keys, validate_name
from genq.queues import GenqJob

log = logging.getLogger("genq.dashboard")
BLUEPRINT = "rq_dashboard"
UNREADABLE = "(unreadable: not JSON; genq reads jobs as JSON only)"

# Every route of rq-dashboard 0.9's blueprint (rq_dashboard/web.py), and what genq does with it.
ROUTES = {
    "static": "served: its CSS and scripts",
    "favicon": "served",
    "queues_overview": "served: lists queue names (Queue.all reads no job)",
    "workers_overview": "served: the page's table is filled from workers.json",
    "jobs_overview": "served: queue names only; the table is filled from the jobs .json",
    "job_view": "replaced: rq-dashboard's fetches the job with pickle; genq's reads none",
    "job_info": "replaced: JSON only; a job that is not JSON shows as unreadable",
    "list_jobs": "wrapped: rq-dashboard's with the JSON serializer; unreadable jobs marked",
    "list_queues": "served: counts only",
    "list_workers": "replaced: JSON; a current job that is not JSON shows as unreadable",
    "requeue_job_view": "replaced: `genq retry` of that job (POST)",
    "requeue_all": "replaced: `genq retry` of the queue's failures (POST)",
    "delete_job_view": "off (403): a deleted job is one `genq status` can no longer account for",
    "empty_queue": "off (403): deletes jobs",
    "compact_queue": "off (403): RQ moves every queued id through a temporary list; stopped midway, "
    "the rest is lost",
}
# POST only, from the dashboard's own pages (dashboard_guard.check_state_change).
STATE_CHANGING = frozenset(
    f"{BLUEPRINT}.{name}"
    for name in ("requeue_job_view", "requeue_all", "delete_job_view", "empty_queue", "compact_queue")
)


def create_app(
    redis_url: str,
    username: str = "genq",
    password: str | None = None,
    bind: str = "127.0.0.1",
    allow_hosts: Iterable[str] = (),
    redis_auth: dict[str, Any] | None = None,
) -> Flask:
    web.config.serializer = JSONSerializer
    # Named after rq_dashboard so its static folder (the favicon its pages link to) is the app's.
    app = Flask(BLUEPRINT)
    app.config.update(
        # Shown on its pages only (its own connect, rq_dashboard/web.py push_rq_connection, is
        # replaced by _one_instance below; genq's connection is app.redis_conn): no password.
        RQ_DASHBOARD_REDIS_URL=(redact(redis_url),),
        RQ_DASHBOARD_DISABLE_DELETE=True,
        RQ_DASHBOARD_SHOW_FULL_ARGS=False,  # the description only: no job's data is deserialized
        RQ_DASHBOARD_POLL_INTERVAL=2500,
    )
    app.register_blueprint(rq_dashboard.blueprint, url_prefix="")
    unreviewed = {e.partition(".")[2] for e in app.view_functions if e.startswith(f"{BLUEPRINT}.")} - set(
        ROUTES
    )
    if unreviewed:
        raise RuntimeError(f"rq-dashboard has routes genq has not reviewed: {sorted(unreviewed)}")
    app.redis_conn = connect(redis_url, **(redis_auth or {}))  # a run's private Redis: its password
    app.before_request_funcs[BLUEPRINT] = [_one_instance]
    views = {
        "job_view": job_view,
        "job_info": job_info,
        "list_jobs": list_jobs,
        "list_workers": list_workers,
        "requeue_job_view": requeue_job,
        "requeue_all": requeue_queue,
        "delete_job_view": refused,
        "empty_queue": refused,
        "compact_queue": refused,
    }
    for name, view in views.items():
        app.view_functions[f"{BLUEPRINT}.{name}"] = view
    app.before_request(check_host(allowed_names(bind, allow_hosts)))
    if password:
        app.before_request(basic_auth(username, password))
    app.before_request(check_state_change(STATE_CHANGING))
    return app


def _one_instance() -> None:
    """rq-dashboard opens a new connection per request for /<n>/ pages; genq serves its one Redis."""
    if (request.view_args or {}).get("instance_number", 0) != 0:
        abort(404)


# -- reading jobs as JSON only ------------------------------------------------------------------


def read(conn: Any, job_id: str) -> tuple[Job, bool]:
    """The job fetched with the JSON serializer, and whether its meta, data and latest result are JSON.

    Raises NoSuchJobError. RQ's ``Job.restore`` (rq/job.py) reads only plain fields, swallows a meta
    it cannot parse and leaves the data for later; parsing each here is what tells.
    """
    job = GenqJob.fetch(job_id, connection=conn, serializer=JSONSerializer)
    try:
        job.get_meta()  # read again and parsed: restore swallowed a failure
        job.args  # noqa: B018 (Job._deserialize_data)
        job.latest_result()
    except (ValueError, DeserializationError, zlib.error):
        return job, False
    return job, True


def _unreadable(job: Job) -> dict[str, Any]:
    """job_info's fields (web.py job_info) for a job that is not JSON: its plain fields only."""
    return {
        "id": job.id,
        "created_at": web.serialize_date(job.created_at),
        "enqueued_at": web.serialize_date(job.enqueued_at),
        "started_at": web.serialize_date(job.started_at),
        "ended_at": web.serialize_date(job.ended_at),
        "origin": job.origin,
        "status": job.get_status(refresh=False),
        "result": None,
        "exc_info": None,
        "description": UNREADABLE,
        "metadata": UNREADABLE,
    }


# -- replaced views -----------------------------------------------------------------------------


def job_view(instance_number: int, job_id: str) -> Response:
    """The job page: rq-dashboard's template, whose script reads job_info; the job itself is not read."""
    if not current_app.redis_conn.exists(Job.key_for(job_id)):
        abort(404)
    page = render_template(
        "rq_dashboard/job.html",
        current_instance=instance_number,
        instance_list=web.escape_format_instance_list(current_app.config["RQ_DASHBOARD_REDIS_URL"]),
        id=job_id,
        rq_url_prefix=url_for(f"{BLUEPRINT}.queues_overview"),
        rq_dashboard_version=rq_dashboard_version,
        rq_version=rq_version,
        deprecation_options_usage=False,
        enable_delete=False,
    )
    return make_response(page, {"Cache-Control": "no-store"})


def job_info(instance_number: int, job_id: str) -> tuple[Response, int | dict[str, str]]:
    try:
        job, readable = read(current_app.redis_conn, job_id)
    except NoSuchJobError:
        return jsonify(status="ERROR", message=f"no job {job_id!r}"), 404
    if readable:
        return web.job_info(instance_number=instance_number, job_id=job_id)
    return jsonify(_unreadable(job)), {"Cache-Control": "no-store"}


def list_jobs(**args: Any) -> tuple[Response, dict[str, str]]:
    # web.py's list_jobs is wrapped by its own jsonify (functools.wraps): __wrapped__ gives the dict.
    listing = web.list_jobs.__wrapped__(**args)
    for row in listing["jobs"]:
        try:
            if not read(current_app.redis_conn, row["id"])[1]:
                row.update(description=UNREADABLE, exc_info=None)
        except NoSuchJobError:
            pass  # gone since listed: the next refresh drops it
    return jsonify(**listing), {"Cache-Control": "no-store"}


def list_workers(instance_number: int) -> tuple[Response, dict[str, str]]:
    workers = [_worker(w) for w in Worker.all(connection=current_app.redis_conn, serializer=JSONSerializer)]
    workers.sort(key=lambda w: (w["state"], w["queues"], w["name"]))
    return jsonify(workers=workers), {"Cache-Control": "no-store"}


def _current_job(worker: Worker) -> dict[str, Any] | str:
    job_id = worker.get_current_job_id()
    if job_id is None:
        return "idle"
    try:
        job, readable = read(worker.connection, job_id)
    except NoSuchJobError:  # finished, and its short result TTL ran out
        return "idle"
    if readable:
        return web.serialize_current_job(job)
    created = web.serialize_date(job.created_at)
    return {"job_id": job.id, "description": UNREADABLE, "created_at": created, "call_string": UNREADABLE}


def _worker(worker: Worker) -> dict[str, Any]:
    return {
        "name": worker.name,
        "pid": worker.pid,
        "queues": [q.name for q in worker.queues],
        "state": str(worker.get_state()),
        "current_job": _current_job(worker),
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
        job = GenqJob.fetch(job_id, connection=current_app.redis_conn, serializer=JSONSerializer)
    except NoSuchJobError:
        return jsonify(status="ERROR", message=f"no job {job_id!r}"), 404
    return _retry(job.origin, job_id)


def requeue_queue(queue_name: str) -> tuple[Response, int]:
    return _retry(queue_name, None)


def refused(**_: str) -> tuple[Response, int]:
    name = (request.endpoint or "").partition(".")[2]
    return jsonify(status="DISABLED", message=f"off in genq dashboard: {ROUTES[name]}"), 403
