"""`genq monitor`: a live terminal view of a run, and the tables `genq status` prints.

Everything shown comes from :func:`genq.commands.status.status`, so the monitor, `status --json` and the
files agree. Built for ssh: 80 columns, no mouse, redraws in place every few seconds, Ctrl-C
quits with status 0. When Redis does not answer it says so, and keeps trying, instead of
drawing zeros.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import redis
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from genq import failures
from genq.commands.status import probation_warning, status
from genq.connection import connect, redact
from genq.keys import Keys
from genq.progress import STATES
from genq.redis_errors import not_now

UNKNOWN = "unknown"
FAILURES_EVERY_S = 30.0  # grouping failures fetches every failed job: not on every frame
MAX_WORKER_ROWS = 12


# -- numbers ------------------------------------------------------------------------------------


def count(n: int | None) -> str:
    return f"{n:,}" if n is not None else UNKNOWN


def rate(x: float | None) -> str:
    """Tokens per second, short: 950, 12.3k, 1.2M."""
    if x is None:
        return UNKNOWN
    for div, unit in ((1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def duration(s: float | None) -> str:
    if s is None:
        return UNKNOWN
    if s == 0:
        return "done"
    if s < 1:
        return "<1s"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _table(title: str | None, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", box=None, pad_edge=False, header_style="bold")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
    return table


# -- tables shared with `genq status` ---------------------------------------------------------


def counts_table(data: dict[str, Any]) -> Table:
    table = _table("jobs", "dataset", "total", *(s.replace("_", " ") for s in STATES))
    table.columns[0].overflow = "ellipsis"
    table.columns[0].max_width = 20
    for name, c in data["datasets"].items():
        shown = f"{name} ← {c['from']}" if c.get("from") else name  # a stage: the dataset it follows
        table.add_row(shown, *(count(c[k]) for k in ("total", *STATES)))
    return table


LEDGER = ("stopped", "continued", "cut", "failed", "rejected", "pending")


def ledger_table(data: dict[str, Any]) -> Table:
    """Where every row read went (genq/commands/status.py ``ledger``): the columns sum to ``read``."""
    table = _table("ledger (rows x samples)", "dataset", "read", *LEDGER)
    table.columns[0].overflow = "ellipsis"
    table.columns[0].max_width = 14
    for name, c in data["datasets"].items():
        book = c.get("ledger")
        if book is None:
            table.add_row(name, count(c["total"] + c["rejected"]), *(UNKNOWN for _ in LEDGER))
        else:
            table.add_row(name, count(book["read"]), *(count(book[k]) for k in LEDGER))
    return table


def check_table(data: dict[str, Any]) -> Table | None:
    """The check stage of the checked datasets (genq check): what it filed, the share accepted,
    samples judged per accepted one, the checker's seconds per sample and its failures."""
    checked = {name: c["check"] for name, c in data["datasets"].items() if c.get("check") is not None}
    if not checked:
        return None
    table = _table(
        "check", "dataset", "accepted", "rejected", "failed", "share", "per acc.", "s/sample", "errors"
    )
    table.columns[0].overflow = "ellipsis"
    table.columns[0].max_width = 14
    for name, c in checked.items():
        table.add_row(
            name,
            count(c["accepted"]),
            count(c["rejected"] + c["surplus"]),
            count(c["check_failed"]),
            f"{c['acceptance']:.0%}" if c["acceptance"] is not None else UNKNOWN,
            f"{c['samples_per_accepted']:.1f}" if c["samples_per_accepted"] is not None else UNKNOWN,
            f"{c['checker_s']:.2f}" if c["checker_s"] is not None else UNKNOWN,
            count(c["checker_errors"]),
        )
    return table


def tokens_table(data: dict[str, Any]) -> Table:
    columns = ("prompt", "completion", "avg", "capped", "tok/s 5m", "tok/s all", "ETA")
    table = _table("tokens", "dataset", *columns)
    table.columns[0].overflow = "ellipsis"
    table.columns[0].max_width = 14
    for name, c in data["datasets"].items():
        avg = c["avg_completion_tokens"]
        table.add_row(
            name,
            count(c["prompt_tokens"]),
            count(c["completion_tokens"]),
            f"{avg:,.0f}" if avg is not None else UNKNOWN,
            count(c["capped"]),
            rate(c["tokens_per_s"]),
            rate(c["tokens_per_s_since_start"]),
            duration(c["eta_s"]),
        )
    return table


