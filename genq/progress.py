"""Where every job is, read from Redis alone: the five states of docs/design.md add up to the total.

- queued:    in the dataset's RQ queue (or RQ's intermediate list on its way to a worker), or still
             in the dataset's files, held back by ``enqueue --max-queued`` (the ``in_source`` hash)
- in_flight: started on a worker (RQ's StartedJobRegistry), or a result in the stream not yet on disk
             (or in a checked dataset's unchecked stream, not judged yet)
- retrying:  scheduled by RQ for a later retry, or waiting in a worker between two attempts (the
             worker's ``retrying`` hash; those jobs are in the StartedJobRegistry too and move here)
- done:      record on disk (``done`` bitmap, set only after fsync), unless `genq retry --truncated`
             re-opened it (``extending``): then where its job is; a checked dataset's, accepted or
             not (``check_counts`` says which)
- failed:    error on disk (``failed`` bitmap)

Also the workers registered with RQ and the collector's lag. These are in the contract because
more than the views read them: `genq run` waits on them, the collector's metrics export the lag,
and the tests and benchmarks count with them. The views' own figures (tokens, rates, ETA, the
workers' fields, warnings) are in genq/commands/status.py.
"""

from __future__ import annotations

from typing import Any

import redis
from rq import Worker

from genq import datasets, token_counts
from genq.keys import Keys
from genq.queues import count_unfinished, rq_queue

STATES = ("queued", "in_flight", "retrying", "done", "failed")


def dataset_counts(conn: redis.Redis, keys: Keys) -> dict[str, dict[str, int]]:
    names = list(datasets.load_all(conn, keys))
    waiting = retrying_in_workers(conn, keys)
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.bitcount(keys.enqueued(name))
            count_unfinished(pipe, rq_queue(conn, keys, name), scheduled=True)
            pipe.hget(keys.in_stream, name)
            pipe.hget(keys.in_check, name)
            pipe.bitcount(keys.done(name))
            pipe.bitcount(keys.failed(name))
            pipe.bitcount(keys.extending(name))
            pipe.bitcount(keys.rejected(name))
        pipe.hgetall(keys.in_source)  # in the same round trip as the bitmaps: a push moves both at once
        *raw, in_source = pipe.execute()
    unread = {name.decode(): int(n) for name, n in in_source.items()}
    out: dict[str, dict[str, int]] = {}
    for i, name in enumerate(names):
        total, queued, moving, started, scheduled, streamed, checking, done, failed, extending, rejected = (
            raw[i * 11 : i * 11 + 11]
        )
        backoff = min(waiting.get(name, 0), started)  # a count can only be ahead of RQ's, briefly
        total += unread.get(name, 0)
        counts = {
            "total": total,
            "queued": queued + moving + unread.get(name, 0),
            # In a stream: on the way to disk, or first to the check stage (a checked dataset).
            "in_flight": started - backoff + int(streamed or 0) + int(checking or 0),
            "retrying": scheduled + backoff,
            # A record re-opened by `genq retry --truncated` is counted where its job is until its
            # longer record is on disk.
            "done": done - extending,
            "failed": failed,
        }
        counts["unaccounted"] = total - sum(counts[s] for s in STATES)
        counts["extending"] = extending
        counts["rejected"] = rejected  # rows enqueue refused: not in the total
        out[name] = counts
    return out


VERDICT_COUNTS = ("accepted", "rejected", "surplus", "check_failed", "unjudged")


def check_counts(conn: redis.Redis, keys: Keys, name: str) -> dict[str, int]:
    """A checked dataset's endings the check stage filed, by status (accepted, rejected, surplus,
    check_failed, unjudged; none at 0: one judged again leaves check_failed so)."""
    found = conn.hgetall(keys.verdicts(name))
    return {s.decode(): int(n) for s, n in found.items() if s.decode() in VERDICT_COUNTS and int(n)}


def check_summary(raw: dict[bytes, bytes]) -> dict[str, Any]:
    """The views' figures of a checked dataset's ``verdicts`` hash: each status's count, the share
    accepted of the samples judged, samples judged per accepted one, the checker's mean seconds
    per sample and its failures (tries that raised, hung or crashed; retried); None where unknown."""
    found = {k.decode(): v for k, v in raw.items()}
    counts = {s: int(found.get(s, 0)) for s in VERDICT_COUNTS}
    judged = sum(counts[s] for s in VERDICT_COUNTS if s != "unjudged")
    seconds = float(found.get("seconds", 0))
    return {
        **counts,
        "acceptance": round(counts["accepted"] / judged, 4) if judged else None,
        "samples_per_accepted": round(judged / counts["accepted"], 2) if counts["accepted"] else None,
        "checker_s": round(seconds / judged, 3) if judged else None,
        "checker_errors": int(found.get("checker_errors", 0)),
        # Which checkers judged it (module and its file's hash, or the command), and how many each.
        "checkers": {k[3:][:300]: int(v) for k, v in found.items() if k.startswith("by:")},
        # Why the check stage holds it (its checker failed on records in a row), None while it judges.
        "held": found["held"].decode(errors="replace")[:1000] if found.get("held") else None,
    }


