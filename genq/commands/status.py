"""What `genq status`, the monitor and the dashboard show: the five states of every dataset (from
genq/progress.py) with what the views need around them: tokens and rates (genq/token_counts.py), the
workers alive (RQ's worker hashes with genq's fields), the collector's lag, and warnings.
"""

from __future__ import annotations

from typing import Any

import redis
from rq import Worker
from rq.utils import utcparse

from genq import datasets, entries, provenance, token_counts
from genq.clock import redis_time
from genq.keys import Keys
from genq.progress import STATES, check_summary, dataset_counts, ledger, stream_lag, worker_names
from genq.redis_errors import not_now, refusing_writes
from genq.settings import DEFAULT_HEARTBEAT_TTL_S
from genq.terminal import duration


def workers(conn: redis.Redis, keys: Keys, now: float) -> list[dict[str, Any]]:
    """Workers alive: RQ's fields (host, pid, jobs done and failed, heartbeat) and genq's (server,
    in flight and its target, retrying, failed attempts), the latter None until the worker's first report."""
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
                "slurm_job": h.get("genq_slurm_job") or None,
                "state": h.get("state"),
                "in_flight": num("genq_in_flight"),
                "retrying": num("genq_retrying"),
                "target": num("genq_target"),
                "done": num("successful_job_count") or 0,
                "failed": num("failed_job_count") or 0,
                "retries": num("genq_retries"),
                "suspects": num("genq_suspects"),
                "probation_s": seconds(h.get("genq_probation_s")),
                "held": h.get("genq_held") or None,  # why it takes no jobs now (worker/gate.py)
                "backend": h.get("genq_backend"),
                "server_version": h.get("genq_version"),
                "model": h.get("genq_model"),
                "seeds": {"True": True, "False": False}.get(h.get("genq_seeds", "")),
                "last_heartbeat": h.get("last_heartbeat"),
                "heartbeat_age_s": round(max(0.0, now - beat), 1) if beat is not None else None,
                # Its hash outlives a SIGKILLed worker by minutes (RQ's key TTL): a worker silent
                # for longer than its own heartbeat TTL is dead, and its jobs are being taken back.
                "alive": beat is not None
                and now - beat <= (num("genq_heartbeat_ttl") or DEFAULT_HEARTBEAT_TTL_S),
            }
        )
    return out


def seconds(raw: str | None) -> float | None:
    """A duration a worker reported (Redis content: anything but a finite number ≥ 0 is unknown)."""
    try:
        value = float(raw) if raw else None
    except ValueError:
        return None
    return value if value is not None and 0 <= value < float("inf") else None


def probation_s(alive: list[dict[str, Any]]) -> float | None:
    """How long the slowest worker's crash suspects take to pass, one at a time (0 without any);
    None when a worker holding some has not timed a send yet."""
    holding = [w for w in alive if w["alive"] and w["suspects"]]
    if any(w["probation_s"] is None for w in holding):
        return None
    return max((w["probation_s"] for w in holding), default=0.0)


def with_probation(eta_s: float | None, passing_s: float | None) -> float | None:
    """An ETA that waits for the suspects too: they pass one at a time, beside the other jobs."""
    if eta_s is None or passing_s is None:
        return eta_s
    return _round(max(eta_s, passing_s))


