"""The private Redis of a `genq run` folder, for the commands that look at the run afterwards.

`genq run` without ``--redis`` keeps its Redis in ``OUT/.redis`` on a new port each time and stops
it at the end, so ``genq status/monitor/failed/retry --out OUT`` (and ``genq verify --out OUT``)
find it here: the running one while the run goes on, else the same one started again from its
append-only file for as long as the command runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import redis

from genq.commands.embedded import EmbeddedRedis
from genq.connection import redact
from genq.keys import Keys, namespaces
from genq.settings import option

# The folder is the run's: it holds its password (docs/commands.md, `genq run`), and the namespace
# the run used, which the commands looking at it with --out use too.
FOLDER = ".redis"
NAMESPACE_FILE = "namespace"


def record_namespace(out: Path, namespace: str) -> None:
    """`genq run` on its private Redis: the namespace it uses, for the commands that look later."""
    (out / FOLDER / NAMESPACE_FILE).write_text(namespace + "\n")


def _namespace_of(out: Path, namespace: str) -> str:
    """The run's own namespace wins over GENQ_NAMESPACE (said in one line); a different one given
    on the command line names another run's: an error naming both."""
    try:
        recorded = (out / FOLDER / NAMESPACE_FILE).read_text().strip()
    except OSError:
        return namespace  # a folder from before genq recorded it
    if recorded == namespace:
        return namespace
    source = click.get_current_context().get_parameter_source("namespace")
    if source == click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError(
            f"--namespace {namespace}: the run in {out} used namespace {recorded!r}; drop --namespace, "
            "or give --redis for another run's"
        )
    if source == click.core.ParameterSource.ENVIRONMENT:
        click.echo(
            f"genq: GENQ_NAMESPACE={namespace} left aside: the run in {out} used {recorded!r}", err=True
        )
    return recorded


def out_option(command: str) -> Any:
    """``--out OUT`` of a command that looks at a run; its variable is the command's own
    (``GENQ_STATUS_OUT``...), not ``GENQ_OUT``, which names the collector's folder."""
    return option(
        "--out",
        env=f"GENQ_{command.upper()}_OUT",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="The output folder of a `genq run`: use its private Redis (OUT/.redis), started "
        "again for this command if the run has ended.",
    )


def no_dataset_here(conn: redis.Redis, namespace: str, url: str) -> str | None:
    """Why a command pointed here would look at nothing (no dataset in the namespace), naming the
    namespaces that hold some; None when there are datasets."""
    if conn.exists(Keys(namespace).datasets):
        return None
    others = [n for n in namespaces(conn) if n != namespace]
    return f"no dataset in namespace {namespace!r} on {redact(url)}" + (
        f"; datasets are in namespace {', '.join(map(repr, others))} there (--namespace)"
        if others
        else ": nothing was enqueued there"
    )


def require_datasets(conn: redis.Redis, namespace: str, url: str) -> None:
    """A command that checks or changes a run's datasets must not look clean having seen none."""
    why = no_dataset_here(conn, namespace, url)
    if why is not None:
        raise click.ClickException(why)


def has_private_redis(out: Path) -> bool:
    return (out / FOLDER / "password").exists()


@contextlib.contextmanager
def redis_of(out: Path | None, redis_url: str, namespace: str) -> Iterator[tuple[str, dict[str, Any], str]]:
    """The Redis URL to use, the arguments `connect()` needs beside it, and the namespace:
    ``redis_url`` and ``namespace`` as given without ``out``, else the private Redis of the run in
    ``out`` and the namespace it used (``--redis`` on the command line too is a usage error: they
    name two Redis; GENQ_REDIS_URL is left aside, as it names the one Redis of every command)."""
    if out is None:
        yield redis_url, {}, namespace
        return
    source = click.get_current_context().get_parameter_source("redis_url")
    if source == click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("--out uses that run's private Redis: give --out or --redis, not both")
    if not has_private_redis(out):
        raise click.ClickException(
            f"{out / FOLDER}: no private Redis of a `genq run` here; give the folder `genq run --out` "
            "wrote, or --redis URL of the Redis the run used"
        )
    namespace = _namespace_of(out, namespace)
    server = EmbeddedRedis(out / FOLDER, private=True)
    try:
        password = server.password()
        url = server.attach()  # the run going on
        started = url is None
        if started:
            click.echo(
                f"genq: the run in {out} has ended: its private Redis is started again from "
                f"{out / FOLDER} while this command runs",
                err=True,
            )
            url = server.start()
    except (OSError, RuntimeError) as exc:
        raise click.ClickException(f"{out / FOLDER}: cannot start the run's private Redis: {exc}") from exc
    try:
        yield url, {"password": password}, namespace
    finally:
        if started:
            server.stop()
