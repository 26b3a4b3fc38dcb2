"""`genq enqueue` (also installed as `enqueue`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from genq import datasets
from genq.keys import Keys, validate_name
from genq.sampling import Sampling, sampling_options
from genq.settings import connect, option, redis_options
from producer.context import context_length_of
from producer.enqueue import Summary, enqueue_files


def dataset_name(dataset: str | None, files: tuple[Path, ...]) -> str:
    name = dataset or files[0].stem
    try:
        return validate_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--dataset") from exc


@click.command("enqueue")
@click.argument(
    "files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@option("--dataset", default=None, help="Dataset name (default: the first file's stem).")
@sampling_options
@option("--replace-settings", is_flag=True, help="Allow other sampling settings for an existing dataset.")
@option(
    "--context-length",
    type=click.IntRange(min=2),
    default=None,
    help="Reject prompts that cannot fit with --max-new-tokens (default: ask --server, if given).",
)
@option("--server", default=None, help="SGLang server to ask for its context length (/server_info).")
@redis_options
def enqueue_command(
    files, dataset, sampling: Sampling, replace_settings, context_length, server, redis_url, namespace
):
    """Enqueue one job per prompt of FILES (JSONL rows with `input_ids` or `prompt`).

    Idempotent: rows already queued, in flight or on disk are skipped, so the same command can
    be run again safely. Rows are numbered across FILES in order: give the same files first.
    """
    name = dataset_name(dataset, files)
    if context_length is None and server:
        try:
            context_length = context_length_of(server)
        except (OSError, ValueError) as exc:
            raise click.ClickException(f"could not read the context length from {server}: {exc}") from exc
    conn = connect(redis_url)
    try:
        summary = enqueue_files(
            conn,
            Keys(namespace),
            list(files),
            name,
            sampling.params(),
            sampling.samples,
            replace_settings,
            context_length,
        )
    except datasets.SettingsMismatch as exc:
        raise click.ClickException(str(exc)) from exc
    print_summary(name, summary)


def print_summary(name: str, summary: Summary) -> None:
    for rejected in summary.rejected:
        click.echo(f"rejected {rejected}", err=True)
    counts = summary.as_dict()
    click.echo(f"{name}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


def enqueue_main() -> None:
    """Entry point of the `enqueue` script."""
    sys.exit(enqueue_command.main(prog_name="enqueue"))
