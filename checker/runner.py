"""Running the user's checker on one record at a time, bounded: a timeout per record, a process per
slot, a killed process for a checker that hangs, and every failure one :class:`CheckerError`.

Two kinds, one small interface (as genq's backends are): :class:`PythonChecker` (``--check
module:function``: long-lived ``genq.checker.host`` processes, one per slot, fed a record a line) and
:class:`CommandChecker` (``--check-cmd CMD``: one process per record, the record on its stdin, the
verdict on its stdout, for checkers in other languages or sandboxes). Their ``identity`` (the
module file's hash, or the command) is recorded with the dataset: which checker judged it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import json
import os
import shlex
import signal
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from genq.checker.host import search_working_folder
from genq.checker.verdict import CheckerError, Verdict, verdict_of

MAX_ANSWER_BYTES = 1 << 20  # a checker's answer beyond this is its failure, not read further
START_TIMEOUT_S = 60.0  # a Python checker's process: imports and the module's own start-up


class Checker(ABC):
    """Judges records; ``check`` raises CheckerError when the checker fails on one."""

    identity: str

    @abstractmethod
    async def check(self, record: dict[str, Any], timeout: float) -> Verdict:
        """The verdict on ``record`` within ``timeout`` seconds."""

    async def close(self) -> None:  # noqa: B027 - a command checker holds nothing between records
        """Stop whatever the checker keeps running."""


class PythonChecker(Checker):
    """``--check module:function``: ``slots`` processes of ``genq.checker.host``, a record at a time each."""

    def __init__(self, target: str, option_pairs: list[str], slots: int) -> None:
        self.argv = [sys.executable, "-P", "-m", "genq.checker.host", target, *option_pairs]
        # What judged: the function, its module file's hash and its options (part of the judgement).
        self.identity = " ".join([target, module_digest(target), *option_pairs])
        self._idle: asyncio.Queue[_Host | None] = asyncio.Queue()
        for _ in range(slots):
            self._idle.put_nowait(None)  # a slot whose process starts on first use
        self._hosts: set[_Host] = set()

    async def check(self, record: dict[str, Any], timeout: float) -> Verdict:
        host = await self._idle.get()
        try:
            if host is None:
                host = await _Host.start(self.argv)
                self._hosts.add(host)
            return await host.ask(record, timeout)
        except CheckerError:
            if host is not None and not host.alive():
                self._hosts.discard(host)
                host = None  # the next use of this slot starts a new process
            raise
        finally:
            self._idle.put_nowait(host)

    async def close(self) -> None:
        for host in self._hosts:
            await host.stop()
        self._hosts.clear()


class _Host:
    """One ``genq.checker.host`` process: a record a line in, an answer a line out."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, argv: list[str]) -> _Host:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=MAX_ANSWER_BYTES,
            start_new_session=True,  # its own process group: a kill takes whatever it started too
        )
        host = cls(proc)
        try:
            await host._answer(START_TIMEOUT_S, "start")
        except CheckerError:
            await host.stop()
            raise
        return host

    def alive(self) -> bool:
        return self.proc.returncode is None

    async def ask(self, record: dict[str, Any], timeout: float) -> Verdict:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(record).encode() + b"\n")
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            await self.stop()
            raise CheckerError(f"the checker's process is gone (exit {self.proc.returncode})") from exc
        answer = await self._answer(timeout, "answer")
        if "error" in answer:
            raise CheckerError(str(answer["error"]))
        return verdict_of(answer.get("verdict"))

    async def _answer(self, timeout: float, what: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(timeout):
                line = await self.proc.stdout.readline()
        except TimeoutError as exc:
            await self.stop()
            raise CheckerError(
                f"the checker did not {what} within {timeout:g} s (its process killed)"
            ) from exc
        except ValueError as exc:  # a line over the limit
            await self.stop()
            raise CheckerError(f"the checker's answer is over {MAX_ANSWER_BYTES:,} bytes") from exc
        if not line:
            await self.stop()
            raise CheckerError(f"the checker's process exited ({self.proc.returncode}) before its {what}")
        try:
            answer = json.loads(line)
        except ValueError as exc:
            raise CheckerError(f"the checker's {what} is not JSON") from exc
        if not isinstance(answer, dict):
            raise CheckerError(f"the checker's {what} is not a JSON object")
        return answer

    async def stop(self) -> None:
        await kill_group(self.proc)


class CommandChecker(Checker):
    """``--check-cmd CMD``: CMD (split like a shell would, run without one) for each record."""

    def __init__(self, command: str) -> None:
        self.argv = shlex.split(command)
        if not self.argv:
            raise CheckerError("--check-cmd is empty")
        self.identity = command

    async def check(self, record: dict[str, Any], timeout: float) -> Verdict:
        proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: a kill takes whatever it started too
        )
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        try:
            async with asyncio.timeout(timeout):
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    proc.stdin.write(json.dumps(record).encode())
                    await proc.stdin.drain()
                    proc.stdin.close()
                out, err = await asyncio.gather(
                    proc.stdout.read(MAX_ANSWER_BYTES + 1), proc.stderr.read(MAX_ANSWER_BYTES)
                )
                code = await proc.wait()
        except TimeoutError as exc:
            raise CheckerError(f"the checker did not answer within {timeout:g} s (killed)") from exc
        finally:
            await kill_group(proc)
        if code != 0:
            tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
            raise CheckerError(f"the checker exited {code}: {tail[0][:300]}")
        if len(out) > MAX_ANSWER_BYTES:
            raise CheckerError(f"the checker's answer is over {MAX_ANSWER_BYTES:,} bytes")
        try:
            return verdict_of(json.loads(out))
        except ValueError as exc:
            raise CheckerError(f"the checker's answer is not JSON: {out[:80]!r}") from exc


async def kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the process's group (a shell's ``sleep`` holds its pipes open after the shell is
    gone, and asyncio's wait() waits for the pipes), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()


def module_digest(target: str) -> str:
    """sha256 of the checker's module file, found without running it: which code judged."""
    name = target.partition(":")[0]
    search_working_folder()  # where the checker's process looks too
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or not Path(spec.origin).is_file():
        raise CheckerError(
            f"--check {target!r}: no module {name!r} on this host's Python path nor in the working folder "
            f"({os.getcwd()}): run genq check where the module is, or put its folder on PYTHONPATH"
        )
    return "sha256:" + hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()[:16]
