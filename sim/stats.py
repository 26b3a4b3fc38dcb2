"""Counters of what the simulator did, so tests can check delivered versus wasted work."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from genq.sim.faults import FAULT_KINDS


@dataclass
class SimStats:
    """Served at GET /sim/stats. generations - completed is work done that no client received."""

    requests: int = 0  # POST /generate received
    completed: int = 0  # 200 answers carrying a finished generation
    generations: int = 0  # generations the model finished, delivered or not (reset, truncate, gone client)
    tokens_generated: int = 0  # decode tokens spent, partial work of aborted requests included
    tokens_delivered: int = 0  # completion tokens in the `completed` answers
    aborted: int = 0  # 200 answers whose finish_reason is abort (abort_request, injected, shutdown)
    rejected: int = 0  # 400 answers (validation, context, duplicate rid)
    unhealthy: int = 0  # 503 answers because the server was set unhealthy
    queue_full: int = 0  # 503 "The request queue is full." from --max-queued-requests
    timed_out: int = 0  # 503 "Request running timeout reached." (--req-running-timeout)
    unauthorized: int = 0  # 401 for a missing or wrong API key
    disconnected: int = 0  # clients that left before their answer was ready
    in_flight: int = 0
    max_in_flight: int = 0
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))

    def enter(self) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def leave(self) -> None:
        self.in_flight -= 1

    def snapshot(self) -> dict[str, Any]:
        return asdict(self)
