"""A dataset's provenance: where its records came from, assembled from Redis as the run goes.

The settings enqueue recorded (sampling sent, tokenizer and chat template fingerprints, think
markers, sources), the last enqueue's command line (``ds:<name>:provenance``), every server that
answered its jobs as the workers' probes read it (``ds:<name>:servers``: engine, version, model,
context), the ledger and the token totals (the collector's counters, exactly the sums over the
records on disk), and the genq version. The collector writes it beside the records
(``OUT/<dataset>/provenance.json``) when it takes the dataset and every sweep, so it survives any
restart; `genq export` puts it in the dataset card, `genq status` warns when two models answered.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis

from genq import datasets, progress, token_counts
from genq.bitmaps import is_set
from genq.connection import redact
from genq.keys import Keys
from genq.schema import bit_index, dumps, loads, now_iso
from genq.version import __version__

FILE = "provenance.json"
# The field of a dataset's provenance hash where enqueue keeps its rejects by reason (JSON).
REJECTS_FIELD = "rejected_by_reason"
SERVER_FIELDS = ("backend", "version", "model", "context_length", "worker", "at")
# The commands that made a dataset, each one's line, host and time in its provenance hash: the
# last enqueue, the last `genq run` of it, and the last `genq check` to take it.
COMMANDS = {
    "enqueue": ("enqueue_command", "enqueue_host", "enqueued_at"),
    "run": ("run_command", "run_host", "run_at"),
    "check": ("check_command", "check_host", "check_at"),
}


# The field of a dataset's provenance hash where an enqueue with --limit N keeps N (the rows after
# it not read yet, not missing); an enqueue that read every row deletes it.
LIMIT_FIELD = "limited_to"


def record_limit(conn: redis.Redis, keys: Keys, dataset: str, rows: int | None) -> None:
    """The rows the last enqueue read when it stopped at --limit (None: it read them all)."""
    if rows is None:
        conn.hdel(keys.provenance(dataset), LIMIT_FIELD)
    else:
        conn.hset(keys.provenance(dataset), LIMIT_FIELD, rows)


def limited_to(conn: redis.Redis, keys: Keys, dataset: str) -> int | None:
    """The rows the last enqueue read when it stopped at --limit (Redis content: a count or None)."""
    raw = conn.hget(keys.provenance(dataset), LIMIT_FIELD)
    return int(raw) if raw is not None and raw.isdigit() else None


def record_command(conn: redis.Redis, keys: Keys, dataset: str, role: str) -> None:
    """This process's command line as the one that did ``role`` for ``dataset`` (URLs' passwords
    redacted; secrets are never in argv), with the host and the time: the card says how to make
    the dataset again from these."""
    program = Path(sys.argv[0]).name
    argv = ["genq" if program == "__main__.py" else program, *sys.argv[1:]]  # python -m genq: genq
    line, host, at = COMMANDS[role]
    command = shlex.join(map(_redacted, argv))
    conn.hset(keys.provenance(dataset), mapping={line: command, host: socket.gethostname(), at: now_iso()})


def _redacted(arg: str) -> str:
    """An argument with the password of a URL in it (``URL`` or ``--flag=URL``) replaced."""
    flag, eq, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
    return flag + eq + (redact(value) if "://" in value else value)


def commands(raw: dict[str, str]) -> dict[str, dict[str, str]]:
    """The commands recorded in a provenance hash (decoded), by role: ``command``, ``host``, ``at``."""
    found = {}
    for role, fields in COMMANDS.items():
        if fields[0] in raw:
            found[role] = {k: raw.get(f, "") for k, f in zip(("command", "host", "at"), fields, strict=True)}
    return found


def servers(raw: dict[bytes, bytes]) -> dict[str, dict[str, Any]]:
    """The ``servers`` hash as read from Redis (untrusted): each server's known fields, those of
    the type a worker writes; an entry that is not an object is left out."""
    out: dict[str, dict[str, Any]] = {}
    for url, value in raw.items():
        try:
            data = loads(value)
        except ValueError:
            continue
        if isinstance(data, dict):
            kept = {k: data.get(k) for k in SERVER_FIELDS if isinstance(data.get(k), str | int)}
            out[url.decode(errors="replace")] = kept
    return dict(sorted(out.items()))


def disagreement(name: str, served: dict[str, dict[str, Any]]) -> str | None:
    """One line when the dataset's servers report more than one model: its records mix them."""
    models: dict[str, list[str]] = {}
    for url, info in served.items():
        if info.get("model"):
            models.setdefault(str(info["model"]), []).append(url)
    if len(models) < 2:
        return None
    which = "; ".join(f"{model} ({', '.join(urls)})" for model, urls in sorted(models.items()))
    return f"dataset {name}: answered by {len(models)} different models: {which}: its records mix them"


