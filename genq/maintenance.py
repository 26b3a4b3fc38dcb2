"""Bring back jobs whose worker died, every few seconds, whoever runs it (workers and collector).

RQ itself does this only in worker maintenance every 10 minutes or on `rq info`; genq's
promise is that a killed worker's jobs run again within its heartbeat TTL plus one interval
here, whether or not anyone runs `rq info`.
"""

from __future__ import annotations

import time

import redis
from rq import Queue, worker_registration
from rq.registry import StartedJobRegistry

from genq import datasets
from genq.keys import Keys

# An id in RQ's intermediate list that no worker started within this long was dropped by a
# worker that died between taking it and starting it.
STRANDED_AFTER_S = 60


def reap(conn: redis.Redis, keys: Keys, owner: str, interval_s: int) -> bool:
    """Requeue abandoned and stranded jobs; one caller per interval across the namespace."""
    if not conn.set(keys.maintenance_lock, owner, nx=True, ex=max(1, interval_s)):
        return False
    for name in datasets.load_all(conn, keys):
        queue = Queue(keys.queue_name(name), connection=conn, serializer="json")
        # Abandoned: requeued while the job has RQ retries left, else failed (AbandonedJobError).
        StartedJobRegistry(queue=queue, serializer="json").cleanup()
        _requeue_stranded(conn, queue)
        worker_registration.clean_worker_registry(queue)
    return True


def _requeue_stranded(conn: redis.Redis, queue: Queue) -> None:
    started = {entry.split(b":")[0] for entry in conn.zrange(queue.started_job_registry.key, 0, -1)}
    now = time.time()
    for job_id in conn.lrange(queue.intermediate_queue_key, 0, -1):
        if job_id in started:
            continue
        seen_key = f"{queue.intermediate_queue_key}:first_seen:{job_id.decode()}"
        if conn.set(seen_key, now, nx=True, ex=3600):
            continue
        if now - float(conn.get(seen_key) or now) < STRANDED_AFTER_S:
            continue
        with conn.pipeline() as pipe:
            pipe.lrem(queue.intermediate_queue_key, 1, job_id)
            pipe.lpush(queue.key, job_id)
            pipe.delete(seen_key)
            pipe.execute()
