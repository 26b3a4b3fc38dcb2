"""`genq failed` and `genq retry`: the terminal failures of a namespace, grouped, and put back."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
import orjson
from rich.table import Table

from genq import datasets, entries, failures, rejudge, terminal
from genq.commands.run_redis import out_option, redis_of, require_datasets
from genq.connection import connect
from genq.keys import Keys
from genq.producer import extend
from genq.schema import RAW
from genq.settings import option, redis_options


@click.command("failed")
@option("--dataset", env="GENQ_FAILED_DATASET", default=None, help="Only this dataset.")
@option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@out_option("failed")
@redis_options
def failed_command(
    dataset: str | None, as_json: bool, out: Path | None, redis_url: str, namespace: str
) -> None:
    """Terminal failures, grouped by reason (error class and the server's message), the records the
    checker failed on (check_failed: `genq retry --check-failed` has them judged again), and the
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
        checked = [n for n, s in sorted(datasets.load_all(conn, keys).items()) if s.checked]
        unjudged = {name: rejudge.listed(conn, keys, name) for name in checked if dataset in (None, name)}
        unjudged = {name: found for name, found in unjudged.items() if found[0]}
    if as_json:
        data = [{"error": g.error, "message": g.message, "count": len(g.ids), "ids": g.ids} for g in groups]
        quarantined = [dataclasses.asdict(letter) for letter in letters]
        check_failed = {
            name: {"count": total, "last": [dataclasses.asdict(c) for c in shown]}
            for name, (total, shown) in unjudged.items()
        }
        click.echo(
            orjson.dumps(
                {"groups": data, "check_failed": check_failed, "quarantined": quarantined},
                option=orjson.OPT_INDENT_2,
            ).decode()
        )
        return
    if not groups and not letters and not unjudged:
        click.echo("no failed jobs")
        return
    if groups:
        table = Table(title=f"failed jobs in namespace {namespace!r}")
        for col in ("count", "error", "message", "e.g."):
            table.add_column(col, justify="right" if col == "count" else "left", overflow="fold")
        for g in groups:
            table.add_row(str(len(g.ids)), g.error, g.message, ", ".join(g.ids[:3]))
        terminal.console().print(table)
    for name, (total, shown) in unjudged.items():
        table = Table(
            title=f"{name}: {total:,} records the checker failed on (check_failed; the last {len(shown)}): "
            "fix the checker, then genq retry --check-failed"
        )
        for col in ("id", "checker", "why"):
            table.add_column(col, overflow="fold")
        for c in shown:
            table.add_row(c.id, c.checker or "?", c.reason)
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


@click.command("retry")
@option(
    "--reason",
    env="GENQ_RETRY_REASON",
    default=None,
    help="Only failures whose error class or message contains TEXT.",
)
@option("--all", "retry_all", env="GENQ_RETRY_ALL", is_flag=True, help="Every failure.")
@option(
    "--truncated",
    env="GENQ_RETRY_TRUNCATED",
    is_flag=True,
    help="Not failures: re-open the records that ended on length and continue them from their stored "
    "output up to --continue-to (a longer record supersedes each).",
)
@option(
    "--continue-to",
    env="GENQ_RETRY_CONTINUE_TO",
    type=click.IntRange(min=2),
    default=None,
    help="With --truncated: the output length to continue each record to, a piece of its "
    "max_new_tokens at a time.",
)
@option(
    "--records",
    env="GENQ_RETRY_RECORDS",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="With --truncated: the collector's output folder (default: --out).",
)
@option(
    "--check-failed",
    env="GENQ_RETRY_CHECK_FAILED",
    is_flag=True,
    help="Not failures: have the records the checker failed on judged again (by the checker as it is "
    "now), nothing generated again.",
)
@option("--dataset", env="GENQ_RETRY_DATASET", default=None, help="Only this dataset.")
@out_option("retry")
@redis_options
def retry_command(
    reason: str | None,
    retry_all: bool,
    truncated: bool,
    check_failed: bool,
    continue_to: int | None,
    records: Path | None,
    dataset: str | None,
    out: Path | None,
    redis_url: str,
    namespace: str,
) -> None:
    """Put terminal failures back on their queues, each with a fresh attempt budget; or, with
    --truncated, continue the records cut at max_new_tokens.

    Idempotent: a failure is retried once, a record re-opened once; run it again and it finds
    nothing new.
    """
    if sum((truncated, check_failed, bool(reason or retry_all))) > 1:
        raise click.UsageError("one at a time: --reason/--all, --truncated or --check-failed")
    if truncated:
        _retry_truncated(continue_to, records or out, dataset, out, redis_url, namespace)
        return
    if check_failed:
        _retry_check_failed(dataset, out, redis_url, namespace)
        return
    if continue_to is not None or records is not None:
        raise click.UsageError("--continue-to and --records go with --truncated")
    if not reason and not retry_all:
        raise click.UsageError("say which: --reason TEXT, --all, --truncated or --check-failed")
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


def _retry_check_failed(dataset: str | None, out: Path | None, redis_url: str, namespace: str) -> None:
    """Each checked dataset's check_failed records sent to be judged again (genq/rejudge.py)."""
    with redis_of(out, redis_url, namespace) as (url, auth, namespace):
        conn = connect(url, **auth)
        require_datasets(conn, namespace, url)
        keys = Keys(namespace)
        known = datasets.load_all(conn, keys)
        if dataset is not None and dataset not in known:
            raise click.ClickException(f"no dataset {dataset!r} in namespace {namespace!r}")
        names = [n for n in ([dataset] if dataset else sorted(known)) if known[n].checked]
        if not names:
            raise click.ClickException(
                f"{dataset or 'no dataset'}: not a checked dataset (enqueue --checked or --accept K)"
            )
        for name in names:
            sent, waiting, bad = rejudge.send_again(conn, keys, name, known[name].samples)
            line = f"{name}: {sent} records the checker failed on sent to be judged again"
            if waiting:
                line += f"; {waiting} not on disk yet, left for the next retry"
            if bad:
                line += f"; {bad} entries genq did not write, left (genq failed lists them)"
            click.echo(line + (" (a genq check judges them)" if sent else ""))


def _retry_truncated(
    continue_to: int | None,
    folder: Path | None,
    dataset: str | None,
    out: Path | None,
    redis_url: str,
    namespace: str,
) -> None:
    """Re-open the truncated records of each dataset (producer/extend.py), one summary line each."""
    if continue_to is None:
        raise click.UsageError("--truncated needs --continue-to N: the length to continue the records to")
    if folder is None:
        raise click.UsageError("--truncated reads the records: give --out (a `genq run` folder) or --records")
    with redis_of(out, redis_url, namespace) as (url, auth, namespace):
        conn = connect(url, **auth)
        require_datasets(conn, namespace, url)
        keys = Keys(namespace)
        known = datasets.load_all(conn, keys)
        if dataset is not None and dataset not in known:
            raise click.ClickException(f"no dataset {dataset!r} in namespace {namespace!r}")
        names = [dataset] if dataset else sorted(known)
        for name in names:
            raw = folder / name / RAW
            if not raw.is_file():
                click.echo(f"{name}: no {raw}: nothing to continue")
                continue
            try:
                result = extend.extend(conn, keys, known[name], raw, continue_to)
            except extend.CannotExtend as exc:
                raise click.ClickException(str(exc)) from None
            for where in result.unusable[:10]:
                click.echo(f"{where}: not re-opened", err=True)
            click.echo(result.line())
