"""The `genq` command line: gathers each role's commands under one name."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

import click
import orjson
import redis
from rich.console import Console
from rich.table import Table

from genq import __version__, entries, failures, terminal
from genq.commands import monitor as monitor_view
from genq.commands.run_redis import no_dataset_here, out_option, redis_of, require_datasets
from genq.commands.status import status
from genq.connection import RedisURLError, connect
from genq.keys import Keys
from genq.redis_errors import NOT_NOW, fatal, not_now
from genq.settings import option, redis_options

# Each role's command, imported only when it runs (click's lazily loaded subcommands): a worker
# starts without loading the collector, the dataset readers or the simulator.
ROLES = {
    "enqueue": "producer.cli.enqueue_command",
    "worker": "worker.cli.worker_command",
    "collect": "collector.cli.collect_command",
    "export": "collector.export.export_command",
    "stats": "collector.stats.stats_command",
    "report": "collector.report.report_command",
    "dashboard": "genq.commands.dashboard.dashboard_command",
    "run": "genq.commands.run.run_command",
    "verify": "genq.commands.verify.verify_command",
    "sim-server": "sim.cli.sim_server",
    "slurm": "genq.commands.slurm.slurm_command",
}


class LazyGroup(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        """Every command's operational errors in one line with what to do, not a traceback: a
        Redis that cannot be reached or refuses (genq/redis_errors.py), a Redis URL it cannot
        dial. A Redis error that is a bug is one line too (``fatal``)."""
        try:
            return super().invoke(ctx)
        except RedisURLError as exc:
            raise click.ClickException(str(exc)) from exc
        except redis.RedisError as exc:
            reason = not_now(exc)
            if reason is None:
                raise click.ClickException(fatal(exc)) from exc
            if reason.startswith(NOT_NOW["WRONGTYPE"]):
                raise click.ClickException(f"{reason}; the roles wait for it to be put right") from exc
            raise click.ClickException(
                f"{reason.rstrip('.')}; is redis-server running where --redis (GENQ_REDIS_URL) points? "
                "`genq run` starts a private one"
            ) from exc

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *ROLES])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in ROLES:
            module, attr = ROLES[name].rsplit(".", 1)
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(
    cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.version_option(__version__, prog_name="genq")
def main() -> None:
    """genq: datasets of prompts in, synthetic training data out, nothing lost or duplicated."""


@main.command("status")
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
        monitor_view.tokens_table(data),
        monitor_view.workers_table(data),
        monitor_view.lag_line(data),
    ):
        console.print(part)
    for warning in data["warnings"]:
        console.print(f"[yellow]{warning}[/yellow]")
    odd = {n: c["unaccounted"] for n, c in data["datasets"].items() if c["unaccounted"]}
    if odd:
        console.print(f"[yellow]not adding up (jobs moving between states, or lost): {odd}[/yellow]")


@main.command("monitor")
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


@main.command("failed")
@option("--dataset", env="GENQ_FAILED_DATASET", default=None, help="Only this dataset.")
@option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@out_option("failed")
@redis_options
def failed_command(
    dataset: str | None, as_json: bool, out: Path | None, redis_url: str, namespace: str
) -> None:
    """Terminal failures, grouped by reason (error class and the server's message), and the
    stream entries quarantined because they were not a worker's result (the last 100 of each dataset)."""
    with redis_of(out, redis_url, namespace) as (url, auth, namespace):
        conn = connect(url, **auth)
        require_datasets(conn, namespace, url)
        keys = Keys(namespace)
        groups = failures.group(failures.failures(conn, keys, dataset))
        counts = entries.quarantined(conn, keys)
        letters = [
            letter
            for name in sorted(counts)
            if dataset in (None, name)
            for letter in entries.dead_letters(conn, keys, name)
        ]
    if as_json:
        data = [{"error": g.error, "message": g.message, "count": len(g.ids), "ids": g.ids} for g in groups]
        quarantined = [dataclasses.asdict(letter) for letter in letters]
        click.echo(
            orjson.dumps({"groups": data, "quarantined": quarantined}, option=orjson.OPT_INDENT_2).decode()
        )
        return
    if not groups and not letters:
        click.echo("no failed jobs")
        return
    if groups:
        table = Table(title=f"failed jobs in namespace {namespace!r}")
        for col in ("count", "error", "message", "e.g."):
            table.add_column(col, justify="right" if col == "count" else "left", overflow="fold")
        for g in groups:
            table.add_row(str(len(g.ids)), g.error, g.message, ", ".join(g.ids[:3]))
        terminal.console().print(table)
    if letters:
        total = sum(n for name, n in counts.items() if dataset in (None, name))
        table = Table(
            title=f"{total:,} stream entries quarantined: not a worker's result (last 100 per dataset)"
        )
        for col in ("dataset", "entry", "found at", "why"):
            table.add_column(col, overflow="fold")
        for letter in letters:
            table.add_row(letter.dataset, letter.entry, letter.found_at, letter.reason)
        terminal.console().print(table)


@main.command("retry")
@option(
    "--reason",
    env="GENQ_RETRY_REASON",
    default=None,
    help="Only failures whose error class or message contains TEXT.",
)
@option("--all", "retry_all", env="GENQ_RETRY_ALL", is_flag=True, help="Every failure.")
@option("--dataset", env="GENQ_RETRY_DATASET", default=None, help="Only this dataset.")
@out_option("retry")
@redis_options
def retry_command(
    reason: str | None,
    retry_all: bool,
    dataset: str | None,
    out: Path | None,
    redis_url: str,
    namespace: str,
) -> None:
    """Put terminal failures back on their queues, each with a fresh attempt budget.

    Idempotent: a failure is retried once; run it again and it finds nothing new.
    """
    if not reason and not retry_all:
        raise click.UsageError("say which: --reason TEXT or --all")
    with redis_of(out, redis_url, namespace) as (url, auth, namespace):
        conn = connect(url, **auth)
        require_datasets(conn, namespace, url)
        keys = Keys(namespace)
        chosen = [
            f
            for f in failures.failures(conn, keys, dataset)
            if retry_all or reason.lower() in f"{f.error} {f.message}".lower()
        ]
        retried, waiting = failures.retry(conn, keys, chosen)
    click.echo(
        f"retried {retried}" + (f"; {waiting} not in errors.jsonl yet, left for now" if waiting else "")
    )
