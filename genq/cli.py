"""The `genq` command line: gathers each role's commands under one name."""

from __future__ import annotations

import click
import orjson
from rich.console import Console
from rich.table import Table

from collector.cli import collect_command
from genq import __version__
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


main.add_command(enqueue_command)
main.add_command(worker_command)
main.add_command(collect_command)
main.add_command(run_command)
main.add_command(sim_server, "sim-server")