def worker_names(conn: redis.Redis, keys: Keys) -> list[str]:
    """This namespace's workers registered with RQ (a dead one lingers until its hash expires)."""
    head = Worker.redis_worker_namespace_prefix + keys.worker_prefix
    return sorted(
        k[len(Worker.redis_worker_namespace_prefix) :] for k in Worker.all_keys(conn) if k.startswith(head)
    )


def retrying_in_workers(conn: redis.Redis, keys: Keys) -> dict[str, int]:
    """Per dataset, jobs the workers hold between two attempts."""
    with conn.pipeline(transaction=False) as pipe:
        for name in worker_names(conn, keys):
            pipe.hgetall(keys.retrying(name))
        per_worker = pipe.execute()
    out: dict[str, int] = {}
    for counts in per_worker:
        for dataset, n in counts.items():
            out[dataset.decode()] = out.get(dataset.decode(), 0) + int(n)
    return out


def stream_lag(conn: redis.Redis, keys: Keys, now: float | None = None) -> dict[str, Any]:
    """Results not yet on disk, across the datasets' streams: a collector deletes what it
    acknowledges, so a stream's first entry is its oldest one pending, and its id carries the time
    it was added (Redis's clock). With the collector holding each dataset."""
    names = sorted(datasets.load_all(conn, keys))
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.xlen(keys.results(name))
            pipe.xrange(keys.results(name), count=1)
            pipe.get(keys.collector_lease(name))
        pipe.time()
        *raw, (sec, usec) = pipe.execute()
    now = now if now is not None else sec + usec / 1e6
    length, firsts, holders = 0, [], {}
    for name, (n, first, holder) in zip(names, zip(raw[::3], raw[1::3], raw[2::3], strict=True), strict=True):
        length += int(n)
        if first:
            firsts.append(int(first[0][0].split(b"-")[0]) / 1000)
        holders[name] = holder.decode() if holder else None
    distinct = sorted({h for h in holders.values() if h})
    return {
        "length": length,
        "oldest_pending_s": round(max(0.0, now - min(firsts)), 1) if firsts else 0.0,
        # The one collector holding every dataset (the usual case), else each dataset's.
        "collector": distinct[0] if len(distinct) == 1 and all(holders.values()) else None,
        "collectors": holders,
    }


def collector_holds(conn: redis.Redis, keys: Keys, name: str) -> bool:
    """A collector holds the dataset and has reconciled Redis with its files on disk: only then is
    an enqueue's 'already done' complete (a resumed run on a fresh Redis)."""
    lease, ready = conn.mget(keys.collector_lease(name), keys.collector_ready(name))
    return bool(lease) and lease == ready


def finished(counts: dict[str, dict[str, int]]) -> bool:
    """Every enqueued job is on disk, as a record or an error."""
    return all(c["done"] + c["failed"] >= c["total"] for c in counts.values())


def ledger(c: dict[str, int], t: token_counts.Tokens) -> dict[str, int] | None:
    """Where every row read went, summing to ``read`` (rows x samples): stopped (the model
    ended it in one piece), continued (in pieces, then stopped), cut (ended on length: at the cap,
    at --continue-to, or at a full context), failed, rejected at enqueue, and pending (queued, in
    flight, retrying). None where the token counters cannot say (an older genq's run)."""
    if t.length is None or t.continued is None:
        return None
    on_disk = c["done"] + c["extending"]
    cut = t.length - c["extending"]  # a re-opened record ended on length, and is pending again
    counts = {
        "stopped": on_disk - t.length - t.continued,
        "continued": t.continued,
        "cut": cut,
        "failed": c["failed"],
        "rejected": c["rejected"],
        "pending": c["queued"] + c["in_flight"] + c["retrying"],
    }
    if c["unaccounted"]:  # jobs in no state (genq verify says which): the sum stays exact
        counts["unaccounted"] = c["unaccounted"]
    return {**counts, "read": c["total"] + c["rejected"]}
