"""Where every job is, read from Redis alone: the five states of docs/design.md add up to the total.

- queued:    in the dataset's RQ queue (or RQ's intermediate list on its way to a worker), or still
             in the dataset's files, held back by ``enqueue --max-queued`` (the ``in_source`` hash)
- in_flight: started on a worker (RQ's StartedJobRegistry), or a result in the stream not yet on disk
- retrying:  scheduled by RQ for a later retry, or waiting in a worker between two attempts (the
             worker's ``retrying`` hash; those jobs are in the StartedJobRegistry too and move here)
- done:      record on disk (``done`` bitmap, set only after fsync)
- failed:    error on disk (``failed`` bitmap)

Plus what the views need around them: tokens and rates (genq/tokens.py), the workers alive (RQ's
worker hashes with genq's fields), and the collector's lag.
"""

from __future__ import annotations

from typing import Any

import redis
from rq import Queue, Worker
from rq.utils import utcparse

from genq import datasets, tokens
from genq.keys import Keys

STATES = ("queued", "in_flight", "retrying", "done", "failed")


def dataset_counts(conn: redis.Redis, keys: Keys) -> dict[str, dict[str, int]]:
    names = list(datasets.load_all(conn, keys))
    waiting = retrying_in_workers(conn, keys)
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            queue = Queue(keys.queue_name(name), connection=conn, serializer="json")
            pipe.bitcount(keys.enqueued(name))
            pipe.llen(queue.key)
            pipe.llen(queue.intermediate_queue_key)
            pipe.zcard(queue.started_job_registry.key)
            pipe.hget(keys.in_stream, name)
            pipe.zcard(queue.scheduled_job_registry.key)
            pipe.bitcount(keys.done(name))
            pipe.bitcount(keys.failed(name))
        pipe.hgetall(keys.in_source)  # in the same round trip as the bitmaps: a push moves both at once
        *raw, in_source = pipe.execute()
    unread = {name.decode(): int(n) for name, n in in_source.items()}
    out: dict[str, dict[str, int]] = {}
    for i, name in enumerate(names):
        total, queued, moving, started, streamed, scheduled, done, failed = raw[i * 8 : i * 8 + 8]
        backoff = min(waiting.get(name, 0), started)  # a count can only be ahead of RQ's, briefly
        total += unread.get(name, 0)
        counts = {
            "total": total,
            "queued": queued + moving + unread.get(name, 0),
            "in_flight": started - backoff + int(streamed or 0),
            "retrying": scheduled + backoff,
            "done": done,
            "failed": failed,
        }
        counts["unaccounted"] = total - sum(counts[s] for s in STATES)
        out[name] = counts
    return out


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


def workers(conn: redis.Redis, keys: Keys, now: float) -> list[dict[str, Any]]:
    """Workers alive: RQ's fields (host, pid, jobs done and failed, heartbeat) and genq's (server,
    in flight, retrying, failed attempts), the latter None until the worker's first report."""
    names = worker_names(conn, keys)
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(Worker.redis_worker_namespace_prefix + name)
        hashes = pipe.execute()
    out = []
    for name, raw in zip(names, hashes, strict=True):
        if not raw:
            continue
        h = {k.decode(): v.decode() for k, v in raw.items()}
        beat = utcparse(h["last_heartbeat"]).timestamp() if h.get("last_heartbeat") else None

        def num(field: str, h: dict = h) -> int | None:
            return int(h[field]) if field in h else None

        out.append(
            {
                "name": name,
                "host": h.get("hostname"),
                "pid": num("pid"),
                "server": h.get("genq_server"),
                "state": h.get("state"),
                "in_flight": num("genq_in_flight"),
                "retrying": num("genq_retrying"),
                "done": num("successful_job_count") or 0,
                "failed": num("failed_job_count") or 0,
                "retries": num("genq_retries"),
                "backend": h.get("genq_backend"),
                "server_version": h.get("genq_version"),
                "model": h.get("genq_model"),
                "seeds": {"True": True, "False": False}.get(h.get("genq_seeds", "")),
                "last_heartbeat": h.get("last_heartbeat"),
                "heartbeat_age_s": round(max(0.0, now - beat), 1) if beat is not None else None,
            }
        )
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
        pipe.xlen(keys.legacy_results)  # left by an older release (an upgrade mid-run)
        pipe.xrange(keys.legacy_results, count=1)
        pipe.time()
        *raw, legacy, legacy_first, (sec, usec) = pipe.execute()
    now = now if now is not None else sec + usec / 1e6
    length, firsts, holders = int(legacy), [], {}
    if legacy_first:
        firsts.append(int(legacy_first[0][0].split(b"-")[0]) / 1000)
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


