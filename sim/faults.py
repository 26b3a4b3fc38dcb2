"""Fault injection: which failure, if any, a request meets.

Clients of a real server see 5xx answers, resets, hangs, HTTP-200 aborts, NaN finishes and
cut-off bodies (429 is opt-in only: SGLang never sends it);
the simulator produces each at a configured rate so retry paths get exercised. One seeded RNG
draw per request keeps a run reproducible for a given request order.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

FAULT_KINDS = (
    "error_500",
    "error_503",
    "error_429",
    "reset",
    "hang",
    "abort",
    "truncate",
    "nan",
    "duplicate",
    "wild_logprobs",
    "no_text",
)


@dataclass
class FaultRates:
    """Probability (0..1) of each fault per /generate request; at most one applies."""

    error_500: float = 0.0
    error_503: float = 0.0
    error_429: float = 0.0
    reset: float = 0.0
    hang: float = 0.0
    abort: float = 0.0
    truncate: float = 0.0
    nan: float = 0.0  # 200 with finish_reason stop, matched "NaN happened" (the sampler hit NaN)
    duplicate: float = 0.0  # 400 "Duplicate request ID detected" (a rid reused while still held)
    wild_logprobs: float = 0.0  # 200 whose logprobs hold a null, a -1e6 and a 1e6 (model.wild)
    # SGLang: 200 without text from a server whose /server_info says it runs its tokenizer (one
    # restarted with --skip-tokenizer-init behind a client's back, a proxy that strips it).
    no_text: float = 0.0

    def __post_init__(self) -> None:
        for kind in FAULT_KINDS:
            rate = getattr(self, kind)
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
                raise ValueError(f"fault rate {kind} must be a number in [0, 1], got {rate!r}")
            setattr(self, kind, float(rate))
        if sum(self.as_dict().values()) > 1.0 + 1e-9:
            raise ValueError("fault rates must add up to at most 1 (at most one fault per request)")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], base: FaultRates | None = None) -> FaultRates:
        """Build from JSON-like data; keys left out keep their value in base (or 0)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown fault kind(s): {', '.join(unknown)}; known: {', '.join(FAULT_KINDS)}")
        merged = {**(base.as_dict() if base else {}), **data}
        return cls(**merged)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class FaultInjector:
    """Draws the fault for each request from a seeded RNG."""

    def __init__(self, rates: FaultRates | None = None, seed: int | None = 0) -> None:
        self.rates = rates or FaultRates()
        self._rng = random.Random(seed)

    def pick(self) -> str | None:
        """Return one of FAULT_KINDS or None; always one draw, so the sequence stays reproducible."""
        draw = self._rng.random()
        cumulative = 0.0
        for kind in FAULT_KINDS:
            cumulative += getattr(self.rates, kind)
            if draw < cumulative:
                return kind
        return None
