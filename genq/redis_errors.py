"""Which Redis errors mean "not now", and saying so once: the one home of that judgement.

A Redis that cannot be reached, or that answers but refuses the command for a while (out of
memory, its disk full, a demoted primary, a script running too long, its data still loading,
genq's scripts flushed, one of genq's keys overwritten with another type), is an outage: every
role backs off and retries the same call until Redis takes it. Any other error reply (a syntax
error, NOPERM, ...) is a bug or a misconfiguration that waiting will not fix: it still fails loudly.

redis-py (redis/_parsers/base.py, ``EXCEPTION_CLASSES``) turns some error codes into classes of
their own (OutOfMemoryError "OOM", ReadOnlyError "READONLY", BusyLoadingError "LOADING",
NoScriptError "NOSCRIPT", ExecAbortError, in newer versions TryAgainError, MasterDownError) and strips
the code from the message; the rest (MISCONF, BUSY) come as a plain ResponseError whose text
starts with the code. redis-py 8 keeps the code in ``status_code`` too, also for the codes it
leaves in the text; 5.x has no ``status_code``, so the class says the code (``_CODES``).
A command refused inside MULTI/EXEC comes annotated by the pipeline
("Command # 1 (...) of pipeline caused error: ...", redis/client.py ``annotate_exception``), a
transaction Redis refused at EXEC as "EXECABORT Transaction discarded because of: OOM ...", and
an error raised inside a Lua script (Redis < 7) as "Error running script ...: -OOM ...". A
NOSCRIPT is ridden out by calling again: redis-py's ``Script`` reloads its script on NOSCRIPT
(redis/commands/core.py ``Script.__call__``), and a pipeline loads its scripts before sending
(redis/client.py ``Pipeline.load_scripts``), so the retry finds the script back.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from genq import backoff
from genq.keys import Keys

T = TypeVar("T")

# Error codes of replies that mean "not now", and what each says about Redis.
NOT_NOW = {
    "OOM": "Redis refuses writes",  # used memory over maxmemory under noeviction
    "MISCONF": "Redis refuses writes",  # its last snapshot failed (disk full) and stop-writes-on-bgsave-error
    "READONLY": "Redis refuses writes",  # a replica now: a demoted primary, without Sentinel
    "BUSY": "Redis is busy",  # a script running past lua-time-limit
    "LOADING": "Redis is loading its data",  # restarted, reading its AOF or RDB
    "TRYAGAIN": "Redis asks to try again",
    "MASTERDOWN": "Redis has lost its primary",  # a replica with replica-serve-stale-data no
    "NOSCRIPT": "Redis has lost genq's scripts",  # SCRIPT FLUSH, or a restart without persistence
    # One of genq's keys holds another type (written by hand, or by another program): no role may
    # go on past it (a worker would generate results it cannot commit), and each resumes once the
    # key is put right. The line names the key (``wrong_types``).
    "WRONGTYPE": "a genq key in Redis holds the wrong type",
}
# The classes redis-py raises for a code it strips from the text (those of every version allowed).
_CODES = (
    (redis.exceptions.OutOfMemoryError, "OOM"),
    (redis.exceptions.ReadOnlyError, "READONLY"),
    (redis.exceptions.NoScriptError, "NOSCRIPT"),
    (redis.exceptions.ExecAbortError, "EXECABORT"),
    (redis.exceptions.TryAgainError, "TRYAGAIN"),
    (redis.exceptions.MasterDownError, "MASTERDOWN"),
)
_PIPELINE = re.compile(r"^Command # \d+ \(.*\) of pipeline caused error: ", re.DOTALL)
_ABORTED = "Transaction discarded because of: "  # Redis's execCommandAbort: the reason follows
_SCRIPT_AT = re.compile(r"\.? script: \w+, on @user_script:\d+\.$")  # Redis 7 names the script
_IN_SCRIPT = re.compile(r"Error running script.*?-([A-Z]+) ", re.DOTALL)  # Redis < 7 wraps it so


def not_now(exc: BaseException) -> str | None:
    """The line saying why Redis did not take the command now (worth retrying), or None when
    ``exc`` is anything else: a bug, a refused password, or not Redis's."""
    found = _classify(exc)
    return None if found is None else found[1]


def _classify(exc: BaseException) -> tuple[str, str] | None:
    """(the error code, or UNREACHABLE; the line) of a "not now" error, else None."""
    if isinstance(exc, redis.AuthenticationError | redis.exceptions.AuthorizationError):
        return None
    if isinstance(exc, redis.BusyLoadingError):  # a ConnectionError to redis-py, but Redis answered
        return "LOADING", f"{NOT_NOW['LOADING']}: LOADING {exc}"
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return "UNREACHABLE", f"Redis unreachable: {exc}"
    if not isinstance(exc, redis.ResponseError):
        return None
    code, text = _reply(exc)
    if code not in NOT_NOW:
        return None
    return code, f"{NOT_NOW[code]}: {code} {_SCRIPT_AT.sub('', text).rstrip('.')}"


def is_reply(exc: BaseException) -> bool:
    """Redis answered: the command was refused, not applied (a lost connection may hide one that
    was), so sending it again cannot apply it twice."""
    return isinstance(exc, redis.ResponseError | redis.BusyLoadingError)


