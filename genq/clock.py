"""Redis's clock: the one time every host of a run agrees on.

Heartbeat deadlines and registry scores written by one host are compared by another (the reaper
runs in every worker and in the collector). Compared on each host's own ``time.time()``, a GPU host
whose clock is 100 s behind writes deadlines that look 100 s lapsed to everyone else, and its jobs
are generated twice. So every such time is Redis's ``TIME``, read here: once, then through this
host's clock plus the measured offset, measured again every :data:`RESYNC_S` (a host clock that is
stepped or drifts is corrected within that).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import redis

RESYNC_S = 30.0  # how long an offset is trusted before TIME is read again


def redis_time(conn: redis.Redis) -> float:
    """Redis's ``TIME`` as seconds since the epoch: one round trip."""
    sec, usec = conn.time()
    return sec + usec / 1_000_000


class RedisClock:
    """Redis's time without a round trip per reading: this host's clock plus the offset to Redis's,
    measured at the middle of a ``TIME`` round trip. Only ``time.monotonic`` decides when to
    measure again, so a host clock that is wrong by minutes changes nothing."""

    def __init__(self, conn: redis.Redis, resync_s: float = RESYNC_S):
        self._conn = conn
        self._resync_s = resync_s
        self._offset = 0.0
        self._synced_at: float | None = None  # time.monotonic() of the last measurement

    def timestamp(self) -> float:
        """Now, by Redis's clock, in seconds since the epoch."""
        if self._synced_at is None or time.monotonic() - self._synced_at > self._resync_s:
            self._sync()
        return time.time() + self._offset

    def now(self) -> datetime:
        """Now, by Redis's clock, as RQ's timestamps are: an aware UTC datetime."""
        return datetime.fromtimestamp(self.timestamp(), UTC)

    def _sync(self) -> None:
        before = time.time()
        server = redis_time(self._conn)
        after = time.time()
        self._offset = server - (before + after) / 2
        self._synced_at = time.monotonic()
