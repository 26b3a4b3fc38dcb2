"""One enqueue of a dataset at a time: a lease in Redis, renewed while it runs, fencing every push.

Two enqueues of one dataset reading its bitmaps at once would both find a row new and both queue
it (the server then generates it twice). So an enqueue takes the dataset's lease
(``enqueuing:<name>``, ``SET NX PX``) before it reads the bitmaps, and a second one waits for it,
saying so in one line. A thread renews the lease every ``RENEW_S``; a killed enqueue's lapses
within ``TTL_MS``. Every push is fenced: it WATCHes the lease, checks it is still this enqueue's,
and its MULTI applies only if nobody took the lease meanwhile (an enqueue paused past its TTL
pushes nothing and stops: :class:`LeaseLost`). The renewals and the pushes share a lock, so the
renewal's own PEXPIRE never aborts a push of the same enqueue.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

import redis
from redis.client import Pipeline

log = logging.getLogger("genq.enqueue")

TTL_MS = 10_000
RENEW_S = 2.0
POLL_S = 0.1  # how often a waiting enqueue looks at the lease again

_RENEW = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0"""
_RELEASE = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0"""


class LeaseLost(Exception):
    """Another enqueue holds the dataset's lease now: this one pushed nothing more."""


class Lease:
    """The dataset's enqueue lease, held from :meth:`acquire` to :meth:`release`."""

    def __init__(self, conn: redis.Redis, key: str, dataset: str):
        self.conn, self.key, self.dataset = conn, key, dataset
        self.token = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def acquire(self, report: Callable[[str], None]) -> None:
        """Take the lease, waiting (one line said) while another enqueue holds it."""
        said = False
        while not self.conn.set(self.key, self.token, nx=True, px=TTL_MS):
            holder = self.conn.get(self.key)
            if holder is not None and not said:
                report(
                    f"{self.dataset}: another enqueue ({holder.decode(errors='replace')}) is enqueueing this "
                    f"dataset; waiting for it to finish, then enqueueing what it left (a killed one's lease "
                    f"lapses within {TTL_MS // 1000} s)"
                )
                said = True
            time.sleep(POLL_S)
        self.thread = threading.Thread(target=self._renew_loop, name="enqueue-lease", daemon=True)
        self.thread.start()

    def renew(self) -> bool:
        with self.lock:
            return bool(self.conn.eval(_RENEW, 1, self.key, self.token, TTL_MS))

    def _renew_loop(self) -> None:
        while not self.stopped.wait(RENEW_S):
            try:
                if not self.renew():
                    return  # lost: the next push says so
            except redis.RedisError as exc:  # an outage: try again; past the TTL the next push stops
                log.warning("%s: could not renew the enqueue lease: %s", self.dataset, exc)

    def push(self, build: Callable[[Pipeline], None]) -> None:
        """Run the MULTI ``build`` queues only while the lease is this enqueue's."""
        with self.lock, self.conn.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self.key)
                holder = pipe.get(self.key)
                if holder != self.token.encode():
                    raise self._lost(holder)
                pipe.multi()
                build(pipe)
                pipe.execute()
            except redis.WatchError:
                raise self._lost(self.conn.get(self.key)) from None

    def _lost(self, holder: bytes | None) -> LeaseLost:
        who = f"held by {holder.decode(errors='replace')}" if holder else "lapsed"
        return LeaseLost(
            f"{self.dataset}: this enqueue lost the dataset's lease ({who}: it could not renew it within "
            f"{TTL_MS // 1000} s); it stopped without pushing more, and each push is one MULTI, so nothing "
            "is half-enqueued: run the same command again"
        )

    def release(self) -> None:
        """Give the lease back (if Redis is away, it lapses by itself)."""
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()
        with self.lock:
            try:
                self.conn.eval(_RELEASE, 1, self.key, self.token)
            except redis.RedisError as exc:
                log.warning("%s: could not give the lease back (it lapses by itself): %s", self.dataset, exc)
