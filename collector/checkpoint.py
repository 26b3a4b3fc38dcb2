"""Commits that apply only to the Redis this collector left them in.

A Redis restarted from an older snapshot, or a failover to a replica that missed the last writes,
forgets the marks and checkpoints of recent commits while the files keep their lines. A collector
that went on as if nothing happened would trust bits that say "not on disk" for lines that are,
and append them again; a commit sent just before a restart and retried on the new server would
move a checkpoint past lines whose marks were lost. Redis-py reconnects and retries on its own, so
a restart need not show as an error at all.

So the checkpoint offsets double as a sequence number: every commit that appends lines moves an
offset, and a commit applies only if each offset still holds the value this collector last gave
it — checked and applied in one script, atomically. A commit refused (``Stale``) means Redis lost
this collector's writes: the files past the checkpoint it kept are read again into Redis.

The same script fences on the leases (decision 11): a commit applies only while every dataset it
touches is leased to this collector. A collector stopped after its last self-check (SIGSTOP, a VM
paused, a long GC) can still append once when it resumes, but never move a checkpoint or mark an
id for it; the new holder finds those bytes past its checkpoint and drops or marks them
(collector/reconcile.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import redis
from redis.commands.core import CoreCommands

from genq.bitmaps import set_bits
from genq.collector.leases import LeaseHeld
from genq.keys import Keys
from genq.schema import KIND_RECORD

# KEYS: the offsets hash, then the lease keys of the datasets touched. ARGV: the lease id, n, then
# n triples (field, expected, new), then commands, each its argument count and its arguments. A
# field never set counts as 0. A lease another collector holds refuses the commit (-1); a lease
# Redis forgot is lost writes like a checkpoint it forgot (0). Lua's unpack stops near 8,000
# values, so callers keep each command well under that (genq/bitmaps.py splits its BITFIELDs).
_COMMIT = """
local offsets, lease_id, n = KEYS[1], ARGV[1], tonumber(ARGV[2])
local FIRST_LEASE, FIRST_TRIPLE = 2, 3  -- KEYS from here: the leases; ARGV from here: the triples
for k = FIRST_LEASE, #KEYS do
  local holder = redis.call('get', KEYS[k])
  if not holder then return 0 end
  if holder ~= lease_id then return -1 end
end
for i = 0, n - 1 do
  local field, expected = ARGV[FIRST_TRIPLE + 3 * i], ARGV[FIRST_TRIPLE + 1 + 3 * i]
  if (redis.call('hget', offsets, field) or '0') ~= expected then return 0 end
end
for i = 0, n - 1 do
  redis.call('hset', offsets, ARGV[FIRST_TRIPLE + 3 * i], ARGV[FIRST_TRIPLE + 2 + 3 * i])
end
local i = FIRST_TRIPLE + 3 * n  -- then the commands
while i <= #ARGV do
  local count = tonumber(ARGV[i])
  redis.call(unpack(ARGV, i + 1, i + count))
  i = i + count + 1
end
return 1
"""
MAX_ARGS = 7000


class Stale(Exception):
    """Redis does not hold the checkpoints this collector last committed: it lost writes."""


class Commands(CoreCommands):
    """redis-py's command methods, recorded instead of sent (the body of a commit)."""

    def __init__(self) -> None:
        self.stack: list[tuple] = []

    def execute_command(self, *args, **options) -> None:
        if len(args) > MAX_ARGS:
            raise ValueError(f"{args[0]} with {len(args)} arguments: split it (Lua's unpack limit)")
        self.stack.append(args)


class Checkpoints:
    """The offsets hash of a namespace, moved only by ``commit``, and only by the holder of the
    leases of the datasets it touches (``lease_id``)."""

    def __init__(self, conn: redis.Redis, keys: Keys, lease_id: str) -> None:
        self.conn = conn
        self.keys = keys
        self.key = keys.collector_offsets
        self.lease_id = lease_id
        self._commit = conn.register_script(_COMMIT)

    def read(self, fields: list[str]) -> list[int]:
        values = self.conn.hmget(self.key, fields) if fields else []
        return [int(v or 0) for v in values]

    def commit(
        self,
        moves: Mapping[str, tuple[int, int]],
        body: Callable[[Commands], None] | None = None,
        *,
        fenced: Collection[str],
    ) -> None:
        """Set each field of ``moves`` from its first value to its second and run ``body``'s
        commands, all at once, if every field still holds its first value and this collector still
        holds the lease of every dataset of ``fenced``; else ``Stale``, or ``LeaseHeld``."""
        commands = Commands()
        if body is not None:
            body(commands)
        args: list[object] = [self.lease_id, len(moves)]
        for field, (old, new) in moves.items():
            args += (field, old, new)
        for command in commands.stack:
            args += (len(command), *command)
        leases = [self.keys.collector_lease(name) for name in sorted(fenced)]
        applied = self._commit(keys=[self.key, *leases], args=args)
        if applied == -1:
            raise LeaseHeld(
                f"not committing: another collector holds the lease of {', '.join(sorted(fenced))} "
                f"in namespace {self.keys.namespace!r} (this one lost it)"
            )
        if not applied:
            raise Stale(f"checkpoints {sorted(moves)} are not where this collector left them")


def mark(pipe: CoreCommands, keys: Keys, name: str, kind: bytes, indexes: list[int]) -> None:
    """Queue the bits that say these ids of dataset ``name`` are on disk (as records or errors):
    in the same commit as the checkpoint move of the lines that hold them."""
    set_bits(pipe, keys.enqueued(name), indexes)
    if kind == KIND_RECORD:
        set_bits(pipe, keys.done(name), indexes)
        set_bits(pipe, keys.failed(name), indexes, 0)  # a record beats an earlier error
    else:
        set_bits(pipe, keys.failed(name), indexes)
