"""How a failed /generate attempt is classified (decision 7): retry it, or fail the job at once."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class AttemptError(Exception):
    """One attempt that did not produce a record.

    ``kind`` is the error class written to ``errors.jsonl``; ``message`` is the server's own
    words where it gave any.
    """

    kind: str
    message: str
    status: int | None = None
    retryable: bool = True
    retry_after: float | None = None
    # The server could not take the request (connection refused, 503): it costs no attempt,
    # and enough of these in a row mean the server is down.
    unavailable: bool = False

    def __str__(self) -> str:
        status = f" {self.status}" if self.status is not None else ""
        return f"{self.kind}{status}: {self.message}"


# Statuses that mean this request itself is wrong: retrying cannot help.
TERMINAL_STATUSES = {400, 413, 422}


def from_status(status: int, message: str, retry_after: float | None) -> AttemptError:
    if status in TERMINAL_STATUSES:
        return AttemptError("bad_request", message, status, retryable=False)
    if status == 429:
        return AttemptError("rate_limited", message, status, retry_after=retry_after)
    if status == 503:
        return AttemptError("unavailable", message, status, retry_after=retry_after, unavailable=True)
    if status >= 500:
        return AttemptError("server_error", message, status, retry_after=retry_after)
    return AttemptError("http_error", message, status, retry_after=retry_after)


def backoff(failures: int, base: float, cap: float, retry_after: float | None = None) -> float:
    """Exponential backoff with full jitter; never sooner than the server's Retry-After."""
    delay = random.uniform(0, min(cap, base * 2 ** max(0, failures - 1)))
    return max(delay, retry_after or 0.0)
