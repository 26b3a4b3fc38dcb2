"""`genq dashboard`: rq-dashboard for genq (the app and its fixes are in genq/commands/dashboard_app.py).

Served by werkzeug on 127.0.0.1:9181 unless told otherwise, with HTTP basic auth when
GENQ_DASHBOARD_PASSWORD (or GENQ_DASHBOARD_PASSWORD_FILE) is set. Flask and rq-dashboard are
imported only when the command runs, so the other commands start without them.
"""

from __future__ import annotations

import logging

import click

from genq.connection import redact
from genq.settings import option, redis_options, secret

LOCAL = ("127.0.0.1", "localhost", "::1")


def dashboard_password() -> str | None:
    """GENQ_DASHBOARD_PASSWORD_FILE, else GENQ_DASHBOARD_PASSWORD: never on the command line."""
    return secret("DASHBOARD_PASSWORD")


@click.command("dashboard")
@option("--port", type=click.IntRange(min=1, max=65535), default=9181, help="Port to serve on.")
@option(
    "--bind",
    default="127.0.0.1",
    help="Address to listen on. Reach a remote one through an SSH tunnel, or set a password.",
)
@option("--username", default="genq", help="Basic-auth user, when GENQ_DASHBOARD_PASSWORD(_FILE) is set.")
@redis_options
def dashboard_command(port: int, bind: str, username: str, redis_url: str, namespace: str) -> None:
    """rq-dashboard for genq's queues: JSON jobs, a working workers page, requeue as `genq retry`.

    Basic auth when GENQ_DASHBOARD_PASSWORD or GENQ_DASHBOARD_PASSWORD_FILE is set. Deleting jobs
    is off. It lists every RQ queue in this Redis; the namespace's are named <namespace>.<dataset>.
    """
    from werkzeug.serving import run_simple

    from genq.commands.dashboard_app import create_app

    password = dashboard_password()
    if not password and bind not in LOCAL:
        click.echo(f"genq dashboard: WARNING: listening on {bind} with no password", err=True)
    app = create_app(redis_url, username, password)
    click.echo(
        f"genq dashboard: http://{bind}:{port}/ (Redis {redact(redis_url)}; "
        f"namespace {namespace!r}: queues {namespace}.<dataset>)",
        err=True,
    )
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    run_simple(bind, port, app, threaded=True)
