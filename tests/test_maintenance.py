"""The reaper's schedule (genq/reaper.py): one reap per caller's interval across the namespace."""

from __future__ import annotations

from genq.keys import Keys
from genq.reaper import reap


def test_a_long_interval_never_holds_back_a_short_one(conn, namespace):
    """The collector reaps every 15 s, a worker with a short heartbeat TTL every 2 s: the worker's
    reap must not wait for the collector's 15 s (a lock held that long made a dead worker's jobs come
    back up to 15 s past the bound in docs/failures.md)."""
    keys = Keys(namespace)
    assert reap(conn, keys, 15)
    assert not reap(conn, keys, 2), "reaped again at once"
    seconds, micros = conn.time()
    conn.set(keys.maintenance_lock, f"{seconds + micros / 1e6 - 3:.3f}")  # the last reap, 3 s ago
    assert not reap(conn, keys, 15)
    assert reap(conn, keys, 2), "a reap 3 s ago held back a worker that reaps every 2 s"
    assert not reap(conn, keys, 2)


def test_the_finished_registry_forgets_expired_jobs(conn, namespace):
    """RQ's own workers trim the finished registry; a genq run of millions of jobs must not keep
    every finished id in it after the job's hash expired."""
    from rq import Queue

    from genq import datasets

    keys = Keys(namespace)
    datasets.register(conn, keys, datasets.settings_for("fin", [], {"max_new_tokens": 8}, 1))
    queue = Queue(keys.queue_name("fin"), connection=conn, serializer="json")
    seconds, _ = conn.time()
    conn.zadd(queue.finished_job_registry.key, {"expired": seconds - 5, "kept": seconds + 55})
    assert reap(conn, keys, 15)
    assert conn.zrange(queue.finished_job_registry.key, 0, -1) == [b"kept"]