def with_tokens(conn: redis.Redis, keys: Keys, counts: dict[str, dict[str, int]], now: float) -> dict:
    """Each dataset's counts with its tokens, rates and ETA (None, never 0, where unknown)."""
    buckets = token_counts.window_buckets(now)
    with conn.pipeline(transaction=False) as pipe:
        for name in counts:
            pipe.hgetall(keys.tokens(name))
            pipe.mget([keys.rate_bucket(name, b) for b in buckets])
        raw = pipe.execute()
    out = {}
    for i, (name, c) in enumerate(counts.items()):
        remaining = max(0, c["total"] - c["done"] - c["failed"])
        t = token_counts.read(raw[2 * i], raw[2 * i + 1], c["done"] + c["extending"], remaining == 0, now)
        out[name] = {
            **c,
            "ledger": ledger(c, t),
            "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.completion_tokens,
            "avg_completion_tokens": _round(t.avg_completion_tokens),
            "capped": t.capped,
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
    now = now if now is not None else redis_time(conn)
    per_dataset = with_tokens(conn, keys, dataset_counts(conn, keys), now)
    alive = workers(conn, keys, now)
    suspects = sum(w["suspects"] or 0 for w in alive if w["alive"])
    passing_s = probation_s(alive)
    everything = totals(per_dataset)
    if suspects:
        everything["eta_s"] = with_probation(everything["eta_s"], passing_s)
        if len(per_dataset) == 1:  # the suspects are that dataset's
            only = next(iter(per_dataset.values()))
            only["eta_s"] = with_probation(only["eta_s"], passing_s)
    quarantined = entries.quarantined(conn, keys)
    settings = datasets.load_all(conn, keys)
    checked = [name for name in per_dataset if name in settings and settings[name].checked]
    with conn.pipeline(transaction=False) as pipe:
        for name in checked:
            pipe.hgetall(keys.verdicts(name))
        for name, raw in zip(checked, pipe.execute(), strict=True):
            per_dataset[name]["check"] = check_summary(raw)
    for name in per_dataset.keys() - set(checked):
        per_dataset[name]["check"] = None
    for name, counts in per_dataset.items():  # a stage: the dataset whose records are its rows
        source = settings[name].prompting.get("from_dataset") if name in settings else None
        counts["from"] = source.get("dataset") if isinstance(source, dict) else None
    idle = _no_worker_alive(alive, everything)
    if idle:  # nothing is being made: an ETA from the last minutes' rate would be a promise
        for counts in (everything, *per_dataset.values()):
            if counts["eta_s"]:
                counts["eta_s"] = None
    return {
        "namespace": keys.namespace,
        "datasets": per_dataset,
        "totals": everything,
        "workers": alive,
        "stream": stream_lag(conn, keys, now),
        "quarantined": quarantined,
        "suspects": suspects,
        "probation_s": passing_s if suspects else None,
        "warnings": [
            *_refusing_writes(conn),
            *warnings(settings, alive, per_dataset),
            *_models(conn, keys, list(per_dataset)),
            *filter(None, [probation_warning(suspects, passing_s)]),
            *_quarantined(keys, quarantined),
            *([idle] if idle else []),
        ],
    }


def _no_worker_alive(alive: list[dict[str, Any]], everything: dict[str, Any]) -> str | None:
    """A warning when jobs wait and no worker is alive to take them (no ETA then), else None."""
    waiting = everything["total"] - everything["done"] - everything["failed"]
    if waiting <= 0 or any(w["alive"] for w in alive):
        return None
    return f"no worker alive: {waiting:,} jobs wait (start `genq worker`; no ETA until one runs)"


def warnings(
    settings: dict[str, datasets.DatasetSettings],
    alive: list[dict[str, Any]],
    per_dataset: dict[str, dict[str, Any]],
) -> list[str]:
    """What the numbers alone do not show: workers that take no jobs and why (a server down, or
    answering wrongly), datasets the check stage holds (their checker broken), and samples that
    rely on seeds a server ignores."""
    ignoring = sorted({w["server"] or "?" for w in alive if w["seeds"] is False})
    out = [
        f"worker {w['name']} takes no jobs: {w['server'] or '?'} {w['held']}"
        for w in alive
        if w["alive"] and w["held"]
    ]
    out += [
        f"{name}: the check stage holds it: {c['check']['held']}"
        for name, c in per_dataset.items()
        if c.get("check") and c["check"].get("held")
    ]
    for name, s in settings.items():
        if ignoring and ("sampling_seed" in s.sampling_params or s.samples > 1):
            out.append(
                f"{name}: its samples rely on sampling_seed, which {', '.join(ignoring)} ignores "
                "(SGLang without --enable-deterministic-inference): they are not reproducible"
            )
    return out


def _models(conn: redis.Redis, keys: Keys, names: list[str]) -> list[str]:
    """Datasets answered by servers of different models (genq/provenance.py)."""
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(keys.servers(name))
        served = pipe.execute()
    pairs = zip(names, served, strict=True)
    return [w for name, raw in pairs if (w := provenance.disagreement(name, provenance.servers(raw)))]


def probation_warning(suspects: int, passing_s: float | None) -> str | None:
    """Jobs a server crash dropped are resent one at a time (worker/probation.py): the run is slower
    than its token rate says until they pass; the ETA counts them once a send has been timed."""
    if not suspects:
        return None
    said = (
        f"{suspects:,} jobs dropped by a server crash are resent one at a time (probation, "
        "docs/failures.md): "
    )
    if passing_s is None:
        return said + "slower than the ETA says until they pass"
    return said + f"about {duration(passing_s)} until they pass (the ETA counts it)"


def _quarantined(keys: Keys, counts: dict[str, int]) -> list[str]:
    return [
        f"{name}: {n:,} stream entries that were not a worker's result were quarantined "
        f"({keys.dead_letter(name)}; `genq failed` lists them)"
        for name, n in sorted(counts.items())
    ]


def _refusing_writes(conn: redis.Redis) -> list[str]:
    """A warning when Redis refuses writes while it still answers reads (out of memory, a replica).
    A Redis that refuses INFO itself (ACLs, a managed Redis) is not asked."""
    try:
        info = conn.info()
    except redis.ResponseError as exc:
        if not_now(exc):
            raise
        return []
    reason = refusing_writes(info)
    return [reason] if reason else []


def _round(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None