def _with_tokens(conn: redis.Redis, keys: Keys, counts: dict[str, dict[str, int]], now: float) -> dict:
    """Each dataset's counts with its tokens, rates and ETA (None, never 0, where unknown)."""
    buckets = tokens.window_buckets(now)
    with conn.pipeline(transaction=False) as pipe:
        for name in counts:
            pipe.hgetall(keys.tokens(name))
            pipe.mget([keys.rate_bucket(name, b) for b in buckets])
        raw = pipe.execute()
    out = {}
    for i, (name, c) in enumerate(counts.items()):
        remaining = max(0, c["total"] - c["done"] - c["failed"])
        t = tokens.read(raw[2 * i], raw[2 * i + 1], c["done"], remaining == 0, now)
        out[name] = {
            **c,
            "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.completion_tokens,
            "avg_completion_tokens": _round(t.avg_completion_tokens),
            "cut": t.cut,
            "tokens_per_s": _round(t.tokens_per_s),
            "tokens_per_s_since_start": _round(t.tokens_per_s_since_start),
            "eta_s": _round(t.eta_s(remaining)),
        }
    return out


def totals(per_dataset: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """All datasets together. ETA: the work left in tokens over the summed recent rate."""
    rows = list(per_dataset.values())
    out: dict[str, Any] = {k: sum(r[k] for r in rows) for k in ("total", *STATES)}
    for k in ("prompt_tokens", "completion_tokens"):
        out[k] = None if any(r[k] is None for r in rows) else sum(r[k] for r in rows)
    rates = [r["tokens_per_s"] for r in rows if r["tokens_per_s"] is not None]
    out["tokens_per_s"] = _round(sum(rates)) if rates else None
    left = [(r["total"] - r["done"] - r["failed"], r["avg_completion_tokens"]) for r in rows]
    left = [(n, avg) for n, avg in left if n > 0]
    if not left:
        out["eta_s"] = 0.0
    elif any(avg is None for _, avg in left) or not out["tokens_per_s"]:
        out["eta_s"] = None
    else:
        out["eta_s"] = _round(sum(n * avg for n, avg in left) / out["tokens_per_s"])
    return out


def status(conn: redis.Redis, keys: Keys, now: float | None = None) -> dict[str, Any]:
    """Everything `genq status --json` prints. ``now`` (Redis time by default) is for tests."""
    now = now if now is not None else tokens.redis_now(conn)
    per_dataset = _with_tokens(conn, keys, dataset_counts(conn, keys), now)
    alive = workers(conn, keys, now)
    return {
        "namespace": keys.namespace,
        "datasets": per_dataset,
        "totals": totals(per_dataset),
        "workers": alive,
        "stream": stream_lag(conn, keys, now),
        "warnings": warnings(datasets.load_all(conn, keys), alive),
    }


def warnings(settings: dict[str, datasets.DatasetSettings], alive: list[dict[str, Any]]) -> list[str]:
    """What the numbers alone do not show: samples that rely on seeds a server ignores."""
    ignoring = sorted({w["server"] or "?" for w in alive if w["seeds"] is False})
    out = []
    for name, s in settings.items():
        if ignoring and ("sampling_seed" in s.sampling_params or s.samples > 1):
            out.append(
                f"{name}: its samples rely on sampling_seed, which {', '.join(ignoring)} ignores "
                "(SGLang without --enable-deterministic-inference): they are not reproducible"
            )
    return out


def _round(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def finished(counts: dict[str, dict[str, int]]) -> bool:
    """Every enqueued job is on disk, as a record or an error."""
    return all(c["done"] + c["failed"] >= c["total"] for c in counts.values())
