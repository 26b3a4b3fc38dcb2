"""How numbers are shown: the console every command prints tables with (rich's, never cutting a
number), and durations as people say them.

Piped into a file or `less`, rich assumes 80 columns and shortens what does not fit (`avg 2,3…`).
Tables only grow as wide as their content, so off a terminal the console is given room enough for
any of them; on a terminal it keeps the terminal's width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

PIPED_WIDTH = 1000  # columns when stdout is not a terminal


def console(**kwargs: Any) -> Console:
    from rich.console import Console  # here: a worker, which prints no table, never pays rich's import

    found = Console(**kwargs)
    if not found.is_terminal and "width" not in kwargs:
        return Console(width=PIPED_WIDTH, **kwargs)
    return found


def duration(seconds: float) -> str:
    """A duration as people say it: 45 s, 2 min 30 s, 3 h 20 min."""
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"
