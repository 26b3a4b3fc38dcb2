"""`genq status` and `genq monitor`: the state of a namespace, once or live."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import orjson
from rich.console import Console

from genq import terminal
from genq.commands import monitor as monitor_view
from genq.commands.run_redis import no_dataset_here, out_option, redis_of
from genq.commands.status import status
from genq.connection import connect
from genq.keys import Keys
from genq.settings import option, redis_options


@click.command("status")
@option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@out_option("status")
@redis_options
def status_command(as_json: bool, out: Path | None, redis_url: str, namespace: str) -> None:
    """Per dataset: total enqueued, queued, in flight, retrying, done, failed (they add up); tokens,
    tokens/s and ETA; the workers alive; the collector's lag. Unknown numbers say so (null)."""
    with redis_of(out, redis_url, namespace) as (url, auth, namespace):
        conn = connect(url, **auth)
        data = status(conn, Keys(namespace))  # a Redis error: one line (LazyGroup.invoke)
        empty = no_dataset_here(conn, namespace, url)
    if empty is not None:
        data["warnings"].append(empty)
    if as_json:
        click.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    console = terminal.console()
    console.print(f"genq namespace {namespace!r}")
    for part in (
        monitor_view.counts_table(data),
        monitor_view.ledger_table(data),
        monitor_view.check_table(data),
        monitor_view.tokens_table(data),
        monitor_view.workers_table(data),
        monitor_view.lag_line(data),
    ):
        if part is not None:
            console.print(part)
    for warning in data["warnings"]:
        console.print(f"[yellow]{warning}[/yellow]")
    odd = {n: c["unaccounted"] for n, c in data["datasets"].items() if c["unaccounted"]}
    if odd:
        console.print(f"[yellow]not adding up (jobs moving between states, or lost): {odd}[/yellow]")


@click.command("monitor")
@option("--interval", type=click.FloatRange(min=0.5), default=3.0, help="Seconds between frames.")
@option("--once", is_flag=True, help="Print one frame and exit (1 if Redis did not answer).")
@option(
    "--svg",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="With --once: also save the frame as an SVG picture.",
)
@option("--width", type=click.IntRange(min=40), default=None, help="Columns (default: the terminal's).")
@out_option("monitor")
@redis_options
def monitor_command(
    interval: float,
    once: bool,
    svg: Path | None,
    width: int | None,
    out: Path | None,
    redis_url: str,
    namespace: str,
) -> None:
    """Live view of the run: progress, tokens/s and ETA per dataset, workers, failures, collector lag.

    Fits 80 columns (ssh); Ctrl-C quits. When Redis does not answer it says so and keeps trying.
    """
    if svg is not None and not once:
        raise click.UsageError("--svg goes with --once")
    console = Console(width=width, record=svg is not None)
    with redis_of(out, redis_url, namespace) as (url, auth, namespace):
        monitor = monitor_view.Monitor(url, Keys(namespace), **auth)
        code = monitor_view.run(monitor, console, interval, once, svg)
    sys.exit(code)
