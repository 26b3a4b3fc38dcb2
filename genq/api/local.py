"""`genq run` on this machine, started and stopped from Python (a notebook's cells, a script).

:class:`LocalRun` starts ``genq run --serve`` as a child process: the private Redis persisted in
``OUT/.redis``, the simulator or the given server, the workers and the collector, kept up for the
datasets its :class:`~genq.api.client.Client` enqueues. The child dies with the process that
started it (Linux's parent-death signal, genq/commands/processes.py: a kernel killed or
restarted takes the run's processes with it, which stop in order); :meth:`LocalRun.stop` and
interpreter exit stop it too. Started again on the same ``out`` it resumes: the queue, the
bitmaps and the files are where they were.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
from pathlib import Path

from genq.api.client import Client, connect
from genq.api.errors import GenqError, UsageError
from genq.commands.processes import ChildFailed, genq_command, spawn, stop, wait_for_line
from genq.commands.run import SERVING, STOP_S

READY_S = 120.0  # Redis, the simulator or a server's probe, the collector and the workers


class LocalRun:
    """The all-in-one local run of `genq run`, kept up until :meth:`stop`. ``simulate`` starts the
    bundled simulator (of ``backend``'s API), else ``server`` is used; ``workers``,
    ``concurrency``, ``sim_latency`` and ``trust_remote_code`` are `genq run`'s flags."""

    def __init__(
        self,
        out: str | os.PathLike[str],
        *,
        simulate: bool = False,
        server: str | None = None,
        backend: str = "auto",
        workers: int = 2,
        concurrency: int | str = "auto",
        sim_latency: str = "realistic",
        namespace: str | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        if simulate == bool(server):
            raise UsageError("give exactly one of simulate=True or server=URL")
        self.out = Path(out)
        self.argv = ["run", "--serve", "--out", str(self.out), "--backend", backend]
        self.argv += ["--workers", str(workers), "--concurrency", str(concurrency)]
        self.argv += ["--simulate", "--sim-latency", sim_latency] if simulate else []
        self.argv += ["--namespace", namespace] if namespace else []
        self.argv += ["--trust-remote-code"] if trust_remote_code else []
        self.server = server  # given: kept as given (a key in it never goes to argv or a log)
        self.proc: subprocess.Popen | None = None
        self.client: Client | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def log(self) -> Path:
        """`genq run`'s own lines (its children log to ``OUT/.logs/`` beside it)."""
        return self.out / ".logs" / "run.log"

    def start(self, timeout: float = READY_S) -> Client:
        """Start the run (resuming what ``out`` holds) and return its client once it takes datasets."""
        if self.running:
            assert self.client is not None
            return self.client
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {"GENQ_SERVER": self.server} if self.server else {}  # out of argv
        with self.log.open("ab") as log:
            # SIGTERM when this process dies: `genq run` then stops its children in order.
            self.proc = spawn(
                genq_command(*self.argv),
                death_signal=signal.SIGTERM,
                env=env,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        atexit.register(self.stop)
        try:
            line = wait_for_line(self.proc, SERVING, timeout, self.log)
        except ChildFailed as exc:
            self.stop()
            raise GenqError(f"genq run: {exc}") from None
        served, backend = line[len(SERVING) :].rsplit(" ", 1)
        self.client = connect(out=self.out, server=self.server or served, backend=backend)
        return self.client

    def stop(self, timeout: float = STOP_S * 2) -> None:
        """Stop the run: the workers drain (what is in flight finishes or goes back to the queue),
        then the collector, the server and Redis. Started again, it resumes."""
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is not None:
            stop([self.proc], timeout)
            self.proc = None
        atexit.unregister(self.stop)

    def __enter__(self) -> Client:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
