"""Probation: after a server crash, the jobs it dropped are resent one at a time.

A prompt can crash the server (SGLang does not check input ids against the vocabulary, and a
kernel can fault on odd input); after each restart every job the crash dropped is sent again,
so resending them all at once would crash it again and make every neighbour look as guilty as
the culprit. Instead each of them waits for its turn and goes alone among the suspects (jobs
that were never at a crash run as usual beside it):

- highest crash count first, then the one sent last before the crash (a prompt that kills the
  server on arrival is among the last sent), so the culprit is usually resent first;
- a suspect that reaches ``--max-crashes`` fails as ``suspect_crash`` and the jobs dropped by
  the same crashes are pardoned: they leave probation and go back to normal sends.

An innocent suspect gains a crash only while it is the one suspect in flight and some other,
fresh prompt crashes the server; so reaching the bound takes max-crashes - 1 such crashes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass(order=True)
class _Turn:
    priority: tuple[int, float]
    order: int
    key: Hashable = field(compare=False)
    ready: asyncio.Future[bool] = field(compare=False)


class Probation:
    """One suspect send at a time in this worker; the rest wait in priority order."""

    def __init__(self) -> None:
        self._queue: list[_Turn] = []
        self._pending: dict[Hashable, asyncio.Future[bool]] = {}
        self._busy = False
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        """Suspects waiting for their turn: they hold no connection, so they take no slot."""
        return len(self._pending)

    async def turn(self, key: Hashable, crashes: int, last_sent: float) -> bool:
        """Wait for this suspect's turn. True: it holds the turn (call :meth:`done` after the
        send); False: it was pardoned while waiting and sends as any other job."""
        ready: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending[key] = ready
        heapq.heappush(self._queue, _Turn((-crashes, -last_sent), next(self._order), key, ready))
        self._next()
        try:
            return await ready
        except asyncio.CancelledError:
            if ready.done() and not ready.cancelled() and ready.result():
                self.done()  # granted just as it was cancelled: hand the turn on
            raise
        finally:
            if self._pending.get(key) is ready:
                del self._pending[key]

    def pardon(self, key: Hashable) -> None:
        ready = self._pending.pop(key, None)
        if ready is not None and not ready.done():
            ready.set_result(False)

    def done(self) -> None:
        self._busy = False
        self._next()

    def _next(self) -> None:
        while not self._busy and self._queue:
            turn = heapq.heappop(self._queue)
            if turn.ready.done():  # cancelled or pardoned while waiting
                continue
            del self._pending[turn.key]
            turn.ready.set_result(True)
            self._busy = True
