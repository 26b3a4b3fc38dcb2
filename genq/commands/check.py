"""`genq check` as the command line has it: the check stage's own command (genq.checker.cli), which
may also attach to a `genq run` folder with ``--out``, as status, verify and retry do."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from genq.checker.cli import check_command as judging
from genq.commands.run_redis import out_option, redis_of


def _attached(out: Path | None, redis_url: str, namespace: str, **options: Any) -> None:
    with redis_of(out, redis_url, namespace) as (url, auth, namespace):
        if auth.get("password"):  # the run's private Redis: its password, as its children get it
            os.environ.pop("GENQ_REDIS_PASSWORD_FILE", None)
            os.environ["GENQ_REDIS_PASSWORD"] = auth["password"]
        judging.callback(redis_url=url, namespace=namespace, **options)


check_command = out_option("check")(
    click.Command(
        "check",
        params=list(judging.params),
        callback=_attached,
        help=judging.help,
        short_help=judging.short_help,
    )
)
