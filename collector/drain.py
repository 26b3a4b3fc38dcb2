"""Drain the result stream to disk: write, flush, fsync, then acknowledge (decision 4).

The dataset bitmaps ``done`` and ``failed`` say which ids are on disk. They are only set in
the same MULTI that acknowledges the entries and moves the file's checkpoint offset, so after
any crash the lines past the checkpoint are re-read from disk at start-up and the replayed
stream entries for them are dropped as duplicates.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import redis
from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry

from collector import metrics
from collector.files import ERRORS, RAW, Appender, cut_torn_tail, scan
from genq import datasets, tokens
from genq.bitmaps import is_set
from genq.failures import reason_of
from genq.keys import Keys
from genq.logprobs import FILE as LOGPROBS
from genq.logprobs import frames as logprobs_frames
from genq.schema import KIND_ERROR, KIND_RECORD, bit_index, error_record, loads, parse_record_id

log = logging.getLogger("genq.collector")

CONSUMER = "collector"
LEASE_TTL_S = 15
# Stop writing this long before the lease could lapse, by this process's own clock: a collector
# cut off from Redis cannot renew it, and another may take over once it lapses.
FENCE_MARGIN_S = 3.0


_DELETE_IF = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# 1: renewed; 2: it was gone (Redis forgot it) and is ours again; 0: another collector holds it.
_RENEW = """
local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then redis.call('expire', KEYS[1], ARGV[2]) return 1 end
if not holder then redis.call('set', KEYS[1], ARGV[1], 'EX', ARGV[2]) return 2 end
return 0
"""


class LeaseHeld(Exception):
    pass


class WriteFailed(Exception):
    """The disk refused a write or an fsync; nothing of the batch was acknowledged."""


def _dead_local(holder: str) -> bool:
    """Whether a lease holder ``host:pid:nonce`` is a process of this host that no longer runs."""
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@dataclass
class Item:
    """One result on its way to disk."""

    kind: bytes
    data: dict
    entry_id: bytes | None  # None for errors the collector itself found (failed registry)
    logprobs: bytes | None = None  # the record's frame for logprobs.bin (genq/logprobs.py)


class Collector:
    def __init__(self, conn: redis.Redis, keys: Keys, out: Path, batch: int = 500):
        self.conn = conn
        self.keys = keys
        self.out = out
        self.batch = batch
        self.lease_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._settings: dict[str, datasets.DatasetSettings] = {}
        self._files: dict[tuple[str, str], Appender] = {}
        self._lease_renewed = 0.0
        self.written = 0
        self.duplicates = 0

    # -- start-up ---------------------------------------------------------------------------

    def acquire_lease(self, wait_s: float = LEASE_TTL_S + 5) -> None:
        """Decision 11: one collector per namespace.

        A holder that is a dead process on this host is replaced at once; any other holder's
        lease is waited out (a dead remote collector's lease lapses within LEASE_TTL_S).
        """
        deadline = time.monotonic() + wait_s
        while not self.conn.set(self.keys.collector_lease, self.lease_id, nx=True, ex=LEASE_TTL_S):
            holder = (self.conn.get(self.keys.collector_lease) or b"").decode()
            if holder and _dead_local(holder):
                log.warning("collector %s died without releasing its lease: taking over", holder)
                self.conn.eval(_DELETE_IF, 1, self.keys.collector_lease, holder)
                continue
            if time.monotonic() > deadline:
                raise LeaseHeld(f"another collector holds namespace {self.keys.namespace!r}: {holder or '?'}")
            time.sleep(0.5)
        self._lease_renewed = time.monotonic()

    def renew_lease(self, force: bool = False) -> None:
        """Keep the lease; take it again if Redis lost it (a failover or a restart from an older
        snapshot forgets recent writes), but never from another collector that holds it."""
        if not force and time.monotonic() - self._lease_renewed < LEASE_TTL_S / 3:
            return
        renewed = self.conn.eval(_RENEW, 1, self.keys.collector_lease, self.lease_id, LEASE_TTL_S)
        if not renewed:
            raise LeaseHeld(f"lost the collector lease of namespace {self.keys.namespace!r}")
        self._lease_renewed = time.monotonic()
        if renewed == 2:
            log.warning(
                "Redis had lost this collector's lease (a failover?): took it again; re-reading the files"
            )
            self.close()
            self._files = {}
            self.reconcile()
            self.conn.set(self.keys.collector_ready, self.lease_id)

    def fence(self) -> None:
        """Self-fencing, checked before every write on this process's own clock (not when Redis
        next answers): past this point the lease may have lapsed and another collector may be
        appending to the same files, so this one stops."""
        if time.monotonic() - self._lease_renewed > LEASE_TTL_S - FENCE_MARGIN_S:
            # Renew first (a collector cut off from Redis blocks here and writes nothing); a lease
            # another collector took meanwhile stops this one (LeaseHeld).
            self.renew_lease(force=True)
        held = time.monotonic() - self._lease_renewed
        if held > LEASE_TTL_S - FENCE_MARGIN_S:
            raise LeaseHeld(
                f"not writing: the collector lease was last renewed {held:.0f} s ago and may lapse "
                f"({LEASE_TTL_S} s); another collector may take over the folder"
            )

    def release_lease(self) -> None:
        self.conn.delete(self.keys.collector_ready)
        self.conn.eval(_DELETE_IF, 1, self.keys.collector_lease, self.lease_id)

    def start(self) -> None:
        self.acquire_lease()
        self.conn.delete(self.keys.collector_ready)
        try:
            self.conn.xgroup_create(self.keys.results, self.keys.results_group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self.reconcile()
        self.conn.set(self.keys.collector_ready, self.lease_id)

    def reconcile(self) -> None:
        """Cut torn lines and mark in Redis every id on disk past the last checkpoint."""
        for name in self._datasets():
            self._reconcile_dataset(name)

    def _reconcile_dataset(self, name: str) -> None:
        for kind, filename in ((KIND_ERROR, ERRORS), (KIND_RECORD, RAW)):
            path = self.out / name / filename
            cut = cut_torn_tail(path)
            if cut:
                log.warning(
                    "%s: cut a torn last line (%d bytes) left by a crash", path, cut, extra={"dataset": name}
                )
            self._reconcile_file(name, kind, path)
        self._reconcile_logprobs(name)

    def _reconcile_logprobs(self, name: str) -> None:
        """Keep the frames past the checkpoint whose record is on disk (marked done just above);
        cut the file from the first one whose record is not: its batch never reached the records
        file, and its entries will be written again when replayed."""
        path = self.out / name / LOGPROBS
        if not path.exists():
            return
        field = str(path)
        offset = int(self.conn.hget(self.keys.collector_offsets, field) or 0)
        size = path.stat().st_size
        offset = 0 if offset > size else offset
        done = self.conn.get(self.keys.done(name)) or b""
        samples = self._settings[name].samples
        keep = offset
        for start, end, record_id, _ in logprobs_frames(path, offset):
            parsed = parse_record_id(record_id, name, samples)
            if parsed is None or not is_set(done, bit_index(*parsed, samples)):
                keep = start
                break
            keep = end
        if keep < size:
            appender = self._files.pop((name, LOGPROBS), None)
            if appender is not None:
                appender.close()
            with path.open("rb+") as fh:
                fh.truncate(keep)
                os.fsync(fh.fileno())
            log.warning(
                "%s: cut %d bytes of frames whose records are not on disk (they are replayed)",
                path,
                size - keep,
                extra={"dataset": name},
            )
        self.conn.hset(self.keys.collector_offsets, field, keep)

    def _reconcile_file(self, name: str, kind: bytes, path: Path) -> None:
        field = str(path)
        size = path.stat().st_size if path.exists() else 0
        offset = int(self.conn.hget(self.keys.collector_offsets, field) or 0)
        if offset > size:
            log.warning("%s is shorter than its checkpoint: re-reading all of it", path)
            offset = 0
        samples = self._settings[name].samples
        # Records whose done bit is still 0 get their tokens counted, in the MULTI that sets the
        # bit: a crash between chunks leaves each chunk counted once or not at all.
        done = (self.conn.get(self.keys.done(name)) or b"") if kind == KIND_RECORD else None
        live = self.conn.hexists(self.keys.tokens(name), "first_at")
        uncounted: list[dict] = []
        seen: set[int] = set()
        marked = 0
        pipe = self.conn.pipeline(transaction=True)
        for _, obj in scan(path, offset):
            index = bit_index(obj["row"], obj["sample"], samples)
            self._mark(pipe, name, kind, index)
            if done is not None and not is_set(done, index) and index not in seen:
                seen.add(index)
                uncounted.append(obj)
            marked += 1
            if len(pipe) >= 3000:
                tokens.add(pipe, self.keys, name, uncounted, None, live)
                pipe.execute()
                uncounted = []
        tokens.add(pipe, self.keys, name, uncounted, None, live)
        pipe.hset(self.keys.collector_offsets, field, size)
        pipe.execute()
        if marked:
            log.info(
                "%s: marked %d ids found on disk past the checkpoint", path, marked, extra={"dataset": name}
            )

    def _mark(self, pipe, name: str, kind: bytes, index: int) -> None:
        pipe.setbit(self.keys.enqueued(name), index, 1)
        if kind == KIND_RECORD:
            pipe.setbit(self.keys.done(name), index, 1)
            pipe.setbit(self.keys.failed(name), index, 0)  # a record beats an earlier error
        else:
            pipe.setbit(self.keys.failed(name), index, 1)

    def _datasets(self) -> list[str]:
        self._settings = datasets.load_all(self.conn, self.keys)
        return list(self._settings)

    # -- draining ---------------------------------------------------------------------------

    def read(self, block_ms: int) -> list[Item]:
        """Entries delivered to us but not acknowledged (after a crash) first, then new ones."""
        for start in ("0", ">"):
            resp = self.conn.xreadgroup(
                self.keys.results_group,
                CONSUMER,
                {self.keys.results: start},
                count=self.batch,
                block=block_ms if start == ">" else None,
            )
            entries = resp[0][1] if resp else []
            if entries:
                return [self._item(entry_id, fields) for entry_id, fields in entries]
        return []

    @staticmethod
    def _item(entry_id: bytes, fields: dict) -> Item:
        return Item(fields[b"kind"], loads(fields[b"data"]), entry_id, fields.get(b"lp"))

    def write(self, items: list[Item]) -> int:
        """Append the new ones, fsync, then mark, checkpoint and acknowledge all in one MULTI."""
        if not items:
            return 0
        started = time.monotonic()
        if {i.data.get("dataset") for i in items} - set(self._settings):
            # A dataset enqueued after start-up may already have files here (a run resumed on
            # a fresh Redis): what they hold must be marked before anything is appended.
            known = set(self._settings)
            for name in set(self._datasets()) - known:
                self._reconcile_dataset(name)
        placed = []
        for item in items:
            name = item.data.get("dataset")
            settings = self._settings.get(name)
            if settings is None:
                log.error(
                    "result for unknown dataset %r (id %s): left in the stream",
                    name,
                    item.data.get("id"),
                    extra={"dataset": name},
                )
                continue
            placed.append((item, name, bit_index(item.data["row"], item.data["sample"], settings.samples)))
        with self.conn.pipeline(transaction=False) as pipe:
            for _, name, index in placed:
                pipe.getbit(self.keys.done(name), index)
                pipe.getbit(self.keys.failed(name), index)
            bits = pipe.execute()
        self.fence()  # right before the files are touched: the reads above may have waited on Redis
        seen: set[tuple[str, int]] = set()
        before = {key: f.synced_size for key, f in self._files.items()}  # where this batch began
        to_mark = []
        new_records: dict[str, list[dict]] = {}
        duplicates = 0
        try:
            for n, (item, name, index) in enumerate(placed):
                done, failed = bits[2 * n], bits[2 * n + 1]
                if (name, index) in seen or done or (item.kind == KIND_ERROR and failed):
                    duplicates += 1
                    continue
                seen.add((name, index))
                if item.logprobs is not None:  # before its line: a frame without a line is cut at start-up
                    self._logprobs_file(name).append_bytes(item.logprobs)
                self._file(name, item.kind).append(item.data)
                to_mark.append((name, item.kind, index))
                if item.kind == KIND_RECORD:
                    new_records.setdefault(name, []).append(item.data)
            # Frames first, lines after: a crash between them leaves frames of records not on disk,
            # which the start-up cuts; never a record whose frame is missing.
            ordered = sorted(self._files.values(), key=lambda f: f.path.name != LOGPROBS)
            offsets = {str(f.path): f.sync() for f in ordered}
        except OSError as exc:
            for key, f in self._files.items():
                with contextlib.suppress(OSError):
                    f.roll_back(before.get(key, f.opened_size))
            raise WriteFailed(f"writing to {self.out} failed: {exc}") from exc
        self.duplicates += duplicates
        now = tokens.redis_now(self.conn) if new_records else None
        with self.conn.pipeline(transaction=True) as pipe:
            for name, kind, index in to_mark:
                self._mark(pipe, name, kind, index)
            for name, records in new_records.items():
                tokens.add(pipe, self.keys, name, records, now, live=True)
            if offsets:
                pipe.hset(self.keys.collector_offsets, mapping=offsets)
            entry_ids = [item.entry_id for item, _, _ in placed if item.entry_id is not None]
            if entry_ids:
                pipe.xack(self.keys.results, self.keys.results_group, *entry_ids)
                pipe.xdel(self.keys.results, *entry_ids)
            for name, count in Counter(n for i, n, _ in placed if i.entry_id is not None).items():
                pipe.hincrby(self.keys.in_stream, name, -count)
            pipe.execute()
        self.written += len(to_mark)
        metrics.written([(n, k) for n, k, _ in to_mark], new_records, duplicates, time.monotonic() - started)
        return len(to_mark)

    def _logprobs_file(self, name: str) -> Appender:
        key = (name, LOGPROBS)
        if key not in self._files:
            self._files[key] = Appender(self.out / name / LOGPROBS)
        return self._files[key]

    def _file(self, name: str, kind: bytes) -> Appender:
        key = (name, RAW if kind == KIND_RECORD else ERRORS)
        if key not in self._files:
            self._files[key] = Appender(self.out / name / key[1])
        return self._files[key]

    # -- jobs RQ failed without a word from a worker ----------------------------------------

    def failed_without_error(self) -> list[Item]:
        """Jobs in RQ's failed registries (a worker died with them once too often) that have no
        line in errors.jsonl yet. Call with the stream drained: a worker adds a job's error to the
        stream before RQ marks the job failed, so what is left has no error of its own."""
        items = []
        for name, settings in self._settings.items():
            queue = Queue(self.keys.queue_name(name), connection=self.conn, serializer="json")
            ids = FailedJobRegistry(queue=queue).get_job_ids()
            if not ids:
                continue
            done = self.conn.get(self.keys.done(name)) or b""
            failed = self.conn.get(self.keys.failed(name)) or b""
            for job_id in ids:
                rid = self.keys.record_id(job_id)
                parsed = parse_record_id(rid, name, settings.samples) if rid else None
                if parsed is None:
                    continue
                index = bit_index(*parsed, settings.samples)
                if is_set(done, index) or is_set(failed, index):
                    continue
                items.append(Item(KIND_ERROR, self._error_of_failed(job_id, rid, name, *parsed), None))
        return items

    def _error_of_failed(self, job_id: str, rid: str, name: str, row: int, sample: int) -> dict:
        exc_string = source_id = None
        try:
            job = Job.fetch(job_id, connection=self.conn, serializer="json")
            source_id = (job.kwargs or {}).get("source_id")
            result = job.latest_result()
            exc_string = result.exc_string if result is not None else None
        except Exception as exc:  # noqa: BLE001 - the reason is a nicety; the error line is not
            log.debug("job %s: could not read its failure (%s)", job_id, exc)
        error, message = reason_of(exc_string)
        attempts = self.conn.hget(self.keys.attempts, job_id)
        return error_record(
            id=rid,
            dataset=name,
            row=row,
            sample=sample,
            source_id=source_id,
            error=error,
            message=message,
            status=None,
            attempts=int(attempts) if attempts is not None else None,
        )

    # -- state ------------------------------------------------------------------------------

    def work_left(self) -> int:
        """Jobs queued or in flight, plus entries in the stream (for --burst)."""
        total = int(self.conn.xlen(self.keys.results))
        with self.conn.pipeline(transaction=False) as pipe:
            for name in datasets.load_all(self.conn, self.keys):
                queue = Queue(self.keys.queue_name(name), connection=self.conn, serializer="json")
                pipe.llen(queue.key)
                pipe.llen(queue.intermediate_queue_key)
                pipe.zcard(queue.started_job_registry.key)
                pipe.zcard(queue.scheduled_job_registry.key)
            return total + sum(pipe.execute())

    def close(self) -> None:
        for f in self._files.values():
            f.close()
