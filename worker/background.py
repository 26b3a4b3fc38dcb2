"""The worker's background tasks (group commit, heartbeats, maintenance, health, reports) kept
running: a task that dies is never silently gone, as its work (heartbeats above all) matters for
as long as the worker runs. Redis outages and refusals are ridden out inside each task
(:meth:`Worker.redis <worker.daemon.Worker.redis>`); what reaches here is unexpected."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("genq.worker")
RESTART_AFTER_S = 5.0


async def keep_running(
    name: str,
    body: Callable[[], Awaitable[None]],
    context: Callable[[], dict],
    pause: float = RESTART_AFTER_S,
) -> None:
    """Run ``body`` until cancelled; each time it dies, log the error and start it again after
    ``pause`` seconds (not at once: a task failing at once must not spin)."""
    while True:
        try:
            await body()
            log.error("background task %s returned; starting it again", name, extra=context())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - logged, and the task goes on
            log.error(
                "background task %s died (%s: %s); starting it again in %.0f s",
                name,
                type(exc).__name__,
                exc,
                pause,
                extra=context(),
            )
        await asyncio.sleep(pause)
