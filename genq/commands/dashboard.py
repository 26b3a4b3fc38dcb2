"""`genq dashboard`: rq-dashboard for genq (the app and its fixes are in genq/commands/dashboard_app.py).

Served by werkzeug on 127.0.0.1:9181 unless told otherwise, with HTTP basic auth when
GENQ_DASHBOARD_PASSWORD (or GENQ_DASHBOARD_PASSWORD_FILE) is set. Flask and rq-dashboard are
imported only when the command runs, so the other commands start without them.
"""

from __future__ import annotations

import ipaddress
import logging
import sys
from pathlib import Path

import click

from genq.commands.run_redis import out_option, redis_of
from genq.connection import redact
from genq.settings import option, redis_options, secret


def dashboard_password() -> str | None:
    """GENQ_DASHBOARD_PASSWORD_FILE, else GENQ_DASHBOARD_PASSWORD: never on the command line."""
    return secret("DASHBOARD_PASSWORD")


def loopback(bind: str) -> bool:
    """Only this host can reach an address that is loopback (or ``localhost``)."""
    if bind == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind).is_loopback
    except ValueError:  # a host name: whatever it resolves to, not known to be loopback
        return False


def _host_names(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """Repeated flags, or GENQ_DASHBOARD_ALLOW_HOST=a,b (click splits the variable on spaces)."""
    return tuple(name.strip() for item in value for name in item.split(",") if name.strip())


@click.command("dashboard")
@option("--port", type=click.IntRange(min=1, max=65535), default=9181, help="Port to serve on.")
@option(
    "--bind",
    default="127.0.0.1",
    help="Address to listen on. Reach a remote one through an SSH tunnel; any other than loopback "
    "needs a password.",
)
@option("--username", default="genq", help="Basic-auth user, when GENQ_DASHBOARD_PASSWORD(_FILE) is set.")
@option(
    "--allow-host",
    "allow_hosts",
    env="GENQ_DASHBOARD_ALLOW_HOST",  # GENQ_<WHAT>_<FLAG>: guessable from the flag (test_settings.py)
    multiple=True,
    callback=_host_names,
    help="A name the dashboard is reached by (a reverse proxy's, a DNS name), besides the bind "
    "address and localhost; other Host headers get 400. Repeatable; the variable takes a,b.",
)
@option(
    "--insecure-no-auth",
    is_flag=True,
    help="Serve a non-loopback --bind without a password (anyone who reaches it can requeue jobs).",
)
@out_option("dashboard")
@redis_options
def dashboard_command(
    port: int,
    bind: str,
    username: str,
    allow_hosts: tuple[str, ...],
    insecure_no_auth: bool,
    out: Path | None,
    redis_url: str,
    namespace: str,
) -> None:
    """rq-dashboard for genq's queues: JSON jobs only, a working workers page, requeue as `genq retry`.

    Basic auth when GENQ_DASHBOARD_PASSWORD or GENQ_DASHBOARD_PASSWORD_FILE is set; a --bind other
    than loopback needs one (or --insecure-no-auth). It answers only to the Host names it is reached
    by (--allow-host), changes things only on a POST from its own pages, and never deletes jobs.
    It lists every RQ queue in this Redis; the namespace's are named <namespace>.<dataset>.
    """
    password = dashboard_password()
    if not password and not loopback(bind):
        if not insecure_no_auth:
            click.echo(
                f"genq dashboard: --bind {bind} without a password: set GENQ_DASHBOARD_PASSWORD_FILE "
                "(or pass --insecure-no-auth)",
                err=True,
            )
            sys.exit(2)
        click.echo(f"genq dashboard: WARNING: listening on {bind} with no password", err=True)

    from werkzeug.serving import run_simple

    from genq.commands.dashboard_app import create_app

    with redis_of(out, redis_url, namespace) as (url, auth, namespace):
        app = create_app(url, username, password, bind=bind, allow_hosts=allow_hosts, redis_auth=auth)
        click.echo(
            f"genq dashboard: http://{bind}:{port}/ (Redis {redact(url)}; "
            f"namespace {namespace!r}: queues {namespace}.<dataset>)",
            err=True,
        )
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        run_simple(bind, port, app, threaded=True)
