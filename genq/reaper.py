"""Bring back jobs whose worker died: the one home of every way genq puts abandoned jobs back.

:func:`reap` runs every few seconds, whoever runs it (workers and collector). RQ itself does this
only in worker maintenance every 10 minutes or on `rq info`; genq's promise is that a killed
worker's jobs run again within its heartbeat TTL plus one interval here, whether or not anyone
runs `rq info`.

:func:`requeue_orphans` is for a private Redis of `genq run`: every worker that ever used it was a
child of an earlier run, so everything still marked started was orphaned and goes back to the
front of its queue at once, instead of after the heartbeat TTL.
"""

from __future__ import annotations

import redis
from rq import Queue, worker_registration
from rq.executions import Execution, ExecutionRegistry
from rq.job import JobStatus
from rq.registry import StartedJobRegistry
from rq.utils import parse_composite_key

from genq import datasets
from genq.clock import redis_time
from genq.keys import Keys
from genq.queues import GenqJob, rq_queue

# An id in RQ's intermediate list that no worker started within this many reaper intervals (a
# worker moves it out in milliseconds) was dropped by a worker that died between taking it and
# starting it.
STRANDED_INTERVALS = 3
STRANDED_MIN_S = 10


# The reaper runs when the caller's own interval has passed since anyone last ran it, by Redis's
# clock. (A lock held for the caller's interval let the collector's 15 s hold back workers whose
# short heartbeat TTL asks for a reap every 2 s: their jobs came back up to 15 s late.)
_CLAIM = """
local lock, interval = KEYS[1], tonumber(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local last = tonumber(redis.call('GET', lock) or '') or 0
if now - last < interval then return 0 end
redis.call('SET', lock, string.format('%.3f', now), 'EX', 600)
return 1
"""


def reap(conn: redis.Redis, keys: Keys, interval_s: int) -> bool:
    """Requeue abandoned and stranded jobs; at most once per caller's interval across the namespace."""
    if not conn.eval(_CLAIM, 1, keys.maintenance_lock, max(1, interval_s)):
        return False
    for name in datasets.load_all(conn, keys):
        queue = rq_queue(conn, keys, name)
        registry = StartedJobRegistry(queue=queue, serializer="json")
        # Deadlines are compared on Redis's clock, as workers write them (genq/clock.py): RQ's
        # cleanup would read this host's, and a host clock off by minutes would reap live jobs.
        now = redis_time(conn)
        _forget_finished(conn, registry, now)
        # Abandoned: requeued while the job has RQ retries left, else failed (AbandonedJobError).
        registry.cleanup(timestamp=now)
        _requeue_stranded(conn, keys, queue, max(STRANDED_MIN_S, STRANDED_INTERVALS * interval_s), now)
        worker_registration.clean_worker_registry(queue)
        # RQ's own workers trim these in their maintenance; genq's must too, or a finished
        # registry keeps every job of the run (~120 bytes each) long after the job expired.
        queue.finished_job_registry.cleanup(timestamp=now)
    return True


def _forget_finished(conn: redis.Redis, registry: StartedJobRegistry, now: float) -> None:
    """Lapsed executions of jobs that have finished (a late heartbeat of a worker that handed the
    result over, or a partitioned worker returning) are dropped, not abandoned: RQ's cleanup would
    queue a finished job again, and it would be generated twice."""
    members = conn.zrangebyscore(registry.key, 0, now)
    if not members:
        return
    ids = [m.decode().split(":")[0] for m in members]
    jobs = GenqJob.fetch_many(ids, conn, serializer="json")
    done = {JobStatus.FINISHED, JobStatus.FAILED}
    gone = [
        m
        for m, job in zip(members, jobs, strict=True)
        if job is None or job.get_status(refresh=False) in done
    ]
    if gone:
        conn.zrem(registry.key, *gone)


def _requeue_stranded(conn: redis.Redis, keys: Keys, queue: Queue, after_s: float, now: float) -> None:
    """Ids a worker moved into RQ's intermediate list and never started: queued again only when the
    job is still waiting to run. A finished job's id there (a second copy of it, taken by a worker
    that died before it could skip it) is dropped: queueing it would run it twice.

    An id must be seen stranded on consecutive passes for ``after_s``: the first sighting is
    forgotten as soon as the id leaves the list, so a job taken again later starts a new clock.
    """
    ids = conn.lrange(queue.intermediate_queue_key, 0, -1)
    # Read after the list: an id started in between shows as started, never as stranded.
    started = {entry.split(b":")[0] for entry in conn.zrange(queue.started_job_registry.key, 0, -1)}
    seen = conn.hgetall(keys.stranded(queue.name))
    stranded = [job_id for job_id in ids if job_id not in started]
    left = [job_id for job_id in seen if job_id not in stranded]
    if left:
        conn.hdel(keys.stranded(queue.name), *left)
    for job_id in stranded:
        if job_id not in seen:
            conn.hset(keys.stranded(queue.name), job_id, now)
            continue
        if now - float(seen[job_id]) < after_s:
            continue
        job = GenqJob.fetch_many([job_id.decode()], conn, serializer="json")[0]
        waiting = job is not None and job.get_status(refresh=False) == JobStatus.QUEUED
        with conn.pipeline() as pipe:
            pipe.lrem(queue.intermediate_queue_key, 1, job_id)
            if waiting:
                pipe.lpush(queue.key, job_id)
            pipe.hdel(keys.stranded(queue.name), job_id)
            pipe.execute()


def requeue_orphans(conn: redis.Redis, keys: Keys) -> int:
    """Put back every job left taken or started on a Redis nothing else runs; return how many."""
    count = 0
    for name in datasets.load_all(conn, keys):
        queue = rq_queue(conn, keys, name)
        while conn.lmove(queue.intermediate_queue_key, queue.key, "RIGHT", "LEFT") is not None:
            count += 1
        registry = queue.started_job_registry
        for entry in conn.zrange(registry.key, 0, -1):
            job_id, execution_id = parse_composite_key(entry.decode())
            with conn.pipeline() as pipe:
                pipe.zrem(registry.key, entry)
                # RQ's names of the execution's hash and the job's executions (rq/executions.py)
                execution = Execution(execution_id, job_id, conn).key
                pipe.delete(execution, ExecutionRegistry.key_template.format(job_id))
                if GenqJob.exists(job_id, connection=conn):
                    job = GenqJob.fetch(job_id, connection=conn, serializer="json")
                    queue._enqueue_job(job, pipeline=pipe, at_front=True)
                    count += 1
                pipe.execute()
    return count
