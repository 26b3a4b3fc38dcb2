"""One home for configuration: flags, then GENQ_* environment variables, then defaults.

Every option is declared through :func:`option`, which derives its environment variable
from the flag name (``--max-new-tokens`` -> ``GENQ_MAX_NEW_TOKENS``), so no flag can be
added without its variable.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import redis

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_NAMESPACE = "genq"
ENV_PREFIX = "GENQ_"

log = logging.getLogger("genq.redis")


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


def _check_namespace(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from genq.keys import validate_name

    try:
        return validate_name(value, "namespace")
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def secret(name: str) -> str | None:
    """A secret from the file named by ``GENQ_<NAME>_FILE``, else from ``GENQ_<NAME>``.

    Secrets never come from flags: a command line shows in ``ps`` and in shell history. The file
    is read again at every call, so a rotated secret is picked up without a restart.
    """
    path = os.environ.get(f"{ENV_PREFIX}{name}_FILE")
    if path:
        return Path(path).read_text().strip() or None
    return os.environ.get(f"{ENV_PREFIX}{name}") or None


def redis_password() -> str | None:
    return secret("REDIS_PASSWORD")


def server_api_key() -> str | None:
    """The inference server's API key (SGLang/vLLM ``--api-key``), sent as a Bearer token."""
    return secret("SERVER_API_KEY")


# Read by :func:`connect` for every command (not flags: secrets and file paths stay out of argv).
REDIS_ENV = {
    "GENQ_REDIS_PASSWORD": "Redis password (prefer GENQ_REDIS_PASSWORD_FILE)",
    "GENQ_REDIS_PASSWORD_FILE": "file holding the Redis password; wins over GENQ_REDIS_PASSWORD",
    "GENQ_REDIS_CA_FILE": "rediss:// only: CA bundle that signed the server's certificate",
    "GENQ_REDIS_CERT_FILE": "rediss:// only: client certificate, when Redis asks for one",
    "GENQ_REDIS_KEY_FILE": "rediss:// only: the client certificate's key",
    "GENQ_REDIS_SENTINELS": "Redis Sentinels host:port[,host:port...] (or a redis+sentinel:// URL)",
    "GENQ_REDIS_MASTER": "with GENQ_REDIS_SENTINELS: the name of the master the Sentinels watch",
    "GENQ_REDIS_SENTINEL_PASSWORD": "the Sentinels' own password, if they have one (prefer the _FILE)",
    "GENQ_REDIS_SENTINEL_PASSWORD_FILE": "file holding it; wins over GENQ_REDIS_SENTINEL_PASSWORD",
}
# Read by the worker and `enqueue --server` (the inference server's --api-key).
SERVER_ENV = {
    "GENQ_SERVER_API_KEY": "API key of the inference server (prefer GENQ_SERVER_API_KEY_FILE)",
    "GENQ_SERVER_API_KEY_FILE": "file holding that key; wins over GENQ_SERVER_API_KEY",
}
_TLS_ENV = {
    "ssl_ca_certs": "GENQ_REDIS_CA_FILE",
    "ssl_certfile": "GENQ_REDIS_CERT_FILE",
    "ssl_keyfile": "GENQ_REDIS_KEY_FILE",
}


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A Redis client for ``url`` that reconnects on its own and never hangs forever.

    ``rediss://`` is TLS; the CA and a client certificate come from GENQ_REDIS_CA_FILE,
    GENQ_REDIS_CERT_FILE and GENQ_REDIS_KEY_FILE (``?ssl_cert_reqs=none`` skips verification).
    ``redis+sentinel://host:port[,host:port...]/<master>/<db>`` (``rediss+sentinel://`` for TLS), or
    GENQ_REDIS_SENTINELS + GENQ_REDIS_MASTER beside a plain URL, connects through Redis Sentinel:
    every new connection asks the Sentinels for the current primary, so a failover is followed
    without a restart (a connection still open to a demoted primary fails and reconnects).
    """
    parts = urlsplit(url)
    if parts.password is None and "password" not in kwargs:
        password = redis_password()
        if password:
            kwargs["password"] = password
    if parts.scheme.startswith("rediss"):
        kwargs.setdefault("ssl", True)
        for key, env in _TLS_ENV.items():
            if os.environ.get(env):
                kwargs.setdefault(key, os.environ[env])
    kwargs.setdefault("socket_connect_timeout", 10)
    kwargs.setdefault("socket_keepalive", True)
    kwargs.setdefault("health_check_interval", 30)
    target = sentinel_target(url)
    if target is not None:
        return _through_sentinel(*target, parts, kwargs)
    kwargs.pop("ssl", None)
    return redis.Redis.from_url(url, **kwargs)


def wait_for_redis(conn: redis.Redis, url: str, give_up_after: float | None = None) -> None:
    """Return once Redis answers, retrying with backoff: a role started beside its Redis (compose
    under podman, which ignores health conditions; systemd after a reboot) may be up first. A
    refused password fails at once; so does a Redis still unreachable after ``give_up_after``
    seconds (None: wait as long as it takes, as the daemons do for a Redis restarted mid-run)."""
    deadline = None if give_up_after is None else time.monotonic() + give_up_after
    delay = 0.5
    while True:
        try:
            conn.ping()
            return
        except (redis.AuthenticationError, redis.exceptions.AuthorizationError):
            raise
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if deadline is not None and time.monotonic() + delay > deadline:
                raise
            log.warning("Redis unreachable at %s (%s); retrying in %.1f s", redact(url), exc, delay)
        time.sleep(delay)
        delay = min(delay * 2, 5.0)  # a Redis on its way up is met within seconds


def sentinel_target(url: str) -> tuple[list[tuple[str, int]], str, int] | None:
    """(sentinels, master name, db) when ``url`` (or the environment) asks for Sentinel."""
    parts = urlsplit(url)
    if parts.scheme.endswith("+sentinel"):
        hosts = parts.netloc.rpartition("@")[2]
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise ValueError(f"{redact(url)}: name the master: redis+sentinel://host:port/<master>/<db>")
        db = int(path[1]) if len(path) > 1 else 0
        return _hostports(hosts, url), path[0], db
    sentinels = os.environ.get("GENQ_REDIS_SENTINELS")
    if not sentinels:
        return None
    master = os.environ.get("GENQ_REDIS_MASTER")
    if not master:
        raise ValueError("GENQ_REDIS_SENTINELS is set: GENQ_REDIS_MASTER must name the master")
    path = [p for p in parts.path.split("/") if p]
    return _hostports(sentinels, "GENQ_REDIS_SENTINELS"), master, int(path[0]) if path else 0


def _hostports(text: str, where: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{where}: expected host:port[,host:port...], got {item!r}")
        out.append((host.strip("[]"), int(port)))
    return out


def _through_sentinel(
    sentinels: list[tuple[str, int]], master: str, db: int, parts: Any, kwargs: dict[str, Any]
) -> redis.Redis:
    from redis.sentinel import Sentinel

    if parts.password:  # a password in the URL is the master's, as in a plain URL
        kwargs.setdefault("password", parts.password)
    sentinel_kwargs = {
        "socket_connect_timeout": kwargs["socket_connect_timeout"],
        "socket_timeout": 10,
        "password": secret("REDIS_SENTINEL_PASSWORD"),
    }
    for key in ("ssl", *_TLS_ENV):
        if key in kwargs:
            sentinel_kwargs[key] = kwargs[key]
    return Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs, **kwargs).master_for(master, db=db)


def redact(url: str) -> str:
    """``url`` with any password replaced, for logs and progress lines."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()
