"""``--concurrency auto``: how many jobs this worker keeps in flight, steered by the server's load.

Too few and the server's batch is not full; too many and it over-admits, then retracts (SGLang)
or preempts (vLLM) and recomputes, and every job waits longer. Errors come too late to steer by
(vLLM absorbs hundreds of requests without a 429), so :class:`Concurrency` reads the server's own
load (``Backend.load()``, about once a second) and moves one target between a floor and the
ceiling (``--max-concurrency``), AIMD-style so that several workers on one server converge
without oscillating:

- shrink ×0.7 on new retractions/preemptions, ×0.85 on a long waiting queue or a growing one,
  and by its share of the excess as soon as every batch slot the server has (``max_running``;
  learned from its queue where it does not say, vLLM) is busy and more wait than refill the
  slots as they free (a few; more, up to the slots, where slots are seen idle while this worker's
  jobs are on their way): such a queue adds latency, not work (a server that does
  not publish its queue, llama.cpp without /metrics: down to the slots when this worker alone
  has more in flight than it has);
- hold while a small queue keeps the batch fed, the KV cache is nearly full, every slot is busy,
  or this worker is not using its target (no jobs, draining);
- grow otherwise: from the start (TCP's slow start, 4 steers a second) ×2, or at once to every
  free batch slot, while the KV cache would hold every job at its longest (prompt +
  max_new_tokens; a server that publishes no cache size, llama.cpp, is bounded by its slots
  alone) and the server has not pushed back (a queue, a retraction); then ×1.25 while the KV
  cache is under half full (and no shrink for CAREFUL steers), else by 1/16; never past what
  the KV cache holds in steady state: jobs at every stage of their output at once, each holding
  on average its prompt and half its output, with three standard deviations of margin for the
  moments when many are late in their lives (its usage now lags: each running job's cache
  grows with its output, so usage alone would over-admit).

Where the server says nothing of its load (hosted APIs), the per-token latency of the answers
against its minimum steers instead, and each 429 is a shrink. With ``--concurrency N`` the
target is N and never moves.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from genq.backends.load import Load
from genq.worker.config import WorkerConfig

STEER_EVERY_S = 1.0
# While the slow start lasts: a short run must not wait seconds for the batch to fill (the server's
# load is one small GET; 4 a second for a few seconds).
STEER_STARTING_S = 0.25
FLOOR = 8  # never fewer in flight under auto (bounded by the ceiling)
START = 32
LOG_EVERY_S = 10.0
KV_TARGET = 0.90  # grow while the KV cache is less full than this
KV_FULL = 0.95  # the steady-state bound: the cache this full, Z standard deviations above the mean
Z = 3.0
KV_EASY = 0.50  # far below: grow fast
SHRINK_PREEMPTED = 0.7
SHRINK_QUEUE = 0.85
GROW_FAST = 1.25
SLOW_START = 2.0  # the growth while even the longest jobs fit and the server has not pushed back
USING = 0.8  # a target is in use when this share of it is in flight
# The latency gradient (minimum per-token latency / recent): below SLOW shrink, above FAST grow.
SLOW, FAST = 0.5, 0.8
MIN_DRIFT = 1.01  # the minimum creeps up each steer, so a change of model or server is learned
FOOTPRINTS = 256  # the last answers whose prompt and output tokens estimate a job's KV footprint
# Steers after a shrink that shrink no further: jobs already in flight must end before it shows.
SETTLE = 3
# Steers after a shrink that grow only gently (TCP's congestion avoidance after slow start).
CAREFUL = 10


@dataclass
class Concurrency:
    """Owns the in-flight target; the Worker starts jobs up to ``target``."""

    target: int
    floor: int
    ceiling: int
    auto: bool = False
    reason: str = "fixed"  # why it last moved
    _why: dict[bool, str] = field(default_factory=dict)  # why it last went up (True) and down (False)
    _preempted: int | None = None
    _waiting: int = 0
    _samples: list[float] = field(default_factory=list)  # seconds per output token, since the last steer
    _min_per_token: float | None = None
    _rate_limited: int = 0
    _logged: tuple[float, int] | None = None  # (when, target) of the last log line
    _settling: int = 0
    _since_shrink: int = CAREFUL
    _answers: deque[tuple[int, int]] = field(
        default_factory=lambda: deque(maxlen=FOOTPRINTS)
    )  # (prompt, output)
    _longest: deque[int] = field(default_factory=lambda: deque(maxlen=FOOTPRINTS))  # prompt + max_new
    _slow_start: bool = True
    _slots: int | None = None  # the batch's slots, learned where the server does not say
    _refill: int = 0  # the queue that keeps the slots fed, learned from slots seen idle

    @classmethod
    def of(cls, config: WorkerConfig) -> Concurrency:
        """--concurrency N: N, never moved; auto: from START, between FLOOR and the ceiling."""
        if config.concurrency is not None:
            return cls(config.concurrency, config.concurrency, config.concurrency)
        floor = min(FLOOR, config.ceiling)
        return cls(max(floor, min(START, config.ceiling)), floor, config.ceiling, auto=True, reason="start")

    # -- what the Worker tells it -----------------------------------------------------------

    def started(self, prompt_tokens: int | None, max_new_tokens: int) -> None:
        """A job starts: what it holds of the KV cache at most, where its prompt's length is known
        now (token ids), so the first steer can fill the batch before any answer is back."""
        if self.auto and prompt_tokens is not None:
            self._longest.append(prompt_tokens + max_new_tokens)

    def answered(
        self, seconds: float, output_tokens: int, prompt_tokens: int, max_new_tokens: int, started: bool
    ) -> None:
        """A send came back with an answer: a latency sample for servers without a load signal,
        what one job holds of the KV cache at its end (prompt and output), and at most (unless
        :meth:`started` counted it: ``started``)."""
        if self.auto:  # cleared at each steer; a fixed target is never steered
            self._samples.append(seconds / max(1, output_tokens))
            self._answers.append((prompt_tokens, output_tokens))
            if not started:
                self._longest.append(prompt_tokens + max_new_tokens)

    def every(self) -> float:
        """Seconds until the next steer: short while the target is still growing from its start."""
        return STEER_STARTING_S if self._slow_start else STEER_EVERY_S

    def rate_limited(self) -> None:
        self._rate_limited += 1

    # -- steering ---------------------------------------------------------------------------

    def steer(self, load: Load | None, busy: int) -> bool:
        """One step from the server's load (None: it publishes none) and the jobs in flight;
        True if the target moved."""
        if not self.auto:
            return False
        new, reason = self._from_load(load, busy) if load is not None else self._from_latency(busy)
        self._samples.clear()
        self._rate_limited = 0
        new = max(self.floor, min(self.ceiling, new))
        if new < self.target and self._settling:
            new = self.target
        shrunk = new < self.target
        self._settling = SETTLE if shrunk else max(0, self._settling - 1)
        self._since_shrink = 0 if shrunk else self._since_shrink + 1
        if new == self.target:
            return False
        self._why[new > self.target] = reason
        self.target, self.reason = new, reason
        return True

    def _times(self, factor: float) -> int:
        if factor < 1:
            return int(self.target * factor)
        if self._since_shrink < CAREFUL:
            return self._gently()
        return max(self.target + 1, int(self.target * factor))

    def _gently(self) -> int:
        return self.target + max(1, self.target // 16)

    def _from_load(self, load: Load, busy: int) -> tuple[int, str]:
        """The next target from the server's load."""
        new_preempted = 0
        if load.preempted is not None:
            if self._preempted is not None and load.preempted >= self._preempted:
                new_preempted = load.preempted - self._preempted
            self._preempted = load.preempted
        waiting, running = load.waiting, load.running or 0
        growing = waiting is not None and waiting > self._waiting
        self._waiting = waiting or 0
        load = self._learn_slots(load, max(2, running // 16), new_preempted)
        if (
            load.max_running
            and running < load.max_running
            and not waiting
            and busy > running
            and self.target >= load.max_running
        ):
            # Slots idle, nothing queued, and jobs of this worker on their way: the slots free
            # faster than answers come back and new requests reach the server (a fast step, a
            # busy client), so the queue that refills them must be longer.
            self._refill = min(load.max_running, max(4, 2 * self._refill))
        # The queue that refills the slots as they free: a few, or what idle slots have shown.
        small = max(2, running // 16, self._refill)
        if new_preempted or (waiting is not None and waiting > small):
            self._slow_start = False
        full = bool(load.max_running) and running >= (load.max_running or 0)
        if full:
            self._slow_start = False
        if new_preempted:
            return self._times(SHRINK_PREEMPTED), f"{new_preempted} requests retracted or preempted"
        if full and waiting is not None and waiting > small:
            # Every slot busy: a queue beyond what refills the slots freeing is latency, not work.
            # This worker takes back its share of the excess (several workers: each its own).
            excess = math.ceil((waiting - small) * busy / max(1, running + waiting))
            return self.target - excess, f"{waiting} requests waiting for {load.max_running} busy slots"
        if full and waiting is None and busy > running + small:
            # The queue unpublished: this worker alone has more in flight than the slots take.
            return running + small, f"{busy} in flight for {load.max_running} busy slots"
        if waiting is not None and waiting > max(8, running // 4):
            return self._times(SHRINK_QUEUE), f"{waiting} requests waiting"
        if waiting is not None and waiting > small and growing:
            return self._times(SHRINK_QUEUE), f"waiting queue growing ({waiting})"
        if waiting is not None and waiting > small:
            return self.target, f"{waiting} requests waiting"
        if load.kv_usage is not None and load.kv_usage >= KV_TARGET:
            return self.target, f"KV cache {load.kv_usage:.0%} full"
        if full:
            return self.target, f"all {load.max_running} slots busy"
        if busy < USING * self.target:
            return self.target, f"{busy} in flight, under the target"
        at_server = running + (waiting or 0)
        if self._slow_start:
            longest = self._room_longest(load, at_server)
            if longest is None and load.max_running and not load.kv_tokens:
                # The cache's size unpublished (llama.cpp: a slot's cache is its own): the slots
                # are the bound, and a server that over-admits still says so by retracting.
                longest = load.max_running - at_server
            if longest is not None and longest > 0:
                new = max(self.target + 1, int(self.target * SLOW_START))
                if load.max_running and at_server < load.max_running:  # fill every slot at once
                    new = max(new, self.target + load.max_running - at_server)
                return min(
                    new, self.target + longest
                ), "even the longest jobs fit the KV cache, nothing waiting (slow start)"
            if longest is not None:
                self._slow_start = False
        room = self._room_steady(load, at_server)
        if room is not None and room <= 0:
            return self.target, f"the KV cache is full in steady state with {at_server} jobs"
        new, reason = self._grow(load)
        return (new if room is None else min(new, self.target + room)), reason

    def _learn_slots(self, load: Load, small: int, new_preempted: int) -> Load:
        """``load`` with the batch's slot count where the server does not publish it (vLLM's
        ``--max-num-seqs``): requests waiting while the KV cache has room and nothing was taken
        back are waiting for a slot, so the running count is the slots (the most seen so)."""
        if load.max_running is not None:
            return load
        if (
            load.running
            and (load.waiting or 0) > small
            and load.kv_usage is not None
            and load.kv_usage < KV_TARGET
            and not new_preempted
        ):
            self._slots = max(self._slots or 0, load.running)
        return dataclasses.replace(load, max_running=self._slots) if self._slots else load

    def _room_longest(self, load: Load, at_server: int) -> int | None:
        """How many more jobs the KV cache holds (KV_TARGET of it) beyond those at the server now,
        were every job at its longest (prompt + max_new_tokens): None until the capacity and
        the jobs are known."""
        if not load.kv_tokens or not self._longest:
            return None
        return int(KV_TARGET * load.kv_tokens / statistics.fmean(self._longest)) - at_server

    def _room_steady(self, load: Load, at_server: int) -> int | None:
        """How many more jobs like the recent answers the KV cache holds beyond those at the server
        now, in steady state: N running jobs, each at a uniformly spread stage of its output and
        each answer as likely to be running as it is long, hold on average N times one job's mean,
        with a standard deviation of sqrt(N) times one job's; the largest N whose mean plus Z
        deviations fits KV_FULL of the cache. None until the capacity and answers are known."""
        if not load.kv_tokens or not self._answers:
            return None
        # One job at a uniform stage u of its output holds p + u*o: mean p + o/2, and
        # E[(p + u*o)^2] = p^2 + p*o + o^2/3. A job runs for as long as its output: the jobs
        # running at any moment are the recent answers weighted by their output (long ones stay).
        weight = sum(max(1, o) for _, o in self._answers)
        mean = sum(max(1, o) * (p + o / 2) for p, o in self._answers) / weight
        square = sum(max(1, o) * (p * p + p * o + o * o / 3) for p, o in self._answers) / weight
        spread = Z * math.sqrt(max(0.0, square - mean * mean))
        cache = KV_FULL * load.kv_tokens
        root = (-spread + math.sqrt(spread * spread + 4 * mean * cache)) / (2 * mean)  # sqrt(N)
        return int(root * root) - at_server

    def _grow(self, load: Load) -> tuple[int, str]:
        if load.kv_usage is not None and load.kv_usage >= KV_EASY:
            return self._gently(), f"KV cache {load.kv_usage:.0%} full, nothing waiting"
        usage = f"KV cache {load.kv_usage:.0%} full" if load.kv_usage is not None else "capacity free"
        return self._times(GROW_FAST), f"{usage}, nothing waiting"

    def _from_latency(self, busy: int) -> tuple[int, str]:
        """The next target from the answers' per-token latency and 429s (no load signal)."""
        self._slow_start = False  # steered by answers, which take their time to come
        if self._rate_limited:
            return self._times(SHRINK_PREEMPTED), f"{self._rate_limited} answers 429 (rate limited)"
        if not self._samples:
            return self.target, "no answers to time"
        recent = statistics.median(self._samples)
        floor = self._min_per_token
        self._min_per_token = recent if floor is None else min(recent, floor * MIN_DRIFT)
        gradient = self._min_per_token / recent if recent > 0 else 1.0
        if gradient < SLOW:
            return self._times(SHRINK_QUEUE), f"per-token latency {1 / gradient:.1f}× its minimum"
        if gradient > FAST and busy >= USING * self.target:
            return self._gently(), f"per-token latency {1 / gradient:.2f}× its minimum"
        return self.target, f"per-token latency {1 / gradient:.2f}× its minimum"

    def log_line(self, now: float) -> str | None:
        """What to log about the target: at most one line every LOG_EVERY_S, only if it moved, with
        the last reason it moved that way."""
        if self._logged is None:
            self._logged = (now, self.target)
            return None
        when, logged = self._logged
        if self.target == logged or now - when < LOG_EVERY_S:
            return None
        self._logged = (now, self.target)
        return f"concurrency {logged} -> {self.target} ({self._why[self.target > logged]})"
