"""A continuous-batching latency model: the slower each decode step, the more requests share it.

One coroutine advances every running sequence together (no per-request, per-token sleeps), as a
GPU scheduler runs one batch step for all. A sequence waits in a FIFO queue until a running slot
is free, then spends its prefill time, then decodes one token per step. A step takes
decode_step_s * (1 + decoding / batch_knee): near-flat for small batches, linear past the knee,
so per-request latency grows with concurrency while throughput still rises.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field


class QueueFull(Exception):
    """More sequences are waiting than max_queued allows (SGLang: "The request queue is full.")."""


@dataclass(eq=False)
class Sequence:
    """One request's decode work; `future` resolves with the number of steps actually done."""

    prompt_tokens: int
    steps: int
    future: asyncio.Future[int]
    done: int = 0
    ready_at: float = 0.0
    running_since: float | None = None
    abort_message: str | None = None
    abort_status: int | None = None  # an abort the client sees as an HTTP error (503 timeouts)

    @property
    def finished(self) -> bool:
        return self.future.done()


@dataclass
class LatencyParams:
    """Timing of the modelled GPU; see the module docstring for how they combine."""

    decode_step_s: float = 0.020
    batch_knee: float = 64.0
    prefill_per_token_s: float = 50e-6
    tokens_per_tick: int = 8
    max_running: int = 256
    max_queued: int | None = None
    running_timeout_s: float | None = None  # SGLANG_REQ_RUNNING_TIMEOUT


@dataclass(eq=False)
class BatchScheduler:
    """Runs the latency model; start() it inside the event loop, stop() it on shutdown."""

    params: LatencyParams
    _waiting: deque[Sequence] = field(default_factory=deque)
    _active: list[Sequence] = field(default_factory=list)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def submit(self, prompt_tokens: int, steps: int) -> Sequence:
        """Queue a sequence of `steps` decode steps whose prefill covers prompt_tokens."""
        limit = self.params.max_queued
        if limit is not None and len(self._waiting) >= limit and len(self._active) >= self.params.max_running:
            raise QueueFull("The request queue is full.")
        seq = Sequence(prompt_tokens, steps, asyncio.get_running_loop().create_future())
        self._waiting.append(seq)
        self._wake.set()
        return seq

    async def progress(self) -> None:
        """Return once the model has done work (health_generate: any output counts; when idle,
        its own 1-token generation makes that happen)."""
        try:
            seq = self.submit(1, 1)
        except QueueFull:
            return  # refusing it was output too
        try:
            await seq.future
        finally:
            self.abort(seq, "health check done")

    def abort(self, seq: Sequence, message: str, status: int | None = None) -> None:
        """Stop a sequence where it is; its future resolves with the steps done so far."""
        if seq.finished:
            return
        seq.abort_message = message
        seq.abort_status = status
        with contextlib.suppress(ValueError):
            self._waiting.remove(seq)
        with contextlib.suppress(ValueError):
            self._active.remove(seq)
        seq.future.set_result(seq.done)
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-batch-scheduler")

    async def stop(self, message: str = "Server is shutting down.") -> None:
        """Abort everything still queued or running, then end the loop."""
        for seq in [*self._waiting, *self._active]:
            self.abort(seq, message)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _admit(self, now: float) -> None:
        while self._waiting and len(self._active) < self.params.max_running:
            seq = self._waiting.popleft()
            seq.running_since = now
            seq.ready_at = now + seq.prompt_tokens * self.params.prefill_per_token_s
            self._active.append(seq)

    def _finish(self, seq: Sequence) -> None:
        self._active.remove(seq)
        seq.future.set_result(seq.done)

    async def _idle(self, now: float) -> None:
        """Sleep until something arrives or the next prefill ends."""
        timeout = min((s.ready_at for s in self._active), default=None)
        self._wake.clear()
        if timeout is None:
            await self._wake.wait()
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, timeout - now))

    async def _run(self) -> None:
        while True:
            now = time.monotonic()
            self._admit(now)
            decoding = [s for s in self._active if s.ready_at <= now]
            for seq in [s for s in decoding if s.done >= s.steps]:
                self._finish(seq)
                decoding.remove(seq)
            if not decoding:
                await self._idle(now)
                continue
            step_s = self.params.decode_step_s * (1.0 + len(decoding) / self.params.batch_knee)
            # Several steps per tick keep CPU low; stop early where a sequence ends so its time is exact.
            steps = min(self.params.tokens_per_tick, min(s.steps - s.done for s in decoding))
            await asyncio.sleep(steps * step_s)
            for seq in decoding:
                if not seq.finished:
                    seq.done += steps
            self._time_out(time.monotonic())

    def _time_out(self, now: float) -> None:
        """scheduler.py _poll_timeout_aborts: a request running past the limit gets a 503."""
        limit = self.params.running_timeout_s
        if limit is None:
            return
        for seq in [s for s in self._active if s.running_since is not None and now - s.running_since > limit]:
            if seq.done < seq.steps:
                self.abort(seq, "Request running timeout reached.", 503)
