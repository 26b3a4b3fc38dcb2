"""A continuous-batching latency model: the slower each decode step, the more requests share it.

One coroutine advances every running sequence together (no per-request, per-token sleeps), as a
GPU scheduler runs one batch step for all. A sequence waits in a FIFO queue until a running slot
is free, then spends its prefill time, then decodes one token per step. A step takes
decode_step_s * (1 + decoding / batch_knee): near-flat for small batches, linear past the knee,
so per-request latency grows with concurrency while throughput still rises.

With a KV capacity (``kv_tokens``), every admitted sequence holds prompt + generated-so-far
tokens. Admission looks only at what fits now, not at what decoding will add (SGLang and vLLM
both over-admit that way); when the next step does not fit, the newest running sequence is
retracted (SGLang, ``schedule_batch.py`` retract_decode) or preempted (vLLM, recompute) back to
the head of the queue, and its whole KV (prompt + output so far) is prefilled again on
re-admission, stalling the batch for that long: work paid for twice.
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
    retracted: bool = False  # back in the queue: its KV must be recomputed on re-admission
    ready_at: float = 0.0
    running_since: float | None = None
    abort_message: str | None = None
    abort_status: int | None = None  # an abort the client sees as an HTTP error (503 timeouts)

    @property
    def finished(self) -> bool:
        return self.future.done()

    @property
    def kv(self) -> int:
        """KV-cache tokens it holds while running: the prompt and what it has generated."""
        return self.prompt_tokens + self.done


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
    kv_tokens: int | None = None  # KV-cache capacity in tokens; None: never the limit


@dataclass(eq=False)
class BatchScheduler:
    """Runs the latency model; start() it inside the event loop, stop() it on shutdown."""

    params: LatencyParams
    _waiting: deque[Sequence] = field(default_factory=deque)
    _active: list[Sequence] = field(default_factory=list)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None
    retracted: int = 0  # sequences sent back to the queue for lack of KV, since start
    recomputed_tokens: int = 0  # KV tokens prefilled again because of those
    _stall_s: float = 0.0  # recompute time the next step pays

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def kv_used(self) -> int:
        return sum(s.kv for s in self._active)

    def set_kv_tokens(self, kv_tokens: int | None) -> None:
        """Change the KV capacity while running (a smaller or larger GPU, another model's share)."""
        self.params.kv_tokens = kv_tokens
        self._wake.set()

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

    def _fits(self, seq: Sequence) -> bool:
        """Its KV fits now (decode growth not reserved); an empty batch takes anything."""
        capacity = self.params.kv_tokens
        return capacity is None or not self._active or self.kv_used + seq.kv <= capacity

    def _admit(self, now: float) -> None:
        while self._waiting and len(self._active) < self.params.max_running and self._fits(self._waiting[0]):
            seq = self._waiting.popleft()
            if seq.running_since is None:
                seq.running_since = now
            prefill = seq.kv if seq.retracted else seq.prompt_tokens
            if seq.retracted:
                seq.retracted = False
                self.recomputed_tokens += seq.kv
                self._stall_s += seq.kv * self.params.prefill_per_token_s
            seq.ready_at = now + prefill * self.params.prefill_per_token_s
            self._active.append(seq)

    def _retract(self, decoding: list[Sequence], steps: int) -> None:
        """Send the newest sequences back to the queue until the next `steps` fit in the KV cache."""
        capacity = self.params.kv_tokens
        if capacity is None:
            return
        while len(decoding) > 1 and self.kv_used + len(decoding) * steps > capacity:
            seq = decoding.pop()
            self._active.remove(seq)
            seq.retracted = True
            self._waiting.appendleft(seq)
            self.retracted += 1

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
            finished = [s for s in decoding if s.done >= s.steps]
            for seq in finished:
                self._finish(seq)
            if finished:
                continue  # their slots and KV are free: admit before the next step
            if not decoding:
                await self._idle(now)
                continue
            # Several steps per tick keep CPU low; stop early where a sequence ends so its time is exact.
            steps = min(self.params.tokens_per_tick, min(s.steps - s.done for s in decoding))
            self._retract(decoding, steps)
            step_s = self.params.decode_step_s * (1.0 + len(decoding) / self.params.batch_knee)
            stall, self._stall_s = self._stall_s, 0.0
            await asyncio.sleep(steps * step_s + stall)
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