def rejected_by_reason(raw: bytes | None) -> dict[str, int] | None:
    """The rows the last enqueue refused, by reason (producer/enqueue.py record_rejects): read from
    Redis, so only a JSON object of counts is taken; None when it is not one (or not recorded)."""
    try:
        data = loads(raw) if raw is not None else None
    except ValueError:
        return None
    if not isinstance(data, dict) or not all(type(n) is int and n >= 0 for n in data.values()):
        return None
    return {str(reason)[:200]: n for reason, n in data.items()}


def failed_by_class(errors: Path, failed: bytes, samples: int) -> dict[str, int]:
    """The dataset's failures by error class, from its errors.jsonl: each id's last error, of the
    ids still failed (the ``failed`` bitmap: a record written after a retry beats its error)."""
    last: dict[int, str] = {}
    try:
        with errors.open("rb") as fh:
            for line in fh:
                try:
                    error = loads(line)
                except ValueError:
                    continue
                if not isinstance(error, dict):
                    continue
                row, sample = error.get("row"), error.get("sample")
                if type(row) is int and type(sample) is int:
                    last[bit_index(row, sample, samples)] = str(error.get("error") or "unknown")
    except OSError:
        return {}
    return dict(Counter(cls for index, cls in last.items() if is_set(failed, index)).most_common())


def build(
    conn: redis.Redis,
    keys: Keys,
    name: str,
    errors: Path | None = None,
    counts: dict[str, dict[str, int]] | None = None,
) -> dict[str, Any] | None:
    """The provenance of dataset ``name``, or None when Redis does not know it; with ``errors``
    (its errors.jsonl) the failures by class. ``counts``: genq/progress.py ``dataset_counts``,
    when the caller read them for several datasets at once."""
    settings = datasets.load(conn, keys, name)
    if settings is None:
        return None
    with conn.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.servers(name))
        pipe.hgetall(keys.provenance(name))
        pipe.hgetall(keys.tokens(name))
        pipe.hgetall(keys.verdicts(name))
        served_raw, enqueue_raw, tokens_raw, verdicts_raw = pipe.execute()
    every = counts if counts is not None else progress.dataset_counts(conn, keys)
    mine = every.get(name)
    served = servers(served_raw)
    warning = disagreement(name, served)
    book = tokens = None
    if mine is not None:
        on_disk = mine["done"] + mine["extending"]
        t = token_counts.read(tokens_raw, [], on_disk, False, 0.0)
        book = progress.ledger(mine, t)
        tokens = {
            "records": t.records,
            "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.completion_tokens,
            # No record said how many were cached: unknown, not 0.
            "cached_tokens": t.cached_tokens if t.cached_records else None,
            "cached_tokens_of_records": t.cached_records,
        }
    times = {k.decode(): v.decode() for k, v in tokens_raw.items() if k in (b"first_at", b"last_at")}
    enqueue = {k.decode(errors="replace"): v for k, v in enqueue_raw.items()}
    decoded = {k: v.decode(errors="replace") for k, v in enqueue.items() if k != REJECTS_FIELD}
    return {
        "dataset": name,
        "genq_version": __version__,
        "settings": asdict(settings),
        "enqueue": {k: v for k, v in sorted(decoded.items()) if k in COMMANDS["enqueue"]},
        "commands": commands(decoded),
        "servers": served,
        "models": sorted({str(s["model"]) for s in served.values() if s.get("model")}),
        "warnings": [warning] if warning else [],
        "ledger": book,
        "rejected_by_reason": rejected_by_reason(enqueue.get(REJECTS_FIELD)),
        "failed_by_class": failed_by_class(errors, conn.get(keys.failed(name)) or b"", settings.samples)
        if errors is not None
        else None,
        "tokens": tokens,
        # A checked dataset's check stage: what it filed, and which checkers judged (decision 20).
        "check": progress.check_summary(verdicts_raw) if settings.checked else None,
        "first_record_at": _iso(times.get("first_at")),
        "last_record_at": _iso(times.get("last_at")),
        "updated_at": now_iso(),
    }


def _iso(epoch: str | None) -> str | None:
    """Redis-clock epoch seconds (the counters') as an ISO time."""
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(epoch))) if epoch else None
    except ValueError:
        return None


def write(folder: Path, data: dict[str, Any]) -> None:
    """``folder/provenance.json``, replaced whole."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (FILE + ".part")
    tmp.write_bytes(dumps(data) + b"\n")
    os.replace(tmp, folder / FILE)


def read(folder: Path) -> dict[str, Any] | None:
    """``folder/provenance.json`` (the dataset card's source), or None: none, or not an object."""
    try:
        data = loads((folder / FILE).read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
