"""One home for configuration: flags, then GENQ_* environment variables, then defaults.

Every option is declared through :func:`option`, which derives its environment variable
from the flag name (``--max-new-tokens`` -> ``GENQ_MAX_NEW_TOKENS``), so no flag can be
added without its variable. Secrets (:func:`secret`) come only from the environment or a file.
Reaching Redis with these settings (URL, password, TLS, Sentinel) is genq/connection.py's job.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_NAMESPACE = "genq"
# A worker's --heartbeat-ttl: silent for longer, it is dead (status) and its jobs run elsewhere.
DEFAULT_HEARTBEAT_TTL_S = 60
ENV_PREFIX = "GENQ_"


class Refused(click.ClickException):
    """What this host's own settings do not allow (running a tokenizer's code without
    --trust-remote-code): one line and exit 2, as a usage error, without click's usage block."""

    exit_code = 2


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
        help="Redis URL (redis://, rediss://, unix://, or redis+sentinel://host:port,.../master/db). "
        "The password comes from "
        "GENQ_REDIS_PASSWORD or GENQ_REDIS_PASSWORD_FILE, never from the command line; for "
        "rediss://, the CA from GENQ_REDIS_CA_FILE (client certificate: GENQ_REDIS_CERT_FILE/_KEY_FILE).",
    )(func)


def json_object(example: str) -> Callable[[click.Context, click.Parameter, str | None], dict[str, Any]]:
    """A click callback for an option that takes a JSON object (empty: ``{}``); ``example`` is
    shown when the value is JSON but not an object."""

    def parse(ctx: click.Context, param: click.Parameter, value: str | None) -> dict[str, Any]:
        if not value:
            return {}
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise click.BadParameter(f"not JSON: {exc}") from exc
        if not isinstance(parsed, dict):
            raise click.BadParameter(f"expected a JSON object, e.g. {example}")
        return parsed

    return parse


def _check_namespace(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from genq.keys import validate_name

    try:
        return validate_name(value, "namespace")
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def secret(name: str) -> str | None:
    """A secret from the file named by ``GENQ_<NAME>_FILE``, else from ``GENQ_<NAME>``.

    Secrets never come from flags: a command line shows in ``ps`` and in shell history. The file
    is looked at again at every call (a worker asks once per request), so a rotated secret is
    picked up without a restart; it is read again when it changed (another inode, size or
    modification time: a rename over it, a rewrite) and at least every SECRET_FRESH_S (a rewrite
    of the same size within one tick of the file system's clock keeps its time).
    """
    path = os.environ.get(f"{ENV_PREFIX}{name}_FILE")
    if path:
        stat = os.stat(path)
        version = (path, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        now = time.monotonic()
        known = _SECRETS.get(name)
        if known is None or known[0] != version or now - known[1] > SECRET_FRESH_S:
            known = _SECRETS[name] = (version, now, Path(path).read_text().strip() or None)
        return known[2]
    return os.environ.get(f"{ENV_PREFIX}{name}") or None


SECRET_FRESH_S = 1.0
# name: (the file's version, when it was read, the secret)
_SECRETS: dict[str, tuple[tuple[str, int, int, int], float, str | None]] = {}


def server_api_key() -> str | None:
    """The inference server's API key (SGLang/vLLM ``--api-key``), sent as a Bearer token."""
    return secret("SERVER_API_KEY")


# Read by the worker and `enqueue --server` (the inference server's --api-key).
SERVER_ENV = {
    "GENQ_SERVER_API_KEY": "API key of the inference server (prefer GENQ_SERVER_API_KEY_FILE)",
    "GENQ_SERVER_API_KEY_FILE": "file holding that key; wins over GENQ_SERVER_API_KEY",
}
