"""A dataset's RQ queue, built one way everywhere: its name from genq's keys, the JSON serializer.

RQ keeps each dataset's jobs in a queue of its own (``Keys.queue_name``); every reader and writer
of those queues (enqueue, the reaper, failures, progress, verify, the collector) opens it here, so
none can open one without the JSON serializer (decision 2: never pickle).
"""

from __future__ import annotations

import redis
from rq import Queue

from genq.keys import Keys

SERIALIZER = "json"


def rq_queue(conn: redis.Redis, keys: Keys, dataset: str) -> Queue:
    """The RQ queue of ``dataset`` in this namespace."""
    return Queue(keys.queue_name(dataset), connection=conn, serializer=SERIALIZER)