def _lost(n: int) -> str:
    """Workers whose heartbeat stopped (killed) while RQ still keeps their hash."""
    return f", {n} lost: no heartbeat within their TTL" if n else ""


def workers_table(data: dict[str, Any]) -> RenderableType:
    workers = data["workers"]
    alive = sum(1 for w in workers if w.get("alive", True))
    if not alive:
        return Text(f"workers: none alive{_lost(len(workers))}", style="yellow")
    table = _table(
        f"workers ({alive} alive{_lost(len(workers) - alive)})",
        "worker",
        "server",
        "flight",
        "retry",
        "done",
        "failed",
        "beat",
    )
    table.columns[0].overflow = table.columns[1].overflow = "ellipsis"
    table.columns[0].max_width = 18
    table.columns[1].max_width = 22
    for w in workers[:MAX_WORKER_ROWS]:
        age = w["heartbeat_age_s"]
        table.add_row(
            f"slurm {w['slurm_job']}" if w["slurm_job"] else f"{w['host']}:{w['pid']}",
            (w["server"] or "?").split("://")[-1],
            count(w["in_flight"]) + (f"/{w['target']}" if w.get("target") is not None else ""),
            count(w["retrying"]),
            count(w["done"]),
            count(w["failed"]),
            Text("lost " + duration(age), style="red")
            if not w.get("alive", True)
            else Text(duration(age) if age else "now", style="yellow" if age and age > 60 else ""),
        )
    if len(workers) > MAX_WORKER_ROWS:
        table.add_row(f"... {len(workers) - MAX_WORKER_ROWS} more", "", "", "", "", "", "")
    if any((w["in_flight"] or 0) > w["target"] for w in workers if w.get("target") is not None):
        table.caption = (
            "flight over its target (e.g. 48/32): the worker lowered its target as the server's load asked "
            "(--concurrency auto) and lets the jobs already in flight finish"
        )
    return table


def lag_line(data: dict[str, Any]) -> Text:
    stream = data["stream"]
    holders = stream.get("collectors") or {}
    orphans = sorted(name for name, holder in holders.items() if holder is None)
    if stream["collector"] is not None:
        who = Text(f"collector {stream['collector']}")
    elif not orphans or len(orphans) < len(holders):
        count = len({h for h in holders.values() if h})
        who = Text(f"{count} collectors" + (f", none for {', '.join(orphans)}" if orphans else ""))
        who.stylize("bold red" if orphans else "")
    else:
        who = Text("no collector running", style="bold red")
    oldest = stream["oldest_pending_s"]
    return Text.assemble(
        who,
        f" · stream {stream['length']:,} waiting",
        (f", oldest {oldest:.1f} s" if stream["length"] else ""),
        style="yellow" if oldest > 60 else "",
    )


# -- the monitor's own frame ----------------------------------------------------------------


def progress_table(data: dict[str, Any]) -> Table:
    table = _table(None, "dataset", "progress", "", "done/total", "failed", "tok/s", "ETA")
    table.columns[0].overflow = "ellipsis"
    table.columns[0].max_width = 16
    table.columns[1].width = 12
    table.columns[1].justify = "left"
    rows = [(Text(name), c) for name, c in data["datasets"].items()]
    if len(rows) > 1:
        rows.append((Text("(all)", style="bold"), data["totals"]))
    for name, c in rows:
        finished = c["done"] + c["failed"]
        table.add_row(
            name,
            ProgressBar(
                total=max(c["total"], 1),
                completed=finished,
                width=12,
                style="grey42",
                complete_style="green",
                finished_style="bright_green",
            ),
            f"{100 * finished // max(c['total'], 1)}%",
            f"{count(finished)}/{count(c['total'])}",
            Text(count(c["failed"]), style="red" if c["failed"] else ""),
            rate(c["tokens_per_s"]),
            duration(c["eta_s"]),
        )
    return table


