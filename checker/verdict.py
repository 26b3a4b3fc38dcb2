"""What a checker says of one record, whatever shape the user's function answers in.

A checker's answer is untrusted in its shape (user code, another language's process): it is read
here once, into a :class:`Verdict`, and a shape that is none of those below is the checker's own
failure (:class:`CheckerError`), retried like a crash and never taken as a rejection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

REASON_MAX = 500  # characters of a reason kept with the record


class CheckerError(Exception):
    """The checker failed on a record (raised, crashed, hung, or answered nonsense): not a verdict."""


@dataclass(frozen=True)
class Verdict:
    """Accept or reject, with a score (None: the checker gave none) and a reason."""

    accepted: bool
    score: float | None = None
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "score": self.score, "reason": self.reason}


def verdict_of(answer: Any) -> Verdict:
    """The verdict in a checker's answer: a :class:`Verdict`; a bool (accepted or not); a number
    (a reward, verl-style: accepted when above 0); or a mapping with ``accepted`` (a bool) or
    ``score`` (a number; accepted when above 0 unless ``accepted`` says), and an optional
    ``reason``."""
    if isinstance(answer, Verdict):
        return answer
    if isinstance(answer, bool):
        return Verdict(answer)
    if isinstance(answer, int | float):
        score = _score(answer)
        return Verdict(score > 0, score)
    if isinstance(answer, dict):
        score = _score(answer["score"]) if answer.get("score") is not None else None
        accepted = answer.get("accepted")
        if accepted is None and score is None:
            raise CheckerError("the checker's answer has neither 'accepted' nor 'score'")
        if accepted is not None and not isinstance(accepted, bool):
            raise CheckerError(f"the checker's 'accepted' is {type(accepted).__name__}, not true or false")
        reason = answer.get("reason", "")
        if not isinstance(reason, str):
            raise CheckerError(f"the checker's 'reason' is {type(reason).__name__}, not a string")
        return Verdict(accepted if accepted is not None else score > 0, score, reason[:REASON_MAX])  # type: ignore[operator]
    raise CheckerError(
        f"the checker answered a {type(answer).__name__}, not a verdict, a bool, a number or a mapping"
    )


def _score(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CheckerError(f"the checker's score is {value!r}, not a finite number")
    return float(value)
