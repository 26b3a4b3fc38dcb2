"""Child processes of `genq run`: started with the same interpreter, killed with their parent."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import IO

PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int) -> None:
    """Linux: the child gets ``sig`` when `genq run` dies, even by SIGKILL, so nothing is orphaned."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def genq_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "genq", *args]


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
    )


def stop(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, wait up to ``timeout``, then SIGKILL; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float) -> str:
    """The first stdout line of ``proc`` that starts with ``prefix``."""
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
    raise RuntimeError(f"{' '.join(proc.args)} did not print {prefix!r} within {timeout:.0f} s")
