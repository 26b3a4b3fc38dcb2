"""When to send again after a failed attempt (decision 7)."""

from __future__ import annotations

import random


def backoff(failures: int, base: float, cap: float, retry_after: float | None = None) -> float:
    """Exponential backoff with full jitter; never sooner than the server's Retry-After."""
    delay = random.uniform(0, min(cap, base * 2 ** max(0, failures - 1)))
    return max(delay, retry_after or 0.0)
