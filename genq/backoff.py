"""The delays between retries, one way everywhere: each twice the last, up to a cap.

Every loop that rides out an outage (Redis, the inference server) waits these: short at first, so
a blip costs little, never past the cap, so a long outage is noticed soon after it ends.
"""

from __future__ import annotations

from collections.abc import Iterator


def doubling(start: float, cap: float) -> Iterator[float]:
    """``start``, twice that, and so on, never more than ``cap``: endless."""
    delay = start
    while True:
        yield delay
        delay = min(delay * 2, cap)
