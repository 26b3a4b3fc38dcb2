"""The worker's settings (WorkerConfig): what worker/cli.py reads from the command line and the
environment, in one object the Worker, its server gate and its attempts all read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import click

from genq.settings import DEFAULT_HEARTBEAT_TTL_S

AUTO = "auto"


@dataclass
class WorkerConfig:
    server: str
    backend: str = "auto"  # an engine API of genq/backends, or auto: ask the server
    model: str | None = None  # the model to ask for, where the server serves several
    # --concurrency N: N jobs in flight, fixed; None (auto, the default): worker/concurrency.py
    # steers it by the server's load, up to max_concurrency.
    concurrency: int | None = None
    max_concurrency: int = 1024
    max_attempts: int = 5
    # Sends the server failed while it served no other job, spared per job (decision 7's bound).
    max_spared: int = 20
    # Server crashes a job may be in flight at before it is the suspect and fails (worker/probation.py).
    max_crashes: int = 3
    request_timeout: float | None = None  # overrides the deadline derived from max_new_tokens
    grace: float = 60.0
    burst: bool = False
    heartbeat_ttl: int = DEFAULT_HEARTBEAT_TTL_S
    stream_limit: int = 10_000
    backoff_base: float = 1.0
    backoff_cap: float = 60.0
    # A connection that fails this many times in a row closes the gate until /health answers.
    down_after: int = 3
    # This host consents to run a tokenizer's own code (Kimi-K2's tokenization_kimi.py) when it
    # renders a conversation's turns; never taken from Redis (genq/templates.py).
    trust_remote_code: bool = False

    @property
    def auto(self) -> bool:
        """--concurrency auto: the target moves with the server's load."""
        return self.concurrency is None

    @property
    def ceiling(self) -> int:
        """The most jobs ever in flight: the connection pool's size."""
        return self.max_concurrency if self.concurrency is None else self.concurrency

    @staticmethod
    def prefetch(target: int) -> int:
        """Jobs taken ahead of a free slot (started in RQ, waiting here) at least, for an in-flight
        ``target``: takes come in batches of about half this, and a job starts the moment a slot
        frees. More while jobs end faster than a take comes back (Worker._prefetch)."""
        return max(1, target // 4)

    def attempt_timeout(self, max_new_tokens: int) -> float:
        """Decision 8: long generations get long deadlines (8 tok/s floor per sequence + 120 s)."""
        if self.request_timeout is not None:
            return self.request_timeout
        return 120.0 + max_new_tokens / 8.0


class ConcurrencyParam(click.ParamType):
    """``--concurrency``: a number of jobs in flight, or ``auto``."""

    name = "N|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | str:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif str(value).strip().lower() == AUTO:
            return AUTO
        else:
            try:
                number = int(str(value))
            except ValueError:
                self.fail(f"{value!r} is neither a number nor 'auto'", param, ctx)
        if number < 1:
            self.fail(f"{number} is below 1", param, ctx)
        return number