def failures_table(groups: list[failures.Group]) -> RenderableType:
    if not groups:
        return Text("failures: none")
    table = _table("failures by reason", "count", "error", "message")
    table.columns[0].justify = "right"
    table.columns[1].justify = table.columns[2].justify = "left"
    table.columns[2].overflow = "ellipsis"
    table.columns[2].max_width = 52
    for g in groups[:5]:
        table.add_row(count(len(g.ids)), g.error, g.message.replace("\n", " "))
    return table


def frame(data: dict[str, Any], groups: list[failures.Group], url: str, at: float) -> RenderableType:
    header = Text.assemble(
        ("genq monitor", "bold"),
        f" · namespace {data['namespace']} · {redact(url)} · ",
        time.strftime("%H:%M:%S", time.localtime(at)),
    )
    if not data["datasets"]:
        return Group(header, Text("no datasets enqueued in this namespace yet"))
    return Group(
        header,
        Text(""),
        progress_table(data),
        Text(""),
        ledger_table(data),
        Text(""),
        *([checks, Text("")] if (checks := check_table(data)) is not None else []),
        workers_table(data),
        Text(""),
        failures_table(groups),
        *quarantined_line(data),
        *[
            Text(w, style="yellow")
            for w in filter(None, [probation_warning(data.get("suspects", 0), data.get("probation_s"))])
        ],
        Text(""),
        lag_line(data),
    )


def quarantined_line(data: dict[str, Any]) -> list[RenderableType]:
    """Stream entries that were not a worker's result, moved to their dead letters (genq/entries.py)."""
    n = sum(data.get("quarantined", {}).values())
    if not n:
        return []
    return [
        Text(
            f"quarantined stream entries: {count(n)} (not a worker's result; `genq failed` lists them)",
            style="red",
        )
    ]


def unreachable(url: str, exc: Exception, at: float, reason: str | None = None) -> RenderableType:
    """The frame while Redis does not answer, or (``reason``) refuses for now."""
    return Panel(
        Text.assemble(
            (f"Redis unreachable at {redact(url)}: {exc}" if reason is None else reason, "bold red"),
            f"\nretrying… (last try {time.strftime('%H:%M:%S', time.localtime(at))})",
        ),
        title="genq monitor",
        title_align="left",
    )


class Monitor:
    """Fetches a frame's data; keeps the slow failure grouping for FAILURES_EVERY_S."""

    def __init__(self, redis_url: str, keys: Keys, **auth: str | None):
        self.url = redis_url
        self.keys = keys
        # Short timeouts: a frame must say "unreachable" within seconds, not hang on a socket.
        self.conn = connect(redis_url, socket_connect_timeout=3, socket_timeout=5, **auth)
        self._groups: list[failures.Group] = []
        self._groups_at = float("-inf")

    def render(self) -> tuple[RenderableType, bool]:
        """The frame, and whether Redis answered."""
        at = time.time()
        try:
            data = status(self.conn, self.keys)
            if time.monotonic() - self._groups_at > FAILURES_EVERY_S:
                self._groups = failures.group(failures.failures(self.conn, self.keys))
                self._groups_at = time.monotonic()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            return unreachable(self.url, exc, at), False
        except redis.ResponseError as exc:  # MISCONF refuses the health check's PING, and reads
            reason = not_now(exc)
            if reason is None:
                raise
            return unreachable(self.url, exc, at, f"{reason} ({redact(self.url)})"), False
        return frame(data, self._groups, self.url, at), True


def run(monitor: Monitor, console: Console, interval: float, once: bool, svg: Path | None = None) -> int:
    """Draw until Ctrl-C (exit 0); with ``once``, one frame (exit 1 if Redis did not answer)."""
    if once:
        view, ok = monitor.render()
        console.print(view)
        if svg is not None:
            console.save_svg(str(svg), title="genq monitor")
        return 0 if ok else 1
    try:
        if not console.is_terminal:  # a log or a pipe: a frame after another, as --once prints it
            while True:
                console.print(monitor.render()[0])
                time.sleep(interval)
        with Live(monitor.render()[0], console=console, auto_refresh=False, transient=False) as live:
            while True:
                time.sleep(interval)
                live.update(monitor.render()[0], refresh=True)
    except KeyboardInterrupt:
        return 0