def patiently(fn: Callable[[], T], outage: Outage, replies_only: bool = False) -> T:
    """Call ``fn`` until Redis takes it, waiting out "not now" with backoff (only refusals with
    ``replies_only``: for a call that must not be sent twice); any other error is raised."""
    failed = False
    for delay in backoff.doubling(0.5, 5.0):
        try:
            result = fn()
        except redis.RedisError as exc:
            if (replies_only and not is_reply(exc)) or outage.refused(exc) is None:
                raise
            failed = True
            time.sleep(delay)
            continue
        if failed:
            outage.over()
        return result


def refusing_writes(info: dict[str, Any]) -> str | None:
    """Why a Redis refuses writes, from its INFO (for `genq status`: reads still work then), or
    None: used memory over maxmemory under noeviction, a replica. (MISCONF refuses PING too, and
    with it redis-py's health check: status then fails with that one line instead.)"""
    limit = int(info.get("maxmemory", 0) or 0)
    if limit and info.get("maxmemory_policy") == "noeviction" and int(info["used_memory"]) > limit:
        return (
            f"Redis refuses writes (OOM: used memory {info['used_memory_human']} > maxmemory "
            f"{info.get('maxmemory_human', limit)}, policy noeviction)"
        )
    if info.get("role") == "slave":
        return "Redis refuses writes (READONLY: it is a replica)"
    return None


def _reply(exc: redis.ResponseError) -> tuple[str, str]:
    """The error code and the rest of the reply, wherever redis-py put them."""
    text = _PIPELINE.sub("", str(exc), count=1)
    code = getattr(exc, "status_code", None) or next((c for cls, c in _CODES if isinstance(exc, cls)), "")
    if code == "EXECABORT" and text.startswith(_ABORTED):
        code, _, text = text[len(_ABORTED) :].partition(" ")
    elif not code:
        script = _IN_SCRIPT.search(text)
        if script:
            code, text = script.group(1), text[script.end() :]
        else:
            code, _, text = text.partition(" ")
    elif text.startswith(f"{code} "):  # redis-py 8: a code without a class of its own stays in the text
        text = text[len(code) + 1 :]
    return code, text


def wrong_types(conn: redis.Redis, keys: Keys) -> str:
    """Which of genq's keys hold another type than genq keeps there, in one line ("" if none):
    a WRONGTYPE reply names no key, least of all from inside a script."""
    try:
        names = [n.decode("utf-8", "replace") for n in conn.hkeys(keys.datasets)]
    except redis.ResponseError:
        names = []
    expected = keys.types(names)
    with conn.pipeline(transaction=False) as pipe:
        for key in expected:
            pipe.type(key)
        found = pipe.execute()
    wrong = [
        f"{key} is a {kind.decode()}, genq keeps a {want} there"
        for (key, want), kind in zip(expected.items(), found, strict=True)
        if kind not in (b"none", want.encode())
    ]
    return "; ".join(wrong)


class Outage:
    """Says once when Redis stops taking a role's commands, and once when it takes them again;
    :meth:`refused` is None for an error that is not "not now" (the caller raises it). With a
    connection and keys, a WRONGTYPE is said with the keys that hold the wrong type."""

    def __init__(self, log: logging.Logger, conn: redis.Redis | None = None, keys: Keys | None = None):
        self._log = log
        self._conn, self._keys = conn, keys
        self._code: str | None = None  # what Redis said, while it refuses
        self._reason = ""
        self._since = 0.0

    @property
    def on(self) -> bool:
        """Redis is refusing (or unreachable) right now."""
        return self._code is not None

    def refused(self, exc: BaseException, extra: dict | None = None) -> str | None:
        """The line for ``exc`` if it means "not now", logged when the outage starts or its reason
        changes (a Redis out of memory that then restarts); None for any other error."""
        found = _classify(exc)
        if found is None:
            return None
        code, reason = found
        if code != self._code:
            if self._code is None:
                self._since = time.monotonic()
            if code == "WRONGTYPE":
                reason = f"{reason}: {self._wrong_keys()}"
            self._code, self._reason = code, reason
            self._log.warning("%s; retrying", reason, extra=extra)
        return reason

    def _wrong_keys(self) -> str:
        conn, keys = self._conn, self._keys
        found = _quietly(lambda: wrong_types(conn, keys)) if conn is not None and keys is not None else ""
        return found or "which key, genq cannot tell (not one of its own?)"

    def over(self, extra: dict | None = None) -> None:
        """The call went through: say so if Redis had been refusing."""
        if self._code is None:
            return
        # WARNING as the start is: a command without logging set up (enqueue) still says it.
        self._log.warning(
            "Redis takes commands again after %.0f s (%s)",
            time.monotonic() - self._since,
            self._reason,
            extra=extra,
        )
        self._code = None


def _quietly(fn: Callable[[], str]) -> str:
    """What ``fn`` says, or nothing if Redis fails it too: a diagnosis never adds an error."""
    try:
        return fn()
    except redis.RedisError:
        return ""


def fatal(exc: BaseException) -> str:
    """The one line a command or role stops with on a Redis error it does not wait out."""
    return f"Redis answered an error genq does not wait out (a bug or a misconfiguration): {exc}"
