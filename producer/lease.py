"""One enqueue of a dataset at a time: a lease in Redis, renewed while it runs, fencing every push.

Two enqueues of one dataset reading its bitmaps at once would both find a row new and both queue
it (the server then generates it twice). So an enqueue takes the dataset's lease
(``enqueuing:<name>``) before it reads the bitmaps, and a second one waits for it, saying so in
one line. A thread renews the lease every ``RENEW_S``; a killed enqueue's lapses within
``TTL_MS``. Every take of the lease also counts up the dataset's lease epoch
(``enqueuing:<name>:epoch``) in the same MULTI, and every push is fenced: it WATCHes both, and
its MULTI applies only if the lease is still this enqueue's, or lapsed with the epoch still this
enqueue's (nobody took the dataset meanwhile, so nobody pushed: it takes the lease back in the
same MULTI). A lease can lapse while Redis refuses every write (out of memory: even PEXPIRE is a
``denyoom`` write), and the enqueue then goes on when Redis takes writes again; one whose dataset
another enqueue took meanwhile pushes nothing more and stops (:class:`LeaseLost`). The renewals
and the pushes share a lock, so the renewal's own PEXPIRE never aborts a push of the same enqueue.
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


class LeaseLost(Exception):
    """Another enqueue took the dataset: this one pushed nothing more."""


class Lease:
    """The dataset's enqueue lease, held from :meth:`acquire` to :meth:`release`."""

    def __init__(self, conn: redis.Redis, key: str, epoch_key: str, dataset: str):
        self.conn, self.key, self.epoch_key, self.dataset = conn, key, epoch_key, dataset
        self.token = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.epoch: bytes | None = None
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def acquire(self, report: Callable[[str], None]) -> None:
        """Take the lease, waiting (one line said) while another enqueue holds it."""
        said = False
        while not self._take():
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

    def _take(self) -> bool:
        with self.conn.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self.key)
                if pipe.get(self.key) is not None:
                    return False
                pipe.multi()
                pipe.set(self.key, self.token, px=TTL_MS)
                pipe.incr(self.epoch_key)
                self.epoch = str(pipe.execute()[1]).encode()
                return True
            except redis.WatchError:
                return False

    def renew(self) -> bool:
        """Push the lease's end back (taking it back if it lapsed and nobody took it since)."""
        with self.lock:
            return self._if_mine(lambda pipe: None)

    def _renew_loop(self) -> None:
        said = False
        while not self.stopped.wait(RENEW_S):
            try:
                if not self.renew():
                    return  # lost: the next push says so
                said = False
            except redis.RedisError as exc:  # an outage: the next renewal or push takes it back
                if not said:
                    log.warning("%s: could not renew the enqueue lease (retrying): %s", self.dataset, exc)
                    said = True

    def _if_mine(self, change: Callable[[Pipeline], object]) -> bool:
        """Run ``change``'s MULTI, renewing the lease in it, if the dataset is still this enqueue's."""
        while True:
            with self.conn.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(self.key, self.epoch_key)
                    holder, epoch = pipe.get(self.key), pipe.get(self.epoch_key)
                    if holder != self.token.encode() and (holder is not None or epoch != self.epoch):
                        return False
                    pipe.multi()
                    pipe.set(self.key, self.token, px=TTL_MS)
                    change(pipe)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue  # the lease changed (lapsed, or taken) meanwhile: look again

    def push(self, build: Callable[[Pipeline], None]) -> None:
        """Run the MULTI ``build`` queues only while the dataset is this enqueue's."""
        with self.lock:
            if not self._if_mine(build):
                holder = self.conn.get(self.key)
                who = f"held by {holder.decode(errors='replace')}" if holder else "taken and given back"
                raise LeaseLost(
                    f"{self.dataset}: another enqueue took the dataset while this one could not renew its "
                    f"lease ({who}); this one stopped without pushing more, and each push is one MULTI, so "
                    "nothing is half-enqueued: run the same command again"
                )

    def release(self) -> None:
        """Give the lease back (if Redis is away, it lapses by itself)."""
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()
        with self.lock:
            try:
                with self.conn.pipeline(transaction=True) as pipe:
                    pipe.watch(self.key)
                    if pipe.get(self.key) == self.token.encode():
                        pipe.multi()
                        pipe.delete(self.key)
                        pipe.execute()
            except redis.RedisError as exc:
                log.warning("%s: could not give the lease back (it lapses by itself): %s", self.dataset, exc)
