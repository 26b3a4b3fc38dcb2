"""The `genq` command line: gathers each role's commands under one name."""

from __future__ import annotations

import click
import orjson
from rich.console import Console
from rich.table import Table

from collector.cli import collect_command
from genq import __version__, failures
from genq.keys import Keys
from genq.run import run_command
from genq.settings import connect, option, redis_options
from genq.status import STATES, status
from producer.cli import enqueue_command
from sim.cli import sim_server
from worker.cli import worker_command


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="genq")
def main() -> None:
    """genq: datasets of prompts in, synthetic training data out, nothing lost or duplicated."""


@main.command("status")
@option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@redis_options
def status_command(as_json: bool, redis_url: str, namespace: str) -> None:
    """Per dataset: total enqueued, queued, in flight, retrying, done, failed (they add up)."""
    data = status(connect(redis_url), Keys(namespace))
    if as_json:
        click.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    table = Table(title=f"genq namespace {namespace!r}")
    for col in ("dataset", "total", *STATES):
        table.add_column(col, justify="left" if col == "dataset" else "right")
    for name, counts in data["datasets"].items():
        table.add_row(name, *(str(counts[c]) for c in ("total", *STATES)))
    console = Console()
    console.print(table)
    console.print(f"result stream: {data['stream']['length']} entries waiting for the collector")
    odd = {n: c["unaccounted"] for n, c in data["datasets"].items() if c["unaccounted"]}
    if odd:
        console.print(f"[yellow]not adding up (jobs moving between states, or lost): {odd}[/yellow]")


@main.command("failed")
@option("--dataset", default=None, help="Only this dataset.")
@option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@redis_options
def failed_command(dataset: str | None, as_json: bool, redis_url: str, namespace: str) -> None:
    """Terminal failures, grouped by reason (error class and the server's message)."""
    groups = failures.group(failures.failures(connect(redis_url), Keys(namespace), dataset))
    if as_json:
        data = [{"error": g.error, "message": g.message, "count": len(g.ids), "ids": g.ids} for g in groups]
        click.echo(orjson.dumps({"groups": data}, option=orjson.OPT_INDENT_2).decode())
        return
    if not groups:
        click.echo("no failed jobs")
        return
    table = Table(title=f"failed jobs in namespace {namespace!r}")
    for col in ("count", "error", "message", "e.g."):
        table.add_column(col, justify="right" if col == "count" else "left", overflow="fold")
    for g in groups:
        table.add_row(str(len(g.ids)), g.error, g.message, ", ".join(g.ids[:3]))
    Console().print(table)


@main.command("retry")
@option("--reason", default=None, help="Only failures whose error class or message contains TEXT.")
@option("--all", "retry_all", is_flag=True, help="Every failure.")
@option("--dataset", default=None, help="Only this dataset.")
@redis_options
def retry_command(
    reason: str | None, retry_all: bool, dataset: str | None, redis_url: str, namespace: str
) -> None:
    """Put terminal failures back on their queues, each with a fresh attempt budget.

    Idempotent: a failure is retried once; run it again and it finds nothing new.
    """
    if not reason and not retry_all:
        raise click.UsageError("say which: --reason TEXT or --all")
    conn, keys = connect(redis_url), Keys(namespace)
    chosen = [
        f
        for f in failures.failures(conn, keys, dataset)
        if retry_all or reason.lower() in f"{f.error} {f.message}".lower()
    ]
    retried, waiting = failures.retry(conn, keys, chosen)
    click.echo(
        f"retried {retried}" + (f"; {waiting} not in errors.jsonl yet, left for now" if waiting else "")
    )


main.add_command(enqueue_command)
main.add_command(worker_command)
main.add_command(collect_command)
main.add_command(run_command)
main.add_command(sim_server, "sim-server")
