"""Drain the result stream to disk: write, flush, fsync, then acknowledge (decision 4).

The dataset bitmaps ``done`` and ``failed`` say which ids are on disk. They are only set in
the same atomic commit (collector/checkpoint.py) that acknowledges the entries and moves the
file's checkpoint offset, so after any crash the lines past the checkpoint are re-read from disk
at start-up and the replayed stream entries for them are dropped as duplicates.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import redis
from rq.job import Job
from rq.registry import FailedJobRegistry

from collector import metrics
from collector.checkpoint import Checkpoints, Commands, Stale
from collector.files import Appender, cut_torn_tail, scan
from genq import datasets as datasets_mod
from genq import token_counts
from genq.bitmaps import get_bits, is_set, set_bits
from genq.failures import reason_of
from genq.keys import Keys
from genq.logprobs import FILE as LOGPROBS
from genq.logprobs import frames as logprobs_frames
from genq.queues import rq_queue
from genq.schema import (
    ERRORS,
    KIND_ERROR,
    KIND_RECORD,
    RAW,
    bit_index,
    entry_data,
    entry_kind,
    entry_logprobs,
    error_record,
    parse_record_id,
)

log = logging.getLogger("genq.collector")

CONSUMER = "collector"  # every holder of a dataset reads as this consumer, and takes its pending entries over
PENDING_CHECK_S = 5.0
LEASE_TTL_S = 15
# Stop writing this long before the lease could lapse, by this process's own clock: a collector
# cut off from Redis cannot renew it, and another may take over once it lapses.
FENCE_MARGIN_S = 3.0
RECONCILE_CHUNK = 3000  # lines marked per checkpoint move when files are re-read
RECONCILE_TRIES = 5
ACK_PER_COMMAND = 1000  # re-reads of a dataset restarted because Redis lost writes meanwhile


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
    dataset: str = ""  # the dataset whose stream (or failed registry) it came from
    stream: str = ""  # the stream to acknowledge it in ("": none)


class Collector:
    """Drains the result streams of the datasets whose leases it holds into OUT/<dataset>/.

    Decision 11, per dataset: each dataset's stream and files belong to one collector at a time (a
    lease in Redis). A collector takes the lease of every dataset it is given (``datasets``; all of
    the namespace's when None) that nobody holds, at start and whenever one appears or lapses, so
    several collectors share a namespace's datasets, and one whose datasets are all held waits as a
    standby for a holder to die.
    """

    def __init__(
        self,
        conn: redis.Redis,
        keys: Keys,
        out: Path,
        batch: int = 500,
        datasets: Collection[str] | None = None,
    ):
        self.conn = conn
        self.keys = keys
        self.out = out
        self.batch = batch
        self.wanted = frozenset(datasets) if datasets else None
        self.lease_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.held: dict[str, float] = {}  # dataset -> when its lease was last renewed (monotonic)
        self._settings: dict[str, datasets_mod.DatasetSettings] = {}
        self._files: dict[tuple[str, str], Appender] = {}
        # Datasets whose streams may hold entries delivered before and never acknowledged (by this
        # collector before a failure, or by the one that held the dataset before): read those first.
        self._unacked: set[str] = set()
        self._pending_checked = time.monotonic()
        self._legacy = False  # the stream of older releases holds entries (looked at by claim)
        self._renew = conn.register_script(_RENEW)
        self.checkpoints = Checkpoints(conn, keys.collector_offsets)
        self.written = 0
        self.duplicates = 0

    # -- leases -----------------------------------------------------------------------------

    def claim(self) -> list[str]:
        """Take the lease of every wanted dataset that nobody holds, or whose holder is a dead
        process of this host, and make each ready (its files reconciled with Redis); the newly
        held ones. Another live holder's lease is left alone: it lapses within LEASE_TTL_S if
        that collector is gone."""
        self._settings = datasets_mod.load_all(self.conn, self.keys)
        self._legacy = bool(self.conn.xlen(self.keys.legacy_results))
        names = [n for n in self._settings if n not in self.held and self._wants(n)]
        if not names:
            return []
        renewed = time.monotonic()  # before the SETs: the leases run from no later than this
        with self.conn.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.set(self.keys.collector_lease(name), self.lease_id, nx=True, ex=LEASE_TTL_S)
                pipe.get(self.keys.collector_lease(name))
            replies = pipe.execute()
        taken = []
        for name, got, holder in zip(names, replies[::2], replies[1::2], strict=True):
            holder = (holder or b"").decode()
            if not got and holder and _dead_local(holder):
                log.warning("collector %s died holding dataset %s: taking over", holder, name)
                self.conn.eval(_DELETE_IF, 1, self.keys.collector_lease(name), holder)
                got = self.conn.set(self.keys.collector_lease(name), self.lease_id, nx=True, ex=LEASE_TTL_S)
            if got:
                self.held[name] = renewed
                taken.append(name)
        for name in taken:
            self._take_over(name)
        return taken

    def _wants(self, name: str) -> bool:
        return self.wanted is None or name in self.wanted

    def _take_over(self, name: str) -> None:
        self.conn.delete(self.keys.collector_ready(name))
        try:
            self.conn.xgroup_create(self.keys.results(name), self.keys.results_group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._unacked.add(name)
        self._reconcile_dataset(name)
        self.conn.set(self.keys.collector_ready(name), self.lease_id)
        log.info("collector %s: holds dataset %s", self.lease_id, name, extra={"dataset": name})

    def renew_leases(self, force: bool = False) -> set[str]:
        """Keep every lease held, in one round trip once a third of the TTL has passed; take one
        again if Redis lost it (a failover or a restart from an older snapshot forgets recent
        writes), but never from another collector: a lease another holds stops this one. The
        datasets taken again (their files re-read)."""
        now = time.monotonic()
        if not self.held or (not force and all(now - t < LEASE_TTL_S / 3 for t in self.held.values())):
            return set()
        names = list(self.held)
        with self.conn.pipeline(transaction=False) as pipe:
            for name in names:
                self._renew(
                    keys=[self.keys.collector_lease(name)], args=[self.lease_id, LEASE_TTL_S], client=pipe
                )
            replies = pipe.execute()
        lost = [name for name, renewed in zip(names, replies, strict=True) if not renewed]
        if lost:
            raise LeaseHeld(
                f"lost the collector lease of {', '.join(lost)} in namespace {self.keys.namespace!r}"
            )
        retaken = set()
        for name, renewed in zip(names, replies, strict=True):
            self.held[name] = now
            if renewed == 2:
                retaken.add(name)
                log.warning(
                    "Redis had lost this collector's lease of %s (a failover?): took it again; "
                    "re-reading its files",
                    name,
                    extra={"dataset": name},
                )
                self._close_files(name)
                self._take_over(name)
        return retaken

    def fence(self, names: Collection[str]) -> None:
        """Self-fencing, checked before the files of ``names`` are touched, on this process's own
        clock (not when Redis next answers): past this point a lease may have lapsed and another
        collector may be appending to the same files, so this one stops."""
        if any(self._held_for(n) > LEASE_TTL_S - FENCE_MARGIN_S for n in names):
            # Renew first (a collector cut off from Redis blocks here and writes nothing); a lease
            # another collector took meanwhile stops this one (LeaseHeld).
            self.renew_leases(force=True)
        for name in names:
            held = self._held_for(name)
            if held > LEASE_TTL_S - FENCE_MARGIN_S:
                raise LeaseHeld(
                    f"not writing: the collector lease of {name} was last renewed {held:.0f} s ago and "
                    f"may lapse ({LEASE_TTL_S} s); another collector may take over its folder"
                )

    def _held_for(self, name: str) -> float:
        renewed = self.held.get(name)
        return float("inf") if renewed is None else time.monotonic() - renewed

    def release_leases(self) -> None:
        with self.conn.pipeline(transaction=False) as pipe:
            for name in self.held:
                pipe.eval(_DELETE_IF, 1, self.keys.collector_ready(name), self.lease_id)
                pipe.eval(_DELETE_IF, 1, self.keys.collector_lease(name), self.lease_id)
            pipe.execute()
        self.held = {}

    def reconcile(self) -> None:
        """Cut torn lines and mark in Redis every id on disk past the last checkpoint, for every
        dataset held (after a Redis failure: lines may be on disk whose ids were not marked)."""
        self._settings = datasets_mod.load_all(self.conn, self.keys)
        for name in list(self.held):
            self._unacked.add(name)
            self._reconcile_dataset(name)

    def _reconcile_dataset(self, name: str) -> None:
        # Reconciling writes too (torn tails cut, checkpoints, done bits, token counts): a collector
        # that was cut off must know it still holds the folder before it touches any of it.
        self.fence([name])
        for tries in range(RECONCILE_TRIES):
            try:
                for kind, filename in ((KIND_ERROR, ERRORS), (KIND_RECORD, RAW)):
                    path = self.out / name / filename
                    cut = cut_torn_tail(path)
                    if cut:
                        log.warning(
                            "%s: cut a torn last line (%d bytes) left by a crash",
                            path,
                            cut,
                            extra={"dataset": name},
                        )
                    self._reconcile_file(name, kind, path)
                self._reconcile_logprobs(name)
                return
            except Stale:
                if tries + 1 == RECONCILE_TRIES:
                    raise
                log.warning("Redis lost writes while %s was re-read: reading it again", name)

    def _reconcile_logprobs(self, name: str) -> None:
        """Keep the frames past the checkpoint whose record is on disk (marked done just above);
        cut the file from the first one whose record is not: its batch never reached the records
        file, and its entries will be written again when replayed."""
        path = self.out / name / LOGPROBS
        if not path.exists():
            return
        field = str(path)
        (stored,) = self.checkpoints.read([field])
        size = path.stat().st_size
        offset = 0 if stored > size else stored
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
        self.checkpoints.commit({field: (stored, keep)})

    def _reconcile_file(self, name: str, kind: bytes, path: Path) -> None:
        """Mark the ids of the lines past the checkpoint, moving it a chunk at a time: each chunk's
        marks and token counts land with its checkpoint move, or (Stale) not at all."""
        field = str(path)
        size = path.stat().st_size if path.exists() else 0
        (stored,) = self.checkpoints.read([field])
        offset = stored
        if offset > size:
            log.warning("%s is shorter than its checkpoint: re-reading all of it", path)
            offset = 0
        samples = self._settings[name].samples
        # Records whose done bit is still 0 get their tokens counted, with the chunk that sets the
        # bit: a crash between chunks leaves each chunk counted once or not at all.
        done = (self.conn.get(self.keys.done(name)) or b"") if kind == KIND_RECORD else None
        live = self.conn.hexists(self.keys.tokens(name), "first_at")
        uncounted: list[dict] = []
        seen: set[int] = set()
        marked = 0
        indexes: list[int] = []

        def body(commands: Commands) -> None:
            self._mark(commands, name, kind, indexes)
            token_counts.add(commands, self.keys, name, uncounted, None, live)

        for end, obj in scan(path, offset):
            index = bit_index(obj["row"], obj["sample"], samples)
            indexes.append(index)
            if done is not None and not is_set(done, index) and index not in seen:
                seen.add(index)
                uncounted.append(obj)
            marked += 1
            if len(indexes) >= RECONCILE_CHUNK:
                self.checkpoints.commit({field: (stored, end)}, body)
                stored, indexes, uncounted = end, [], []
        self.checkpoints.commit({field: (stored, size)}, body)
        if marked:
            log.info(
                "%s: marked %d ids found on disk past the checkpoint", path, marked, extra={"dataset": name}
            )

    def _mark(self, pipe, name: str, kind: bytes, indexes: list[int]) -> None:
        set_bits(pipe, self.keys.enqueued(name), indexes)
        if kind == KIND_RECORD:
            set_bits(pipe, self.keys.done(name), indexes)
            set_bits(pipe, self.keys.failed(name), indexes, 0)  # a record beats an earlier error
        else:
            set_bits(pipe, self.keys.failed(name), indexes)

    # -- draining ---------------------------------------------------------------------------

    def read(self, block_ms: int) -> list[Item]:
        """From the streams of the datasets held: entries delivered before but not acknowledged
        (after a crash, a failed write, or under the previous holder) first, then new ones."""
        try:
            return self._read(block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._lost_writes(list(self.held))  # a Redis from before the group was made
            return []

    def _read(self, block_ms: int) -> list[Item]:
        if time.monotonic() - self._pending_checked > PENDING_CHECK_S:
            # A read sent before a partition can reach Redis after it, and deliver entries to
            # nobody: they wait, delivered but unread, until a collector reads its pending ones.
            self._pending_checked = time.monotonic()
            self._unacked.update(self.held)
        for name in list(self._unacked):
            if name in self.held:
                resp = self.conn.xreadgroup(
                    self.keys.results_group, CONSUMER, {self.keys.results(name): "0"}, count=self.batch
                )
                if resp and resp[0][1]:
                    return [self._item(name, entry_id, fields) for entry_id, fields in resp[0][1]]
            self._unacked.discard(name)
        if self._legacy and self.wanted is None and set(self.held) >= set(self._settings):
            items = self._read_legacy()
            if items:
                return items
        if not self.held:
            time.sleep(block_ms / 1000)
            return []
        resp = self.conn.xreadgroup(
            self.keys.results_group,
            CONSUMER,
            {self.keys.results(name): ">" for name in self.held},
            count=self.batch,
            block=block_ms,
        )
        streams = {self.keys.results(name).encode(): name for name in self.held}
        return [
            self._item(streams[stream], entry_id, fields)
            for stream, entries in resp or []
            for entry_id, fields in entries
        ]

    def _item(self, dataset: str | None, entry_id: bytes, fields: dict, stream: str | None = None) -> Item:
        data = entry_data(fields)
        dataset = dataset or data.get("dataset", "")
        stream = stream or self.keys.results(dataset)
        return Item(entry_kind(fields), data, entry_id, entry_logprobs(fields), dataset, stream)

    def _read_legacy(self) -> list[Item]:
        """The single stream of releases before per-dataset streams (an upgrade mid-run), read
        by a collector that holds every dataset: its pending entries, then new ones."""
        stream = self.keys.legacy_results
        for start in ("0", ">"):
            resp = self.conn.xreadgroup(self.keys.results_group, CONSUMER, {stream: start}, count=self.batch)
            entries = resp[0][1] if resp else []
            items = [self._item(None, entry_id, fields, stream) for entry_id, fields in entries]
            # An entry of a dataset no longer registered stays where it is, as in any stream.
            items = [item for item in items if item.dataset in self.held]
            if items:
                return items
        self._legacy = False  # looked at again at the next claim
        return []

    def write(self, items: list[Item]) -> int:
        """Append the new ones, fsync, then mark, checkpoint and acknowledge all in one atomic commit."""
        if not items:
            return 0
        started = time.monotonic()
        placed = []
        for item in items:
            name = item.dataset
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
        if not placed:
            return 0
        by_dataset: dict[str, list[int]] = {}
        for _, name, index in placed:
            by_dataset.setdefault(name, []).append(index)
        # The bits say which ids are on disk only if Redis still holds this collector's last
        # checkpoints: the offsets are read with them (collector/checkpoint.py).
        synced = {field: (name, size) for name in by_dataset for field, size in self._synced(name).items()}
        with self.conn.pipeline(transaction=False) as pipe:
            for name, indexes in by_dataset.items():
                get_bits(pipe, self.keys.done(name), indexes)
                get_bits(pipe, self.keys.failed(name), indexes)
            pipe.hmget(self.keys.collector_offsets, list(synced))
            pipe.time()  # Redis's clock, for the token rate (genq/token_counts.py)
            *replies, stored, (sec, usec) = pipe.execute()
        kept = zip(synced.values(), stored, strict=True)
        behind = {name for (name, size), value in kept if int(value or 0) != size}
        if behind:
            self._lost_writes(behind, by_dataset)
            return 0
        bits: dict[tuple[str, int], tuple[int, int]] = {}
        pairs = iter(replies)
        for name, indexes in by_dataset.items():
            done_bits, failed_bits = next(pairs), next(pairs)
            for index, done, failed in zip(indexes, done_bits, failed_bits, strict=True):
                bits[name, index] = (done, failed)
        self.fence(by_dataset)  # right before the files are touched: the reads above may have waited on Redis
        seen: set[tuple[str, int]] = set()
        before = {key: f.synced_size for key, f in self._files.items()}  # where this batch began
        to_mark = []
        new_records: dict[str, list[dict]] = {}
        duplicates = 0
        try:
            for item, name, index in placed:
                done, failed = bits[name, index]
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
            files = [(key, f) for key, f in self._files.items() if key[0] in by_dataset]
            files.sort(key=lambda kf: kf[1].path.name != LOGPROBS)
            moves = {str(f.path): (before.get(key, f.opened_size), f.sync()) for key, f in files}
        except OSError as exc:
            for key, f in self._files.items():
                with contextlib.suppress(OSError):
                    f.roll_back(before.get(key, f.opened_size))
            raise WriteFailed(f"writing to {self.out} failed: {exc}") from exc
        now = sec + usec / 1e6

        def body(commands: Commands) -> None:
            marks: dict[tuple[str, bytes], list[int]] = {}
            for name, kind, index in to_mark:
                marks.setdefault((name, kind), []).append(index)
            for (name, kind), indexes in marks.items():
                self._mark(commands, name, kind, indexes)
            for name, records in new_records.items():
                token_counts.add(commands, self.keys, name, records, now, live=True)
            acked: dict[str, list[bytes]] = {}
            for item, _, _ in placed:
                if item.entry_id is not None:
                    acked.setdefault(item.stream, []).append(item.entry_id)
            for stream, entry_ids in acked.items():
                for at in range(0, len(entry_ids), ACK_PER_COMMAND):
                    commands.xack(stream, self.keys.results_group, *entry_ids[at : at + ACK_PER_COMMAND])
                    commands.xdel(stream, *entry_ids[at : at + ACK_PER_COMMAND])
            for name, count in Counter(n for i, n, _ in placed if i.entry_id is not None).items():
                commands.hincrby(self.keys.in_stream, name, -count)

        try:
            self.checkpoints.commit(moves, body)
        except Stale:
            # Redis lost writes between the reads above and now: the lines just written are on
            # disk unmarked, and the files are read again into Redis before anything else.
            self._lost_writes(set(by_dataset), by_dataset)
            return 0
        self.duplicates += duplicates
        self.written += len(to_mark)
        metrics.written([(n, k) for n, k, _ in to_mark], new_records, duplicates, time.monotonic() - started)
        return len(to_mark)

    def _synced(self, name: str) -> dict[str, int]:
        """Each file of dataset ``name`` and the size this collector last committed as its checkpoint
        (what Redis holds unless it lost writes)."""
        sizes = {}
        for filename in (RAW, ERRORS, LOGPROBS):
            path = self.out / name / filename
            f = self._files.get((name, filename))
            if f is not None:
                sizes[str(path)] = f.synced_size
            else:
                sizes[str(path)] = path.stat().st_size if path.exists() else 0
        return sizes

    def _lost_writes(self, names: Collection[str], batch: Collection[str] = ()) -> None:
        """Redis does not hold this collector's last writes to ``names`` (it restarted from an older
        snapshot, or failed over to a replica that missed them): take them over again, reading the
        files past the checkpoints it kept. The batch's entries stay pending, are read again next,
        and dropped if on disk."""
        log.warning(
            "Redis lost this collector's last writes of %s (a restart from an older snapshot, or a "
            "failover?): re-reading the files past the checkpoints it kept",
            ", ".join(sorted(names)),
        )
        # The lease first: Redis may have lost it too, and another collector must not take it
        # meanwhile (a lease another holds by now stops this one).
        retaken = self.renew_leases(force=True)
        for name in set(names) - retaken:
            self._close_files(name)
            self._take_over(name)
        self._unacked.update(batch)

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
        for name in self.held:
            settings = self._settings[name]
            queue = rq_queue(self.conn, self.keys, name)
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
                error = self._error_of_failed(job_id, rid, name, *parsed)
                items.append(Item(KIND_ERROR, error, None, dataset=name))
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
        """Jobs of the datasets this collector is for that are queued or in flight, plus their
        entries in the streams (for --burst)."""
        names = [n for n in datasets_mod.load_all(self.conn, self.keys) if self._wants(n)]
        with self.conn.pipeline(transaction=False) as pipe:
            for name in names:
                queue = rq_queue(self.conn, self.keys, name)
                pipe.xlen(self.keys.results(name))
                pipe.llen(queue.key)
                pipe.llen(queue.intermediate_queue_key)
                pipe.zcard(queue.started_job_registry.key)
                pipe.zcard(queue.scheduled_job_registry.key)
            if self.wanted is None:
                pipe.xlen(self.keys.legacy_results)
            return sum(pipe.execute())

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def _close_files(self, name: str) -> None:
        """Forget the open files of one dataset: they are re-read before the next write."""
        for key in [k for k in self._files if k[0] == name]:
            self._files.pop(key).close()
