"""One home for configuration: flags, then GENQ_* environment variables, then defaults.

Every option is declared through :func:`option`, which derives its environment variable
from the flag name (``--max-new-tokens`` -> ``GENQ_MAX_NEW_TOKENS``), so no flag can be
added without its variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import redis

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_NAMESPACE = "genq"
ENV_PREFIX = "GENQ_"


def env_name(flag: str) -> str:
    """``--max-new-tokens`` -> ``GENQ_MAX_NEW_TOKENS``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def option(*decls: str, env: str | None = None, **kwargs: Any) -> Callable:
    """A click option whose environment variable is ``GENQ_<FLAG>`` unless ``env`` names another."""
    flag = max((d for d in decls if d.startswith("--")), key=len)
    kwargs.setdefault("envvar", env or env_name(flag.split("/")[0]))
    kwargs.setdefault("show_envvar", True)
    if "default" in kwargs and not kwargs.get("is_flag"):
        kwargs.setdefault("show_default", True)
    return click.option(*decls, **kwargs)


def redis_options(func: Callable) -> Callable:
    """``--redis`` and ``--namespace``, shared by every command."""
    func = option(
        "--namespace",
        default=DEFAULT_NAMESPACE,
        help="Keeps independent jobs apart on one Redis.",
        callback=_check_namespace,
    )(func)
    return option(
        "--redis",
        "redis_url",
        env="GENQ_REDIS_URL",
        default=DEFAULT_REDIS_URL,
        help="Redis URL (redis://, rediss:// or unix://). The password comes from "
        "GENQ_REDIS_PASSWORD or GENQ_REDIS_PASSWORD_FILE, never from the command line.",
    )(func)


def _check_namespace(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from genq.keys import validate_name

    try:
        return validate_name(value, "namespace")
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def redis_password() -> str | None:
    """The password from GENQ_REDIS_PASSWORD_FILE or GENQ_REDIS_PASSWORD (in that order)."""
    path = os.environ.get("GENQ_REDIS_PASSWORD_FILE")
    if path:
        return Path(path).read_text().strip()
    return os.environ.get("GENQ_REDIS_PASSWORD") or None


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A Redis client for ``url`` that reconnects on its own and never hangs forever."""
    if urlsplit(url).password is None and "password" not in kwargs:
        password = redis_password()
        if password:
            kwargs["password"] = password
    kwargs.setdefault("socket_connect_timeout", 10)
    kwargs.setdefault("socket_keepalive", True)
    kwargs.setdefault("health_check_interval", 30)
    return redis.Redis.from_url(url, **kwargs)


def redact(url: str) -> str:
    """``url`` with any password replaced, for logs and progress lines."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()
