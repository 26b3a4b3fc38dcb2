"""Token counters per dataset: written by the collector with the records, read by status and monitor.

The collector is the only writer of records, so it adds each record's tokens in the same MULTI
that marks its id done: the counters always describe exactly the records on disk. A record is
counted when its done bit goes from 0 to 1, never twice; an extension that supersedes it adds the
tokens it adds, when its extending bit goes from 1 to 0. Completion tokens also go into 10 s
buckets (kept an hour) for the recent rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from genq.keys import Keys
from genq.schema import cut_short, extends, rejudged

BUCKET_S = 10
KEEP_S = 3600
WINDOW_S = 300  # "tokens/s over the last few minutes"
MIN_SPAN_S = 2.0  # a rate over less time than this is noise, not a number


def countable(record: dict) -> bool:
    """Both token counts are integers: anything else is left out (and status then says unknown)."""
    return all(
        isinstance(record.get(k), int) and not isinstance(record.get(k), bool)
        for k in ("prompt_tokens", "completion_tokens")
    )


def add(pipe, keys: Keys, dataset: str, records: list[dict], now: float | None, live: bool) -> None:
    """Count ``records`` (newly on disk) into ``pipe``.

    ``now`` (Redis time) puts their completion tokens in the recent-rate bucket; ``live`` says they
    were written while the run went on (not found on disk at start-up), for the since-start rate.
    """
    # A record judged again (genq retry --check-failed) is the same output, counted already.
    records = [r for r in records if countable(r) and rejudged(r) is None]
    if not records:
        return
    # An extension (genq retry --truncated) supersedes a record counted already: only the tokens it adds.
    fresh = [r for r in records if extends(r) is None]
    completion = sum(r["completion_tokens"] - (extends(r) or 0) for r in records)
    key = keys.tokens(dataset)
    pipe.hincrby(key, "records", len(fresh))
    pipe.hincrby(key, "prompt_tokens", sum(r["prompt_tokens"] for r in fresh))
    pipe.hincrby(key, "completion_tokens", completion)
    cached = [r["cached_tokens"] for r in fresh if type(r.get("cached_tokens")) is int]
    if cached:  # the server said for these (SGLang always; vLLM with --enable-prompt-tokens-details)
        pipe.hincrby(key, "cached_tokens", sum(cached))
        pipe.hincrby(key, "cached_records", len(cached))
    cut = sum(1 for r in fresh if cut_short(r))
    if cut:
        pipe.hincrby(key, "cut", cut)
    # The ledger's endings (genq/progress.py): ended on length, and stopped after two pieces or more.
    # An extension's superseded record ended on length: it leaves that count.
    length = sum(1 for r in records if r.get("finish_reason") == "length") - (len(records) - len(fresh))
    continued = sum(1 for r in records if r.get("finish_reason") != "length" and (r.get("pieces") or 1) > 1)
    pipe.hincrby(key, "length", length)  # written even at 0: a hash without them is an older genq's
    pipe.hincrby(key, "continued", continued)
    if live:
        pipe.hincrby(key, "live_tokens", completion)
    if now is not None:
        pipe.hsetnx(key, "first_at", repr(now))
        pipe.hset(key, "last_at", repr(now))
        bucket = keys.rate_bucket(dataset, int(now // BUCKET_S))
        pipe.incrby(bucket, completion)
        pipe.expire(bucket, KEEP_S)


# The counters that describe the records on disk (not the rates): what recount() derives anew.
ON_DISK = (
    "records",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cached_records",
    "cut",
    "length",
    "continued",
)


def recount(pipe, keys: Keys, dataset: str, lines: list[dict]) -> None:
    """The counters of the records on disk derived anew from their files' lines in file order (an
    extension after the record it extends, as the collector counted them): after `genq verify
    --repair` reopened lost records, the counters no longer describe the files until this runs."""
    pipe.hdel(keys.tokens(dataset), *ON_DISK)
    add(pipe, keys, dataset, lines, None, live=False)
    pipe.hsetnx(keys.tokens(dataset), "records", 0)  # a hash that counts nothing still says so
    for name in ("length", "continued"):
        pipe.hsetnx(keys.tokens(dataset), name, 0)


def window_buckets(now: float) -> list[int]:
    """The buckets of the recent-rate window ending at ``now`` (the current one included)."""
    last = int(now // BUCKET_S)
    return list(range(last - WINDOW_S // BUCKET_S + 1, last + 1))


@dataclass
class Tokens:
    """What the counters say about one dataset; None where they cannot say."""

    records: int
    prompt_tokens: int | None
    completion_tokens: int | None
    tokens_per_s: float | None  # recent, over WINDOW_S
    tokens_per_s_since_start: float | None
    capped: int | None = None  # records the server stopped below the max_new_tokens asked for
    cached_tokens: int | None = None  # prompt tokens the server had cached, over ``cached_records``
    cached_records: int | None = None  # records whose server said how many it had cached
    length: int | None = None  # records that ended on length (at the cap, continued or not)
    continued: int | None = None  # records continued in pieces whose model stopped

    @property
    def avg_completion_tokens(self) -> float | None:
        if not self.records or self.completion_tokens is None:
            return None
        return self.completion_tokens / self.records

    def eta_s(self, remaining: int) -> float | None:
        """Jobs left × average completion tokens per job / recent rate; None until both are known."""
        if remaining == 0:
            return 0.0
        avg = self.avg_completion_tokens
        if avg is None or not self.tokens_per_s:
            return None
        return remaining * avg / self.tokens_per_s


def read(
    raw: dict[bytes, bytes], buckets: list[bytes | None], done: int, finished: bool, now: float
) -> Tokens:
    """Interpret the ``tokens`` hash and the window's buckets of one dataset.

    The counters cover the records on disk only if they counted as many records as the ``done``
    bitmap holds (a run begun by an older genq, or a record without token counts, breaks that):
    otherwise the totals are unknown, not a smaller number.
    """
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    records = int(fields.get("records", 0))
    exact = records == done
    first_at = float(fields["first_at"]) if "first_at" in fields else None
    recent = since_start = None
    if first_at is not None:
        window_start = window_buckets(now)[0] * BUCKET_S
        span = now - max(window_start, first_at)
        if span >= MIN_SPAN_S:
            recent = sum(int(b) for b in buckets if b) / span
        end = float(fields.get("last_at", now)) if finished else now
        if end - first_at >= MIN_SPAN_S:
            since_start = int(fields.get("live_tokens", 0)) / (end - first_at)
    return Tokens(
        records=records,
        prompt_tokens=int(fields.get("prompt_tokens", 0)) if exact else None,
        completion_tokens=int(fields.get("completion_tokens", 0)) if exact else None,
        tokens_per_s=recent,
        tokens_per_s_since_start=since_start,
        capped=int(fields.get("cut", 0)) if exact else None,
        cached_tokens=int(fields.get("cached_tokens", 0)) if exact else None,
        cached_records=int(fields.get("cached_records", 0)) if exact else None,
        length=_ledger(fields, "length", exact),
        continued=_ledger(fields, "continued", exact),
    )


def _ledger(fields: dict[str, str], name: str, exact: bool) -> int | None:
    """A ledger count: unknown where the counters are not exact, or were kept by an older genq."""
    if not exact:
        return None
    if name in fields:
        return int(fields[name])
    return 0 if int(fields.get("records", 0)) == 0 else None
