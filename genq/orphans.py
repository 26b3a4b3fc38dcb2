"""Put back jobs that a dead process left started, when nothing else can be running them.

Used by ``genq run`` on its private Redis: every worker that ever used it was a child of an
earlier run, so whatever is still marked started was abandoned and can go back to the front of
its queue at once, instead of after the heartbeat TTL.
"""

from __future__ import annotations

import redis
from rq import Queue
from rq.job import Job
from rq.utils import parse_composite_key

from genq import datasets
from genq.keys import Keys


def requeue_orphans(conn: redis.Redis, keys: Keys) -> int:
    count = 0
    for name in datasets.load_all(conn, keys):
        queue = Queue(keys.queue_name(name), connection=conn, serializer="json")
        while conn.lmove(queue.intermediate_queue_key, queue.key, "RIGHT", "LEFT") is not None:
            count += 1
        registry = queue.started_job_registry
        for entry in conn.zrange(registry.key, 0, -1):
            job_id, execution_id = parse_composite_key(entry.decode())
            with conn.pipeline() as pipe:
                pipe.zrem(registry.key, entry)
                pipe.delete(f"rq:execution:{job_id}:{execution_id}", f"rq:executions:{job_id}")
                if Job.exists(job_id, connection=conn):
                    job = Job.fetch(job_id, connection=conn, serializer="json")
                    queue._enqueue_job(job, pipeline=pipe, at_front=True)
                    count += 1
                pipe.execute()
    return count
