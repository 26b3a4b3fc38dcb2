"""`genq check`'s loop: read checked datasets' endings, judge each with the host's checker, file the
verdict (checker/commit.py). It reads top to bottom like the worker's:

1. Every checked dataset of the namespace (``--dataset`` to narrow) has a consumer group
   ``checkers`` on its unchecked stream; this process is one consumer of it, so N processes on any
   hosts share the work.
2. Up to ``--concurrency`` endings are judged at once, each with ``--timeout``; a live checker
   touches the endings it judges every TOUCH_EVERY_S, so one idle for CLAIM_AFTER_S was held by
   a checker that is gone, and a live one takes it up.
3. Each try of the checker on an ending is counted in Redis first (``check_tries``), so a checker
   that hangs, crashes or is killed with its process is tried ``--max-check-attempts`` times in
   all, then the ending is filed ``check_failed`` — never lost, never retried for ever.
4. A generation that failed (an error) has nothing to judge: it passes through ``unjudged`` (and
   under ``--accept`` its prompt draws the next sample as a rejection does).
5. No reading of a dataset whose results stream holds ``--stream-limit`` entries: its collector
   is behind. ``--burst`` exits once no checked dataset has a job queued, running or unjudged.
6. A checker that fails on FAILS_IN_A_ROW records of a dataset in a row, each tried after the
   dataset's last verdict, is broken, not the records: the dataset is held (said once; ``held`` in
   its verdicts hash, which status shows): its endings wait unjudged, the tries on them given back,
   and one is tried now and then (HOLD_PROBE_S doubling; the one tried least, so one bad record
   cannot keep the hold); the first verdict lifts the hold. A check_failed
   record draws no next sample (checker/commit.py): the checker's failure is no rejection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any

import redis

from genq import datasets, provenance
from genq.checker.commit import VerdictCommit
from genq.checker.runner import Checker, CheckerError
from genq.entries import ENTRY_SPEC, BadEntry, Entry, quarantine, read_entry
from genq.keys import Keys
from genq.queues import count_unfinished, rq_queue
from genq.schema import KIND_ERROR, JobSpec, loads

log = logging.getLogger("genq.check")
BLOCK_MS = 500  # one read waits this long for new endings
CLAIM_EVERY_S = 5.0  # how often endings a dead checker held are looked for
# A live checker touches the endings it is judging this often (XCLAIM to itself: their idle time
# starts again), so one idle for CLAIM_AFTER_S was held by a checker that is gone, however long
# its checks take.
TOUCH_EVERY_S = 10.0
OUTAGE_WAIT_S = 1.0  # between two tries of a Redis that does not answer
IDLE_S = 0.5  # the wait while the namespace has no checked dataset
CLAIM_AFTER_S = 30.0
SETTINGS_EVERY_S = 2.0  # how often new datasets are looked for
# Records of one dataset the checker failed on in a row, each tried after the dataset's last verdict:
# the checker is broken. Three, as the worker's gate counts wrong answers: one or two are the
# records' own (a bad answer the checker chokes on), a third with none judged between is a pattern.
# A try begun before the last verdict is no evidence (the checker worked since it began): without
# that rule, records it hangs on, started together, time out together and hold a working checker
# (CI, tests/test_check_stage.py: 3 of 16 started at once hung on, 20 % of records failing).
FAILS_IN_A_ROW = 3
HOLD_PROBE_S, HOLD_PROBE_MAX_S = 5.0, 60.0  # between tries of a held dataset's checker, doubling


class Held(Exception):
    """The dataset's checker is held as broken: the ending waits, unjudged and not filed."""


@dataclass(frozen=True)
class CheckConfig:
    concurrency: int = 4
    timeout: float = 60.0
    max_attempts: int = 3
    stream_limit: int = 10_000
    burst: bool = False
    datasets: tuple[str, ...] = ()  # only these (empty: every checked dataset)


