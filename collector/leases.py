"""The collector's per-dataset leases in Redis (decision 11): taking, renewing, fencing, releasing.

Each dataset's stream and files belong to one collector at a time. This module owns the lease
keys, the scripts that touch them and when each was last renewed, so the writer can ask one
question before it touches a folder: is this dataset still ours (``fence``)?
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Collection

import redis

from genq.keys import Keys

log = logging.getLogger("genq.collector")

LEASE_TTL_S = 15
# Stop writing this long before the lease could lapse, by this process's own clock: a collector
# cut off from Redis cannot renew it, and another may take over once it lapses.
FENCE_MARGIN_S = 3.0

_DELETE_IF = """
local key, holder = KEYS[1], ARGV[1]
if redis.call('get', key) == holder then return redis.call('del', key) end
return 0
"""
# 1: renewed; 2: it was gone (Redis forgot it) and is ours again; 0: another collector holds it.
_RENEW = """
local lease, mine, ttl = KEYS[1], ARGV[1], ARGV[2]
local holder = redis.call('get', lease)
if holder == mine then redis.call('expire', lease, ttl) return 1 end
if not holder then redis.call('set', lease, mine, 'EX', ttl) return 2 end
return 0
"""


class LeaseHeld(Exception):
    pass


def _dead_local(holder: str) -> bool:
    """Whether a lease holder ``host:pid:nonce`` is a process of this host that no longer runs."""
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Leases:
    """The leases one collector holds, and when each was last renewed (by its own clock).

    A lease Redis forgot (a failover, a restart from an older snapshot) is taken again on renewal,
    and ``retake`` (set by the Collector) makes that dataset ready again: its files re-read.
    """

    def __init__(self, conn: redis.Redis, keys: Keys) -> None:
        self.conn = conn
        self.keys = keys
        self.lease_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.held: dict[str, float] = {}  # dataset -> when its lease was last renewed (monotonic)
        self._renew = conn.register_script(_RENEW)
        self.retake: Callable[[str], None] = lambda name: None

    def take(self, names: list[str]) -> list[str]:
        """Take the lease of each of ``names`` that nobody holds, or whose holder is a dead process
        of this host; the ones taken. Another live holder's lease is left alone."""
        renewed = time.monotonic()  # before the SETs: the leases run from no later than this
        with self.conn.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.set(self.keys.collector_lease(name), self.lease_id, nx=True, ex=LEASE_TTL_S)
                pipe.get(self.keys.collector_lease(name))
            replies = pipe.execute()
        taken = []
        for name, got, holder in zip(names, replies[::2], replies[1::2], strict=True):
            holder = (holder or b"").decode()
            if not got and holder and _dead_local(holder):
                log.warning("collector %s died holding dataset %s: taking over", holder, name)
                self.conn.eval(_DELETE_IF, 1, self.keys.collector_lease(name), holder)
                got = self.conn.set(self.keys.collector_lease(name), self.lease_id, nx=True, ex=LEASE_TTL_S)
            if got:
                self.held[name] = renewed
                taken.append(name)
        return taken

    def renew(self, force: bool = False) -> set[str]:
        """Keep every lease held, in one round trip once a third of the TTL has passed; take one
        again if Redis lost it (a failover or a restart from an older snapshot forgets recent
        writes), but never from another collector: a lease another holds stops this one. The
        datasets taken again (their files re-read)."""
        now = time.monotonic()
        if not self.held or (not force and all(now - t < LEASE_TTL_S / 3 for t in self.held.values())):
            return set()
        names = list(self.held)
        replies = self._renew_each(names)
        retaken = set()
        for name, renewed in zip(names, replies, strict=True):
            if renewed == 2:
                retaken.add(name)
                log.warning(
                    "Redis had lost this collector's lease of %s (a failover?): took it again; "
                    "re-reading its files",
                    name,
                    extra={"dataset": name},
                )
                self.retake(name)
        return retaken

    def fence(self, names: Collection[str]) -> None:
        """Self-fencing, checked before the files of ``names`` are touched, on this process's own
        clock (not when Redis next answers): past this point a lease may have lapsed and another
        collector may be appending to the same files, so this one stops."""
        if any(self.held_for(n) > LEASE_TTL_S - FENCE_MARGIN_S for n in names):
            # Renew first (a collector cut off from Redis blocks here and writes nothing); a lease
            # another collector took meanwhile stops this one (LeaseHeld).
            self.renew(force=True)
        for name in names:
            held = self.held_for(name)
            if held > LEASE_TTL_S - FENCE_MARGIN_S:
                raise LeaseHeld(
                    f"not writing: the collector lease of {name} was last renewed {held:.0f} s ago and "
                    f"may lapse ({LEASE_TTL_S} s); another collector may take over its folder"
                )

    def confirm(self, names: Collection[str]) -> None:
        """Ask Redis, not this process's clock, whether ``names`` are still this collector's, before
        their files are reconciled: a collector stopped and resumed (SIGSTOP, a paused VM) has a
        fresh-looking clock and a lapsed lease. Renews them; LeaseHeld if another holds one."""
        self._renew_each(list(names))

    def _renew_each(self, names: list[str]) -> list[int]:
        """Renew the leases of ``names`` in one round trip (taking back any Redis forgot); each
        one's reply (1 renewed, 2 taken again). LeaseHeld if another collector holds one."""
        now = time.monotonic()
        with self.conn.pipeline(transaction=False) as pipe:
            for name in names:
                self._renew(
                    keys=[self.keys.collector_lease(name)], args=[self.lease_id, LEASE_TTL_S], client=pipe
                )
            replies = pipe.execute()
        lost = [name for name, renewed in zip(names, replies, strict=True) if not renewed]
        if lost:
            raise LeaseHeld(
                f"lost the collector lease of {', '.join(lost)} in namespace {self.keys.namespace!r}"
            )
        for name in names:
            self.held[name] = now
        return replies

    def drop(self, name: str) -> None:
        """Give up one dataset (set aside: its files cannot be reconciled)."""
        with self.conn.pipeline(transaction=False) as pipe:
            pipe.eval(_DELETE_IF, 1, self.keys.collector_ready(name), self.lease_id)
            pipe.eval(_DELETE_IF, 1, self.keys.collector_lease(name), self.lease_id)
            pipe.execute()
        self.held.pop(name, None)

    def held_for(self, name: str) -> float:
        """Seconds since the lease of ``name`` was last renewed (infinite if not held)."""
        renewed = self.held.get(name)
        return float("inf") if renewed is None else time.monotonic() - renewed

    def release(self) -> None:
        with self.conn.pipeline(transaction=False) as pipe:
            for name in self.held:
                pipe.eval(_DELETE_IF, 1, self.keys.collector_ready(name), self.lease_id)
                pipe.eval(_DELETE_IF, 1, self.keys.collector_lease(name), self.lease_id)
            pipe.execute()
        self.held = {}
