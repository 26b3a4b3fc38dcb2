"""Group commit: the Redis writes of many jobs in one round trip.

A worker with a hundred jobs in flight charges an attempt before every send and hands over a result
after every answer. Written one by one, that is a round trip each: Redis's CPU goes to reading and
answering small requests, and on a slow network the jobs wait on the round trips. Here each write
waits in a list; one task sends everything waiting as one script call (worker/rq_batch.py APPLY),
and while that call is on its way the next group gathers. A group also waits LINGER_S for company:
a finished job has already given its slot to the next (worker/daemon.py), so that wait delays only
the record's arrival in the stream, and first attempts are charged when the job is taken.

Each group carries a token of its own: a group whose reply was lost (the connection dropped after
Redis applied it) is sent again whole by the caller's retry, and the token makes that second
call answer the first one's attempts without charging or writing anything twice
(worker/rq_batch.py APPLY). The next group is sent only once this one has landed, so one token
per worker is all Redis keeps.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

from genq.worker.rq_worker import Finished

LINGER_S = 0.025

Commit = Callable[[str, list[str], list[Finished]], Awaitable[list[int]]]


class GroupCommit:
    """Gathers charges and endings; :meth:`run` (a background task) writes them in groups."""

    def __init__(self, commit: Commit):
        self._commit = commit
        self._charges: list[tuple[str, asyncio.Future[int]]] = []
        self._finished: list[tuple[Finished, asyncio.Future[int]]] = []
        self._waiting = asyncio.Event()

    async def charge(self, job_id: str) -> int:
        """Charge a send to the job; its attempt number."""
        future = asyncio.get_running_loop().create_future()
        self._charges.append((job_id, future))
        self._waiting.set()
        return await future

    async def finish(self, ending: Finished) -> None:
        """Hand a result (or error) over and finish (or fail) the job in RQ, in one step; returns
        once it is in Redis."""
        future = asyncio.get_running_loop().create_future()
        self._finished.append((ending, future))
        self._waiting.set()
        await future

    async def run(self) -> None:
        while True:
            await self._waiting.wait()
            await asyncio.sleep(LINGER_S)
            self._waiting.clear()
            charges, self._charges = self._charges, []
            finished, self._finished = self._finished, []
            futures = [f for _, f in charges] + [f for _, f in finished]
            try:
                token = uuid.uuid4().hex
                attempts = await self._commit(token, [c for c, _ in charges], [e for e, _ in finished])
            except asyncio.CancelledError:
                for future in futures:
                    future.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - each waiting job gets it
                for future in futures:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), attempt in zip(charges, attempts, strict=True):
                if not future.done():
                    future.set_result(attempt)
            for _, future in finished:
                if not future.done():
                    future.set_result(0)