class CheckLoop:
    def __init__(self, conn: redis.Redis, keys: Keys, checker: Checker, config: CheckConfig) -> None:
        self.conn, self.keys, self.checker, self.config = conn, keys, checker, config
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.commit = VerdictCommit(conn, keys)
        self.settings: dict[str, datasets.DatasetSettings] = {}
        self.judged: dict[str, int] = {}  # status -> endings filed so by this process
        self._tasks: dict[asyncio.Task, tuple[str, bytes]] = {}  # judging: (dataset, entry id)
        self._stopping = asyncio.Event()
        self._settings_at = self._claimed_at = -1e9
        self._touched_at = time.monotonic()
        self._failing: dict[str, set[bytes]] = {}  # dataset -> endings failed on since its last verdict
        self._verdict_at: dict[str, float] = {}  # dataset -> when its checker last gave a verdict
        self._held: dict[str, str] = {}  # dataset -> why its checker is held
        self._probe: dict[str, tuple[float, float]] = {}  # held dataset -> (next try at, delay)
        self._take_back: set[str] = set()  # datasets whose hold was lifted: their waiting endings

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        try:
            while not self._stopping.is_set():
                try:
                    await self._refresh_settings()
                    started = await self._start_free()
                    await self._touch()
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    # Redis away for a while: what is being judged stays pending in the group.
                    log.warning("check %s: Redis did not answer (%s); trying again", self.name, exc)
                    await asyncio.sleep(OUTAGE_WAIT_S)
                    continue
                if self._tasks:
                    await asyncio.wait(self._tasks, timeout=0 if started else 0.2)
                elif not self.settings:  # no checked dataset yet: look again shortly
                    await asyncio.sleep(IDLE_S)
                if self.config.burst and not started and not self._tasks and await self._all_done():
                    break
        finally:
            if self._tasks:  # a stop lets the judgements under way finish (each bounded by --timeout)
                await asyncio.wait(self._tasks)
            await self.checker.close()
        log.info(
            "check %s: %s", self.name, ", ".join(f"{n} {s}" for s, n in sorted(self.judged.items())) or "idle"
        )
        return 0

    async def _refresh_settings(self) -> None:
        now = asyncio.get_running_loop().time()
        if now - self._settings_at < SETTINGS_EVERY_S:
            return
        self._settings_at = now
        found = await asyncio.to_thread(datasets.load_all, self.conn, self.keys)
        wanted = {
            n: s
            for n, s in found.items()
            if s.checked and (not self.config.datasets or n in self.config.datasets)
        }
        for name in set(wanted) - set(self.settings):
            await asyncio.to_thread(self._group, name)
        self.settings = wanted

    def _group(self, name: str) -> None:
        """Take a dataset: join its checkers' group, and record this command as its checker's."""
        provenance.record_command(self.conn, self.keys, name, "check")
        try:
            self.conn.xgroup_create(
                self.keys.unchecked(name), self.keys.checkers_group, id="0", mkstream=True
            )
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _start_free(self) -> int:
        """Start judging as many endings as there is room for; how many were started."""
        free = self.config.concurrency - len(self._tasks)
        if free <= 0 or not self.settings:
            return 0
        read = await asyncio.to_thread(self._read, free)
        for name, entry_id, fields in read:
            task = asyncio.create_task(self._judge(name, entry_id, fields))
            self._tasks[task] = (name, entry_id)
            task.add_done_callback(lambda done: self._tasks.pop(done, None))
        return len(read)

    async def _touch(self) -> None:
        """Every TOUCH_EVERY_S, claim the endings under judgement again for this checker: their
        idle time starts over, so no other checker takes them while this one lives."""
        if time.monotonic() - self._touched_at < TOUCH_EVERY_S:
            return
        self._touched_at = time.monotonic()
        held: dict[str, list[bytes]] = {}
        for name, entry_id in list(self._tasks.values()):
            held.setdefault(name, []).append(entry_id)
        for name, ids in held.items():
            stream, group = self.keys.unchecked(name), self.keys.checkers_group
            await asyncio.to_thread(self.conn.xclaim, stream, group, self.name, 0, ids, justid=True)

    def _read(self, count: int) -> list[tuple[str, bytes, dict]]:
        """Endings to judge: first those a dead checker held (every CLAIM_EVERY_S), then new ones;
        of a held dataset, one new ending when its next try is due."""
        open_ = [n for n in self.settings if self.conn.xlen(self.keys.results(n)) < self.config.stream_limit]
        names = [n for n in open_ if n not in self._held]
        found: list[tuple[str, bytes, dict]] = []
        for name in list(self._take_back):
            found += self._waiting(name, count - len(found))
        for name in (n for n in open_ if n in self._held and self._probe_due(n)):
            # One ending to try the held checker on: one it left waiting (tried least), else a new one.
            probe = self._waiting(name, 1, keep=True)
            if not probe:
                names.append(name)
            found += probe
        if self._claim_due():
            for name in names:
                answer = self.conn.xautoclaim(
                    self.keys.unchecked(name),
                    self.keys.checkers_group,
                    self.name,
                    int(CLAIM_AFTER_S * 1000),
                    count=count - len(found),
                )
                # [next id, entries] on Redis 6.2, [next id, entries, ids deleted meanwhile] on 7.
                claimed = [(name, entry_id, fields) for entry_id, fields in answer[1] if fields]
                if claimed:
                    log.info(
                        "check %s: took up %d endings of %s a checker that is gone held",
                        self.name,
                        len(claimed),
                        name,
                    )
                found += claimed
        if len(found) < count and names:
            streams = {self.keys.unchecked(n): ">" for n in names}
            answer = self.conn.xreadgroup(
                self.keys.checkers_group, self.name, streams, count=count - len(found), block=BLOCK_MS
            )
            by_stream = {self.keys.unchecked(n): n for n in names}
            for stream, entries in answer or []:
                name = by_stream[stream.decode() if isinstance(stream, bytes) else stream]
                found += [(name, entry_id, fields) for entry_id, fields in entries]
        return found

    def _waiting(self, name: str, count: int, keep: bool = False) -> list[tuple[str, bytes, dict]]:
        """Up to ``count`` endings this checker left pending while the dataset was held, taken up at
        once (not after CLAIM_AFTER_S idle, as a gone checker's are); once none is left, the
        dataset's take-back is over (unless ``keep``: a probe's)."""
        stream, group = self.keys.unchecked(name), self.keys.checkers_group
        judging = {entry_id for n, entry_id in self._tasks.values() if n == name}
        pending = self.conn.xpending_range(stream, group, "-", "+", 1000, consumername=self.name)
        if keep:  # a probe: the ending tried least, so a record the checker always fails on is not
            pending = sorted(pending, key=lambda p: p["times_delivered"])  # the only one ever tried
        left = [p["message_id"] for p in pending if p["message_id"] not in judging]
        ids = left[: max(0, count)]
        if not keep and len(ids) == len(left):
            self._take_back.discard(name)
        if not ids:
            return []
        return [(name, i, f) for i, f in self.conn.xclaim(stream, group, self.name, 0, ids) if f]

    def _probe_due(self, name: str) -> bool:
        """A held dataset's next try of its checker is due, and none is under way."""
        at, delay = self._probe[name]
        if time.monotonic() < at or any(n == name for n, _ in self._tasks.values()):
            return False
        self._probe[name] = (time.monotonic() + delay, min(HOLD_PROBE_MAX_S, delay * 2))
        return True

    def _claim_due(self) -> bool:
        now = time.monotonic()
        if now - self._claimed_at < CLAIM_EVERY_S:
            return False
        self._claimed_at = now
        return True

    async def _judge(self, name: str, entry_id: bytes, fields: dict) -> None:
        try:
            await self._judge_one(name, entry_id, fields)
        except Held:
            return  # pending in the group, its try given back: taken up once the hold is lifted
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # Not filed: the ending stays pending, taken up again once idle (CLAIM_AFTER_S).
            log.warning(
                "check %s: %s of %s not filed, Redis did not answer (%s)", self.name, entry_id, name, exc
            )

    async def _judge_one(self, name: str, entry_id: bytes, fields: dict) -> None:
        settings = self.settings[name]
        try:
            entry = read_entry(fields, name, settings.samples)
            spec = _spec(fields, entry) if settings.check.get("accept") else None
        except BadEntry as exc:
            await asyncio.to_thread(self._quarantine, name, entry_id, fields, str(exc))
            return
        started = time.monotonic()
        if entry.kind == KIND_ERROR:
            status, verdict = "unjudged", {}
        else:
            status, verdict = await self._verdict(name, entry_id, entry)
        seconds = time.monotonic() - started
        args = (settings, entry_id, entry, spec, status, verdict, seconds, fields.get(ENTRY_SPEC.encode()))
        applied = await asyncio.to_thread(self.commit.apply, *args)
        self.judged[applied.status] = self.judged.get(applied.status, 0) + 1

    async def _verdict(self, name: str, entry_id: bytes, entry: Entry) -> tuple[str, dict[str, Any]]:
        """(status, verdict) of one record: the checker's, or check_failed once it has failed on
        the record --max-check-attempts times (tries counted in Redis, across processes)."""
        why = "the checker was taken up by a process that died each time"
        while True:
            tries = await asyncio.to_thread(self.conn.hincrby, self.keys.check_tries(name), entry_id, 1)
            if tries > self.config.max_attempts:
                log.warning("%s: %s failed its check %d times: %s", name, entry.record_id, tries - 1, why)
                return "check_failed", {
                    "accepted": False,
                    "score": None,
                    "reason": why,
                    "checker": self.checker.identity,
                }
            begun = time.monotonic()
            try:
                verdict = await self.checker.check(entry.data, self.config.timeout)
            except CheckerError as exc:
                why = str(exc)
                await asyncio.to_thread(self.conn.hincrby, self.keys.verdicts(name), "checker_errors", 1)
                log.warning("%s: the checker failed on %s (try %d): %s", name, entry.record_id, tries, why)
                if self._failed(name, entry_id, why, begun):
                    await asyncio.to_thread(self.conn.hincrby, self.keys.check_tries(name), entry_id, -1)
                    raise Held(why) from exc
                continue
            await self._worked(name)
            status = "accepted" if verdict.accepted else "rejected"
            return status, {**verdict.to_json(), "checker": self.checker.identity}

    def _failed(self, name: str, entry_id: bytes, why: str, begun: float) -> bool:
        """The checker failed on this ending (its try begun at ``begun``): True when the dataset is
        (now) held as broken."""
        if name in self._held:
            return True
        if begun < self._verdict_at.get(name, -1e18):
            return False  # a verdict came while it was tried: the checker works, the record is at fault
        failing = self._failing.setdefault(name, set())
        failing.add(entry_id)
        if len(failing) < FAILS_IN_A_ROW:
            return False
        said = (
            f"the checker {self.checker.identity} failed on {len(failing)} records in a row, none judged "
            f"between (last: {why[:300]}): its records wait unjudged, one tried again now and then; "
            "fix the checker (a new genq check takes them up at once)"
        )
        self._held[name] = said
        self._probe[name] = (time.monotonic() + HOLD_PROBE_S, HOLD_PROBE_S * 2)
        self.conn.hset(self.keys.verdicts(name), "held", said)
        log.error("%s: %s", name, said)
        return True

    async def _worked(self, name: str) -> None:
        """A verdict: the checker works on this dataset (again)."""
        self._failing.pop(name, None)
        self._verdict_at[name] = time.monotonic()
        if self._held.pop(name, None) is not None:
            self._probe.pop(name, None)
            self._take_back.add(name)
            await asyncio.to_thread(self.conn.hdel, self.keys.verdicts(name), "held")
            log.info("%s: the checker judges again: the hold is lifted", name)

    def _quarantine(self, name: str, entry_id: bytes, fields: dict, why: str) -> None:
        with self.conn.pipeline(transaction=True) as pipe:
            quarantine(pipe, self.keys, name, entry_id, fields, why, checked=True)
            pipe.execute()
        log.error(
            "dataset %s: entry %s of %s is not a worker's: %s; moved to its dead letter",
            name,
            entry_id,
            self.keys.unchecked(name),
            why,
        )

    async def _all_done(self) -> bool:
        """No checked dataset has a job queued or running, nor an ending in its unchecked stream."""
        return await asyncio.to_thread(self._nothing_left)

    def _nothing_left(self) -> bool:
        with self.conn.pipeline(transaction=False) as pipe:
            for name in self.settings:
                count_unfinished(pipe, rq_queue(self.conn, self.keys, name))
                pipe.xlen(self.keys.unchecked(name))
            return sum(pipe.execute()) == 0


def _spec(fields: dict, entry: Entry) -> JobSpec:
    """The job's payload an ending carries to the check stage, checked: a sample is drawn from it."""
    raw = fields.get(ENTRY_SPEC.encode())
    if raw is None:
        raise BadEntry(f"no field {ENTRY_SPEC!r} (the job's payload, to draw more samples from)")
    try:
        spec = JobSpec.from_kwargs(loads(raw))
    except ValueError as exc:
        raise BadEntry(f"field {ENTRY_SPEC!r}: {exc}") from None
    if (spec.dataset, spec.row, spec.sample) != (
        entry.data["dataset"],
        entry.data["row"],
        entry.data["sample"],
    ):
        raise BadEntry(f"field {ENTRY_SPEC!r} is another job's payload, not {entry.record_id}'s")
    return spec
