"""Reaching Redis: the one way every command and role connects, waits for and names a Redis.

:func:`connect` turns a URL (plus the GENQ_REDIS_* variables in :data:`REDIS_ENV`: password, TLS
files, Sentinels) into a client that reconnects on its own; :func:`wait_for_redis` waits for a
Redis that is not up yet; :func:`redact` hides the password in logs. The options and secrets
themselves live in genq/settings.py, which this module imports and which never imports it back.
Also here: :data:`HASH_VALUE_LIMIT`, the hash setting every genq Redis should run with.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any
from urllib.parse import unquote, urlsplit

import redis

from genq import backoff
from genq.redis_errors import not_now
from genq.settings import secret

log = logging.getLogger("genq.redis")

# Redis keeps a hash as a compact listpack while every value is at most this long (default 64):
# a genq job's payload is longer, and a hashtable costs it ~340 bytes more.
HASH_VALUE_LIMIT = 1024

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
_TLS_ENV = {
    "ssl_ca_certs": "GENQ_REDIS_CA_FILE",
    "ssl_certfile": "GENQ_REDIS_CERT_FILE",
    "ssl_keyfile": "GENQ_REDIS_KEY_FILE",
}


def redis_password() -> str | None:
    return secret("REDIS_PASSWORD")


SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel")


class RedisURLError(ValueError):
    """A Redis URL genq cannot dial: said in one line, with what to write instead."""


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A Redis client for ``url`` that reconnects on its own and never hangs forever.

    ``rediss://`` is TLS, and the certificate must name the host (Sentinels' too); a private CA to
    trust (besides the system's) and a client certificate come from GENQ_REDIS_CA_FILE,
    GENQ_REDIS_CERT_FILE and GENQ_REDIS_KEY_FILE (``?ssl_cert_reqs=none`` skips verification).
    ``redis+sentinel://host:port[,host:port...]/<master>/<db>`` (``rediss+sentinel://`` for TLS), or
    GENQ_REDIS_SENTINELS + GENQ_REDIS_MASTER beside a plain URL, connects through Redis Sentinel:
    every new connection asks the Sentinels for the current primary, so a failover is followed
    without a restart (a connection still open to a demoted primary fails and reconnects).
    """
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise RedisURLError(
            f"Redis URL {redact(url)!r} has no scheme genq knows: write redis://HOST:PORT "
            f"(or {', '.join(s + '://' for s in SCHEMES[1:])}), e.g. redis://localhost:6379"
        )
    if parts.password is None and "password" not in kwargs:
        password = redis_password()
        if password:
            kwargs["password"] = password
    if parts.scheme.startswith("rediss"):
        kwargs.setdefault("ssl", True)
        # The certificate must name the host dialled: redis-py 5.x does not check unless told
        # (8.x does; redis/connection.py SSLConnection). ``?ssl_cert_reqs=none`` still turns
        # verification, and with it this check, off.
        kwargs.setdefault("ssl_check_hostname", True)
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
    under podman, which ignores health conditions; systemd after a reboot) may be up first, and a
    Redis may answer but refuse (still loading its AOF; MISCONF refuses even PING). A
    refused password fails at once; so does a Redis still unreachable after ``give_up_after``
    seconds (None: wait as long as it takes, as the daemons do for a Redis restarted mid-run)."""
    started = time.monotonic()
    deadline = None if give_up_after is None else started + give_up_after
    waited = False
    for delay in backoff.doubling(0.5, 5.0):  # a Redis on its way up is met within seconds
        try:
            conn.ping()
            if waited:
                log.info("Redis answers after %.0f s (%s)", time.monotonic() - started, redact(url))
            return
        except redis.RedisError as exc:
            reason = not_now(exc)  # None for a refused password: it fails at once
            if reason is None or (deadline is not None and time.monotonic() + delay > deadline):
                raise
            if not waited:  # one line when the wait starts, not one per try
                left = "" if give_up_after is None else f", giving up after {give_up_after:.0f} s"
                log.warning("%s (%s); waiting for it%s", reason, redact(url), left)
                waited = True
        time.sleep(delay)


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
    for key in ("ssl", "ssl_check_hostname", *_TLS_ENV):
        if key in kwargs:
            sentinel_kwargs[key] = kwargs[key]
    return Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs, **kwargs).master_for(master, db=db)


def split_password(url: str) -> tuple[str, str | None]:
    """``url`` without its password (in the userinfo, or a ``password=`` query parameter, which
    redis-py also reads: redis/connection.py ``parse_url``), and that password, unquoted."""
    parts = urlsplit(url)
    password = None if parts.password is None else unquote(parts.password)
    netloc = parts.netloc
    if password is not None:
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}@{host}" if user else host
    kept = []
    for pair in parts.query.split("&") if parts.query else []:
        key, _, value = pair.partition("=")
        if key == "password":
            password = password or unquote(value)
        else:
            kept.append(pair)
    return _join(parts.scheme, netloc, parts.path, "&".join(kept)), password


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``, for logs, progress lines and errors."""
    bare, password = split_password(url)
    if password is None:
        return url
    parts = urlsplit(bare)
    user, _, host = parts.netloc.rpartition("@")
    return _join(parts.scheme, f"{user}:***@{host}", parts.path, parts.query)


def _join(scheme: str, netloc: str, path: str, query: str) -> str:
    """A URL from its parts, keeping ``//`` when the host is empty (``unix:///path``), which
    urllib's ``geturl`` drops."""
    return f"{scheme}://{netloc}{path}" + (f"?{query}" if query else "")
