"""Write the result streams to disk: write, flush, fsync, then acknowledge (decision 4).

The dataset bitmaps ``done`` and ``failed`` say which ids are on disk. They are only set in
the same atomic commit (collector/checkpoint.py) that acknowledges the entries and moves the
file's checkpoint offset, so after any crash the lines past the checkpoint are re-read from disk
at start-up and the replayed stream entries for them are dropped as duplicates.

This module owns reading the streams and writing the files. The leases are collector/leases.py,
re-reading files into Redis collector/reconcile.py, RQ's failed jobs collector/rq_failed.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import redis

from genq import datasets as datasets_mod
from genq import progress, provenance, token_counts
from genq.bitmaps import get_bits, set_bits
from genq.collector import metrics, rq_failed
from genq.collector.checkpoint import Checkpoints, Commands, Stale, mark
from genq.collector.files import Appender, Foreign, Unreadable
from genq.collector.leases import Leases
from genq.collector.reconcile import Reconciler
from genq.entries import BadEntry, quarantine, read_entry
from genq.keys import Keys
from genq.logprobs import FILE as LOGPROBS
from genq.logprobs import check as check_frame
from genq.logprobs import without_frame
from genq.queues import count_unfinished, rq_queue
from genq.schema import ERRORS, KIND_ERROR, KIND_RECORD, RAW, REJECTED_SAMPLES, bit_index, supersedes

log = logging.getLogger("genq.collector")

CONSUMER = "collector"  # every holder of a dataset reads as this consumer, and takes its pending entries over
PENDING_CHECK_S = 5.0
ACK_PER_COMMAND = 1000  # entry ids per XACK and XDEL: under the limit of collector/checkpoint.py


class WriteFailed(Exception):
    """The disk refused a write or an fsync; nothing of the batch was acknowledged."""


@dataclass
class Item:
    """One result on its way to disk."""

    kind: bytes
    data: dict
    entry_id: bytes | None  # None for errors the collector itself found (failed registry)
    logprobs: bytes | None = None  # the record's frame for logprobs.bin (genq/logprobs.py)
    dataset: str = ""  # the dataset whose stream (or failed registry) it came from
    fields: dict | None = None  # the stream entry as read, for its dead letter should it be one
    verdict: dict | None = None  # a checked dataset's: what genq check made of it

    @property
    def filename(self) -> str:
        """The file its line goes to: records (accepted ones, of a checked dataset), the records its
        checker did not accept, or errors."""
        if self.kind != KIND_RECORD:
            return ERRORS
        return RAW if self.verdict is None or self.verdict.get("status") == "accepted" else REJECTED_SAMPLES


@dataclass
class _Read:
    """What Redis says of a batch before it is written."""

    bits: dict[tuple[str, int], tuple[int, int, int]]  # (dataset, index) -> (done, failed, extending)
    enqueued: set[tuple[str, int]]  # the (dataset, index) of the batch that were ever enqueued
    now: float  # Redis's clock
    behind: set[str]  # datasets whose checkpoints Redis lost


@dataclass
class _Batch:
    """What a batch put on disk, for its commit."""

    to_mark: list[tuple[str, bytes, int]]  # (dataset, kind, index) of each line appended
    new_records: dict[str, list[dict]]
    extended: dict[str, list[int]]  # re-opened ids whose ending came: their extending bits cleared
    duplicates: int
    moves: dict[str, tuple[int, int]]  # file -> (checkpoint before, size after)


Placed = list[tuple[Item, str, int]]  # (item, dataset, bit index)


class Collector:
    """Drains the result streams of the datasets whose leases it holds into OUT/<dataset>/.

    Decision 11, per dataset: each dataset's stream and files belong to one collector at a time (a
    lease in Redis, collector/leases.py). A collector takes the lease of every dataset it is given
    (``datasets``; all of the namespace's when None) that nobody holds, at start and whenever one
    appears or lapses, so several collectors share a namespace's datasets, and one whose datasets are
    all held waits as a standby for a holder to die. It owns the open files and the reads and writes.
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
        self.leases = Leases(conn, keys)
        self.leases.retake = self._retake
        self._settings: dict[str, datasets_mod.DatasetSettings] = {}
        self._files: dict[tuple[str, str], Appender] = {}
        # Datasets whose streams may hold entries delivered before and never acknowledged (by this
        # collector before a failure, or by the one that held the dataset before): read those first.
        self._unacked: set[str] = set()
        self._pending_checked = time.monotonic()
        # Each file's checkpoint as this collector last committed it: what it read back and
        # verified, never the size of a file another process may still append to (decision 11).
        self._verified: dict[str, int] = {}
        # Datasets whose files could not be reconciled: reported once, left for the operator.
        self.set_aside: set[str] = set()
        self.checkpoints = Checkpoints(conn, keys, self.leases.lease_id)
        self.reconciler = Reconciler(
            conn,
            keys,
            out,
            self.checkpoints,
            self.leases,
            samples=lambda name: self._settings[name].samples,
            close_file=self._close_file,
        )
        self.written = 0
        self.duplicates = 0
        self._warned: set[str] = set()  # provenance warnings already logged

    @property
    def held(self) -> dict[str, float]:
        return self.leases.held

    @property
    def lease_id(self) -> str:
        return self.leases.lease_id

    # -- leases -----------------------------------------------------------------------------

    def claim(self) -> list[str]:
        """Take the lease of every wanted dataset that nobody holds, or whose holder is a dead
        process of this host, and make each ready (its files reconciled with Redis); the newly
        held ones. Another live holder's lease is left alone: it lapses within LEASE_TTL_S if
        that collector is gone."""
        self._settings = datasets_mod.load_all(self.conn, self.keys)
        names = [
            n for n in self._settings if n not in self.held and self._wants(n) and n not in self.set_aside
        ]
        if not names:
            return []
        taken = self.leases.take(names)
        for name in taken:
            self._take_over(name)
        return taken

    def _wants(self, name: str) -> bool:
        return self.wanted is None or name in self.wanted

    def _take_over(self, name: str) -> None:
        # Redis, not this process's clock, says the dataset is still ours: a collector stopped and
        # resumed (SIGSTOP, a paused VM) has a fresh-looking clock and may have lost its lease.
        self.leases.confirm([name])
        self.conn.delete(self.keys.collector_ready(name))
        try:
            self.conn.xgroup_create(self.keys.results(name), self.keys.results_group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._unacked.add(name)
        if not self._reconcile(name):
            return
        try:  # a convenience beside the files (export's tokenizer): never worth stopping for
            datasets_mod.write_file(self._settings[name], self.out / name)
        except OSError as exc:
            log.warning("dataset %s: its settings not written beside its files: %s", name, exc)
        self.conn.set(self.keys.collector_ready(name), self.lease_id)
        log.info("collector %s: holds dataset %s", self.lease_id, name, extra={"dataset": name})
        self.write_provenance()

    def write_provenance(self) -> None:
        """Each held dataset's provenance beside its records (genq/provenance.py), its warnings
        (two models answering it) logged once. A disk that refuses it is said, never a stop."""
        counts = progress.dataset_counts(self.conn, self.keys)  # every dataset's, in one round trip
        for name in list(self.held):
            data = provenance.build(self.conn, self.keys, name, self.out / name / ERRORS, counts)
            if data is None:
                continue
            for warning in data["warnings"]:
                if warning not in self._warned:
                    self._warned.add(warning)
                    log.warning("%s", warning, extra={"dataset": name})
            try:
                provenance.write(self.out / name, data)
            except OSError as exc:
                log.warning("dataset %s: its provenance not written: %s", name, exc, extra={"dataset": name})

    def _reconcile(self, name: str) -> bool:
        """Reconcile the files of ``name`` with Redis once (collector/reconcile.py), its open files
        closed first; whether it is still held. One whose files cannot be read as its lines is set
        aside with one error line, and every other dataset keeps draining."""
        self._close_files(name)
        try:
            self._verified.update(self.reconciler.dataset(name))
            return True
        except Unreadable as exc:
            log.error(
                "dataset %s set aside: %s; its results wait in Redis: move the file aside and "
                "restart the collector (the other datasets keep draining)",
                name,
                exc,
                extra={"dataset": name},
            )
            self.set_aside.add(name)
            self._unacked.discard(name)
            self.leases.drop(name)
            return False

    def _retake(self, name: str) -> None:
        """A lease Redis had lost, taken again: its files are re-read before the next write."""
        self._close_files(name)
        self._take_over(name)

    def renew_leases(self, force: bool = False) -> set[str]:
        """Keep every lease held (collector/leases.py); the datasets taken again."""
        return self.leases.renew(force)

    def fence(self, names: Collection[str]) -> None:
        """Stop (LeaseHeld) before the files of ``names`` are touched if a lease may have lapsed."""
        self.leases.fence(names)

    def release_leases(self) -> None:
        self.leases.release()

    def reconcile(self) -> None:
        """Cut torn lines and mark in Redis every id on disk past the last checkpoint, for every
        dataset held (after a Redis failure: lines may be on disk whose ids were not marked)."""
        self._settings = datasets_mod.load_all(self.conn, self.keys)
        self.leases.confirm(list(self.held))
        for name in list(self.held):
            self._unacked.add(name)
            self._reconcile(name)

    # -- reading ------------------------------------------------------------------------------

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
                    return self._items([(name, entry_id, fields) for entry_id, fields in resp[0][1]])
            self._unacked.discard(name)
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
        return self._items(
            [(streams[stream], entry_id, fields) for stream, got in resp or [] for entry_id, fields in got]
        )

    def _items(self, read: list[tuple[str, bytes, dict]]) -> list[Item]:
        """The entries read, checked (genq/entries.py); those that are not a worker's are moved to
        their dataset's dead letter, one error line each, and the rest go on."""
        items, bad = [], []
        for dataset, entry_id, fields in read:
            settings = self._settings[dataset]
            try:
                entry = read_entry(fields, dataset, settings.samples)
                if settings.checked != (entry.verdict is not None):
                    # Only the check stage writes verdicts, and only there a checked dataset's
                    # record may come from: one without a verdict never passed its checker.
                    raise BadEntry(
                        "a record of a checked dataset without a verdict (genq check writes them)"
                        if settings.checked
                        else "a verdict on a dataset enqueued without --checked"
                    )
            except BadEntry as exc:
                bad.append((dataset, entry_id, fields, str(exc)))
                continue
            items.append(
                Item(entry.kind, entry.data, entry_id, entry.logprobs, dataset, fields, entry.verdict)
            )
        self._quarantine(bad)
        return items

    def _quarantine(self, bad: list[tuple[str, bytes, dict, str]]) -> None:
        """Move each (dataset, entry id, fields, why) to the dataset's dead letter, acknowledged, in
        one MULTI: a run never stops on an entry it cannot write, and nothing of it is lost."""
        if not bad:
            return
        self.fence({dataset for dataset, *_ in bad})
        with self.conn.pipeline(transaction=True) as pipe:
            for dataset, entry_id, fields, why in bad:
                quarantine(pipe, self.keys, dataset, entry_id, fields, why)
            pipe.execute()
        for dataset, entry_id, _, why in bad:
            log.error(
                "dataset %s: entry %s of %s is not a worker's result: %s; moved to %s (genq failed lists it)",
                dataset,
                entry_id.decode(),
                self.keys.results(dataset),
                why,
                self.keys.dead_letter(dataset),
                extra={"dataset": dataset},
            )

    def write(self, items: list[Item]) -> int:
        """Append the new ones, fsync, then mark, checkpoint and acknowledge all in one atomic commit."""
        if not items:
            return 0
        started = time.monotonic()
        self.check_files({item.dataset for item in items if item.dataset in self.held})
        placed = self._place(items)
        if not placed:
            return 0
        by_dataset = _indexes_by_dataset(placed)
        state = self._read_state(by_dataset)
        if state.behind:
            self._lost_writes(state.behind, by_dataset)
            return 0
        placed = self._only_enqueued(placed, state.enqueued)
        if not placed:
            return 0
        by_dataset = _indexes_by_dataset(placed)
        self.fence(by_dataset)  # right before the files are touched: the reads above may have waited on Redis
        try:
            batch = self._append(placed, state.bits, by_dataset)
        except Foreign as exc:
            # Another process wrote to a file while this batch was (a collector that lost its lease
            # resuming late): nothing is committed; the folder is read again, and the batch waits.
            name = exc.path.parent.name
            log.warning("%s: re-reading the files of %s", exc, name, extra={"dataset": name})
            self._retake(name)
            self._unacked.update(by_dataset)
            return 0
        try:
            self.checkpoints.commit(
                batch.moves, lambda c: self._commit_body(c, placed, batch, state.now), fenced=by_dataset
            )
        except Stale:
            # Redis lost writes between the reads above and now: the lines just written are on
            # disk unmarked, and the files are read again into Redis before anything else.
            self._lost_writes(set(by_dataset), by_dataset)
            return 0
        self._verified.update({field: new for field, (_, new) in batch.moves.items()})
        self._count(batch, started)
        return len(batch.to_mark)

    def check_files(self, names: Collection[str] | None = None) -> None:
        """Reconcile, once, each dataset (of ``names``, else every one held) whose files are not as
        this collector left them: removed, replaced, cut, or grown by another writer. Before
        anything more is written or committed for it; cheap (a stat per file)."""
        for name in list(self.held if names is None else names):
            why = self._changed(name)
            if why is not None:
                log.warning("%s: re-reading the files of %s", why, name, extra={"dataset": name})
                self._retake(name)

    def _changed(self, name: str) -> str | None:
        for filename in (RAW, REJECTED_SAMPLES, ERRORS, LOGPROBS):
            f = self._files.get((name, filename))
            if f is not None:
                why = f.changed()
                if why is not None:
                    return why
                continue
            path = self.out / name / filename
            size = path.stat().st_size if path.exists() else 0
            verified = self._verified.get(str(path), 0)
            if size != verified:
                return f"{path} is {size} bytes, not the {verified} this collector verified"
        return None

    def _place(self, items: list[Item]) -> Placed:
        """The items of known datasets, with their bit index; the others are logged and left in
        the stream."""
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
            if name in self.set_aside or name not in self.held:
                continue  # left pending: its next holder reads it
            placed.append((item, name, bit_index(item.data["row"], item.data["sample"], settings.samples)))
        return placed

    def _only_enqueued(self, placed: Placed, enqueued: set[tuple[str, int]]) -> Placed:
        """The items of jobs that were enqueued; an entry of any other id is not a worker's (forged
        into the stream): to the dead letter. Before a bit is set: a bitmap grows to its highest bit."""
        kept, bad = [], []
        for item, name, index in placed:
            if item.entry_id is None or (name, index) in enqueued:
                kept.append((item, name, index))
            else:
                why = f"no job of id {item.data.get('id')!r} was ever enqueued"
                bad.append((name, item.entry_id, item.fields, why))
        self._quarantine(bad)
        return kept

    def _read_state(self, by_dataset: dict[str, list[int]]) -> _Read:
        """The done and failed bits of the batch, Redis's clock, and the datasets whose last
        checkpoints Redis no longer holds."""
        # The bits say which ids are on disk only if Redis still holds this collector's last
        # checkpoints: the offsets are read with them (collector/checkpoint.py).
        synced = {field: (name, size) for name in by_dataset for field, size in self._synced(name).items()}
        with self.conn.pipeline(transaction=False) as pipe:
            for name, indexes in by_dataset.items():
                get_bits(pipe, self.keys.done(name), indexes)
                get_bits(pipe, self.keys.failed(name), indexes)
                get_bits(pipe, self.keys.enqueued(name), indexes)
            pipe.hmget(self.keys.collector_offsets, list(synced))
            pipe.time()  # Redis's clock, for the token rate (genq/token_counts.py)
            *replies, stored, (sec, usec) = pipe.execute()
        kept = zip(synced.values(), stored, strict=True)
        behind = {name for (name, size), value in kept if int(value or 0) != size}
        bits: dict[tuple[str, int], tuple[int, int, int]] = {}
        enqueued: set[tuple[str, int]] = set()
        if not behind:
            per_dataset = iter(replies)
            for name, indexes in by_dataset.items():
                done_bits, failed_bits, ever_bits = next(per_dataset), next(per_dataset), next(per_dataset)
                for index, done, failed, ever in zip(indexes, done_bits, failed_bits, ever_bits, strict=True):
                    bits[name, index] = (done, failed, 0)
                    if ever:
                        enqueued.add((name, index))
            self._read_extending(bits)
        return _Read(bits, enqueued, sec + usec / 1e6, behind)

    def _read_extending(self, bits: dict[tuple[str, int], tuple[int, int, int]]) -> None:
        """The extending bits of the batch's ids already on disk (re-opened by ``genq retry
        --truncated``, or duplicates): read only when there are any, one more round trip then."""
        on_disk: dict[str, list[int]] = {}
        for (name, index), (done, _, _) in bits.items():
            if done:
                on_disk.setdefault(name, []).append(index)
        if not on_disk:
            return
        with self.conn.pipeline(transaction=False) as pipe:
            for name, indexes in on_disk.items():
                get_bits(pipe, self.keys.extending(name), indexes)
            replies = pipe.execute()
        for (name, indexes), extending in zip(on_disk.items(), replies, strict=True):
            for index, ext in zip(indexes, extending, strict=True):
                done, failed, _ = bits[name, index]
                bits[name, index] = (done, failed, ext)

    def _append(
        self,
        placed: Placed,
        bits: dict[tuple[str, int], tuple[int, int, int]],
        by_dataset: dict[str, list[int]],
    ) -> _Batch:
        """Append the lines (and frames) not on disk yet, then fsync; on OSError roll every file
        back to where the batch began and raise WriteFailed. A record already on disk is appended
        again only as its extension (``genq retry --truncated``), which supersedes it."""
        seen: set[tuple[str, int]] = set()
        before = self._verified  # where this batch begins: the last checkpoints
        to_mark = []
        new_records: dict[str, list[dict]] = {}
        extended: dict[str, list[int]] = {}
        duplicates = 0
        try:
            for item, name, index in placed:
                done, failed, extending = bits[name, index]
                if (name, index) in seen:
                    duplicates += 1
                    continue
                # An extension (retry --truncated) or a record judged again (retry --check-failed).
                extension = done and extending and supersedes(item.data)
                if extension:
                    seen.add((name, index))
                    extended.setdefault(name, []).append(index)
                    if item.kind == KIND_ERROR:
                        self._extension_failed(name, item)
                        continue
                elif done or (item.kind == KIND_ERROR and failed):
                    duplicates += 1
                    continue
                seen.add((name, index))
                data, frame = _checked(item)
                if frame is not None:  # before its line: a frame without a line is cut at start-up
                    self._file(name, LOGPROBS).append_bytes(frame)
                self._file(name, item.filename).append(data)
                to_mark.append((name, item.kind, index))
                if item.kind == KIND_RECORD:
                    new_records.setdefault(name, []).append(data)
            # Frames first, lines after: a crash between them leaves frames of records not on disk,
            # which the start-up cuts; never a record whose frame is missing.
            files = [(key, f) for key, f in self._files.items() if key[0] in by_dataset]
            files.sort(key=lambda kf: kf[1].path.name != LOGPROBS)
            moves = {str(f.path): (before.get(str(f.path), 0), f.sync()) for _, f in files}
        except OSError as exc:
            # Every file back to where the batch began, but one another process wrote to: those
            # bytes are not this collector's to cut (the reconciliation reads them).
            foreign = exc.path if isinstance(exc, Foreign) else None
            for f in self._files.values():
                if f.path != foreign:
                    with contextlib.suppress(OSError):
                        f.roll_back(before.get(str(f.path), 0))
            if foreign is not None:
                raise
            raise WriteFailed(f"writing to {self.out} failed: {exc}") from exc
        return _Batch(to_mark, new_records, extended, duplicates, moves)

    def _extension_failed(self, name: str, item: Item) -> None:
        """A re-opened record's job ended without its extension (it failed): the record on disk stands."""
        log.warning(
            "%s: %s was not extended (%s): its record on disk stands; genq failed lists the job, and "
            "genq retry --truncated re-opens it",
            name,
            item.data.get("id"),
            item.data.get("message") or item.data.get("error"),
            extra={"dataset": name},
        )

    def _commit_body(self, commands: Commands, placed: Placed, batch: _Batch, now: float) -> None:
        """The batch's commit: its marks, token counts, acknowledgements and in-stream counts."""
        marks: dict[tuple[str, bytes], list[int]] = {}
        for name, kind, index in batch.to_mark:
            marks.setdefault((name, kind), []).append(index)
        for (name, kind), indexes in marks.items():
            mark(commands, self.keys, name, kind, indexes)
        for name, indexes in batch.extended.items():
            set_bits(commands, self.keys.extending(name), indexes, 0)
        for name, records in batch.new_records.items():
            token_counts.add(commands, self.keys, name, records, now, live=True)
        acked: dict[str, list[bytes]] = {}
        for item, name, _ in placed:
            if item.entry_id is not None:
                acked.setdefault(self.keys.results(name), []).append(item.entry_id)
        for stream, entry_ids in acked.items():
            for at in range(0, len(entry_ids), ACK_PER_COMMAND):
                commands.xack(stream, self.keys.results_group, *entry_ids[at : at + ACK_PER_COMMAND])
                commands.xdel(stream, *entry_ids[at : at + ACK_PER_COMMAND])
        for name, count in Counter(n for i, n, _ in placed if i.entry_id is not None).items():
            commands.hincrby(self.keys.in_stream, name, -count)

    def _count(self, batch: _Batch, started: float) -> None:
        self.duplicates += batch.duplicates
        self.written += len(batch.to_mark)
        elapsed = time.monotonic() - started
        metrics.written([(n, k) for n, k, _ in batch.to_mark], batch.new_records, batch.duplicates, elapsed)

    def _synced(self, name: str) -> dict[str, int]:
        """Each file of dataset ``name`` and the size this collector last committed as its checkpoint
        (what Redis holds unless it lost writes)."""
        fields = [str(self.out / name / filename) for filename in (RAW, REJECTED_SAMPLES, ERRORS, LOGPROBS)]
        return {field: self._verified.get(field, 0) for field in fields}

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
            self._retake(name)
        self._unacked.update(batch)

    def _file(self, name: str, filename: str) -> Appender:
        """The open file ``filename`` of dataset ``name``, opened at its first write."""
        if (name, filename) not in self._files:
            path = self.out / name / filename
            self._files[name, filename] = Appender(path, self._verified.get(str(path), 0))
        return self._files[name, filename]

    # -- jobs RQ failed without a word from a worker ----------------------------------------

    def failed_without_error(self) -> list[Item]:
        """Jobs in RQ's failed registries (a worker died with them once too often) that have no
        line in errors.jsonl yet (collector/rq_failed.py). Call with the stream drained."""
        found = rq_failed.errors(self.conn, self.keys, self.held, self._settings)
        return [Item(KIND_ERROR, error, None, dataset=name) for name, error in found]

    # -- state ------------------------------------------------------------------------------

    def work_left(self) -> int:
        """Jobs of the datasets this collector is for that are queued or in flight, plus their
        entries in the streams (for --burst)."""
        names = [
            n
            for n in datasets_mod.load_all(self.conn, self.keys)
            if self._wants(n) and n not in self.set_aside
        ]
        with self.conn.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.xlen(self.keys.results(name))
                count_unfinished(pipe, rq_queue(self.conn, self.keys, name), scheduled=True)
            return sum(pipe.execute())

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def _close_files(self, name: str) -> None:
        """Forget the open files of one dataset: they are re-read before the next write."""
        for key in [k for k in self._files if k[0] == name]:
            self._files.pop(key).close()

    def _close_file(self, name: str, filename: str) -> None:
        appender = self._files.pop((name, filename), None)
        if appender is not None:
            appender.close()


def _checked(item: Item) -> tuple[dict, bytes | None]:
    """The record and its frame as they go to disk. A frame that is not whole, or not its
    record's (genq/logprobs.py), would end the frames any reader can see: it is left out, with one
    error line, and the record says why."""
    if item.verdict is not None:  # a checked dataset's: its verdict goes with it
        item = dataclasses.replace(item, data={**item.data, "check": item.verdict})
    if item.logprobs is None or item.kind != KIND_RECORD:
        return item.data, None
    meta = item.data.get("logprobs")
    record_id = item.data.get("id")
    why = check_frame(item.logprobs, record_id, meta.get("tokens") if isinstance(meta, dict) else None)
    if why is None:
        return item.data, item.logprobs
    log.error(
        "%s: the logprobs frame of %s is not stored: %s",
        item.dataset,
        record_id,
        why,
        extra={"dataset": item.dataset},
    )
    return {**item.data, "logprobs": without_frame(meta, why)}, None


def _indexes_by_dataset(placed: Placed) -> dict[str, list[int]]:
    by_dataset: dict[str, list[int]] = {}
    for _, name, index in placed:
        by_dataset.setdefault(name, []).append(index)
    return by_dataset
