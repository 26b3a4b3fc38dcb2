"""Child processes of `genq run`: started with the same interpreter, killed with their parent."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int) -> None:
    """Linux: the child gets ``sig`` when `genq run` dies, even by SIGKILL, so nothing is orphaned."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def started_at(pid: int) -> str | None:
    """What tells this process from any later one given the same pid: the boot's id and the
    process's start time (clock ticks since boot, /proc/PID/stat field 22); None if it is gone."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"


class ProcessRecord:
    """One process recorded in a file by its pid and start time, found again only while that very
    process runs: a pid alone may by then name another process, which is not ours to stop."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, pid: int) -> None:
        self.path.write_text(f"{pid} {started_at(pid)}\n")

    def running(self) -> int | None:
        try:
            pid_text, started = self.path.read_text().split()
            pid = int(pid_text)
        except (OSError, ValueError):
            return None
        return pid if started_at(pid) == started else None


def genq_command(*args: str) -> list[str]:
    """The installed genq, whatever the current folder: ``-P`` keeps Python from putting that
    folder first on sys.path, where a folder named ``genq`` (a clone's parent) would shadow it."""
    return [sys.executable, "-P", "-m", "genq", *args]


class ChildFailed(Exception):
    """A child process ended before it was ready; the message carries its last log line."""


def spawn(
    argv: list[str],
    *,
    death_signal: int = signal.SIGKILL,
    env: dict[str, str] | None = None,
    stdout: int | IO | None = None,
    stderr: int | IO | None = None,
) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        env={**os.environ, **(env or {})},
        stdout=stdout,
        stderr=stderr,
        preexec_fn=lambda: _die_with_parent(death_signal),
        # Its own session: a Ctrl-C on the terminal reaches `genq run` alone, which stops its
        # children in order (workers first, while the server and Redis still answer them).
        start_new_session=True,
    )


def stop(procs: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM each, then wait for them together up to ``timeout``; SIGKILL what is left."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def last_line(log: Path) -> str:
    """The last non-empty line of a log (a traceback's last line names the error), or ''."""
    with contextlib.suppress(OSError):
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""
    return ""


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float, log: Path | None = None) -> str:
    """The first stdout line of ``proc`` that starts with ``prefix``; :class:`ChildFailed` naming
    the child's own last words (from its stderr ``log``) if it exits or stays silent."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    os.set_blocking(proc.stdout.fileno(), False)
    buf = b""
    while time.monotonic() < deadline:
        chunk = proc.stdout.read()
        if chunk:
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    name = " ".join(str(a) for a in proc.args[3:5])  # after the interpreter, -P and -m genq
    said = last_line(log) if log is not None else ""
    where = f"; see {log}" if log is not None else ""
    if proc.poll() is not None:
        raise ChildFailed(f"{name} exited at start ({proc.returncode}): {said or 'no output'}{where}")
    raise ChildFailed(f"{name} did not get ready within {timeout:.0f} s{': ' + said if said else ''}{where}")
