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

from genq.commands.embedded import EmbeddedRedis
from genq.settings import option

# The folder is the run's: it holds its password (docs/commands.md, `genq run`).
FOLDER = ".redis"


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


def has_private_redis(out: Path) -> bool:
    return (out / FOLDER / "password").exists()


@contextlib.contextmanager
def redis_of(out: Path | None, redis_url: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The Redis URL to use and the arguments `connect()` needs beside it: ``redis_url`` as given
    without ``out``, else the private Redis of the run in ``out`` (``--redis`` on the command line
    too is a usage error: they name two Redis)."""
    if out is None:
        yield redis_url, {}
        return
    source = click.get_current_context().get_parameter_source("redis_url")
    if source == click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("--out uses that run's private Redis: give --out or --redis, not both")
    if not has_private_redis(out):
        raise click.ClickException(
            f"{out / FOLDER}: no private Redis of a `genq run` here; give the folder `genq run --out` "
            "wrote, or --redis URL of the Redis the run used"
        )
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
        yield url, {"password": password}
    finally:
        if started:
            server.stop()
