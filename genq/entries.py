"""The result stream's entries: what a worker XADDs for one finished job, the check every reader
runs on one before using it, and the dead letter an entry that fails the check is moved to.

Redis content is untrusted input (docs/security.md): anyone who can write to Redis can XADD to a
dataset's stream. An entry that is not what a worker writes (fields missing, data that is not a
JSON object, a row that is not one of the dataset's jobs) must neither crash a reader nor reach a
file: :func:`read_entry` says why in words that name the field, and the collector moves the entry,
its bytes kept (each field cut to ``KEPT_BYTES``), to the dataset's dead letter
(``dead:<dataset>``, a stream) in the MULTI that acknowledges it. ``genq failed`` lists them,
``genq status`` and ``genq verify`` count them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import redis
from redis.client import Pipeline

from genq.keys import Keys
from genq.schema import KIND_ERROR, KIND_RECORD, bit_index, dumps, loads, now_iso, record_id

# The fields of a result-stream entry: its kind, the record id, the record or error as JSON, and
# the packed logprobs when asked for (genq/logprobs.py). A checked dataset's entry also carries, in
# its unchecked stream, the job's payload (the check stage draws more samples from it), and in its
# results stream the verdict (JSON: status, score, reason, the checker).
ENTRY_KIND, ENTRY_ID, ENTRY_DATA, ENTRY_LOGPROBS = "kind", "id", "data", "lp"
ENTRY_SPEC, ENTRY_VERDICT = "spec", "verdict"
_KIND, _ID, _DATA, _LOGPROBS = (f.encode() for f in (ENTRY_KIND, ENTRY_ID, ENTRY_DATA, ENTRY_LOGPROBS))
_VERDICT = ENTRY_VERDICT.encode()
# What the check stage made of a checked dataset's ending: accepted (filed with the records), not
# accepted, accepted beyond the K a prompt needs, the checker failing on it every time it was
# tried, and a generation that failed (an error: nothing to judge).
VERDICTS = ("accepted", "rejected", "surplus", "check_failed", "unjudged")
KINDS = (KIND_RECORD, KIND_ERROR)
# A record's JSON can be large (a 32k-token output's text and ids are well under 1 MiB); anything
# past this is not one, and is not parsed.
MAX_DATA_BYTES = 64 << 20
# Redis bitmaps end at bit 2**32 - 1: a job index past it is no job (and no BITFIELD takes it).
MAX_BIT_INDEX = (1 << 32) - 1
# Of each field of a quarantined entry, this many bytes are kept in the dead letter: enough to see
# what it was, never a copy of a 10 MB value.
KEPT_BYTES = 64 << 10
# A dead letter keeps about this many entries (XADD MAXLEN ~); the ``quarantined`` hash counts all.
DEAD_LETTER_LEN = 10_000


class BadEntry(ValueError):
    """A stream entry that is not one a worker writes; the message names the field."""


@dataclass(frozen=True)
class Entry:
    """A result-stream entry that passed :func:`read_entry`."""

    kind: bytes
    record_id: str
    data: dict[str, Any]
    logprobs: bytes | None
    index: int  # the job's bit in the dataset's bitmaps
    verdict: dict[str, Any] | None = None  # a checked dataset's: what genq check made of it


def stream_entry(
    kind: bytes, rid: str, data: dict[str, Any], logprobs: bytes | None, spec: dict[str, Any] | None = None
) -> dict:
    """The fields to XADD for one finished job; "lp" only when there are logprobs, "spec" (the job's
    payload) only on the way to the check stage."""
    entry: dict[str, Any] = {ENTRY_KIND: kind, ENTRY_ID: rid, ENTRY_DATA: dumps(data)}
    if logprobs is not None:
        entry[ENTRY_LOGPROBS] = logprobs
    if spec is not None:
        entry[ENTRY_SPEC] = dumps(spec)
    return entry


def read_entry(fields: dict[bytes, bytes], dataset: str, samples: int) -> Entry:
    """The entry in ``fields`` of ``dataset``'s stream, checked: a kind genq writes, an id that is
    the record id of the row and sample its data names, data a JSON object of this dataset.
    Raises :class:`BadEntry` naming the field otherwise."""
    kind = fields.get(_KIND)
    if kind not in KINDS:
        raise BadEntry(f"field {ENTRY_KIND!r} is {_shown(kind)}, not 'record' or 'error'")
    raw = fields.get(_DATA)
    if raw is None:
        raise BadEntry(f"no field {ENTRY_DATA!r}")
    if len(raw) > MAX_DATA_BYTES:
        raise BadEntry(f"field {ENTRY_DATA!r} is {len(raw):,} bytes, over a record's {MAX_DATA_BYTES:,}")
    try:
        data = loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadEntry(f"field {ENTRY_DATA!r} is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadEntry(f"field {ENTRY_DATA!r} is a JSON {type(data).__name__}, not an object")
    row, sample = data.get("row"), data.get("sample")
    if not _count(row):
        raise BadEntry(f"data field 'row' is {_shown(row)}, not a whole number ≥ 0")
    if not _count(sample) or sample >= samples:
        raise BadEntry(f"data field 'sample' is {_shown(sample)}, not one of 0..{samples - 1}")
    index = bit_index(row, sample, samples)
    if index > MAX_BIT_INDEX:
        raise BadEntry(f"data field 'row' is {row}: past the last job a dataset can hold")
    if data.get("dataset") != dataset:
        raise BadEntry(f"data field 'dataset' is {_shown(data.get('dataset'))}, not {dataset!r}")
    want = record_id(dataset, row, sample, samples)
    if fields.get(_ID) != want.encode() or data.get("id") != want:
        raise BadEntry(f"field {ENTRY_ID!r} and data field 'id' are not both {want!r}, row {row}'s id")
    if kind == KIND_ERROR and not isinstance(data.get("error"), str):
        raise BadEntry(f"an error whose data field 'error' is {_shown(data.get('error'))}, not a string")
    verdict = None
    if (raw_verdict := fields.get(_VERDICT)) is not None:
        try:
            verdict = loads(raw_verdict)
        except orjson.JSONDecodeError:
            verdict = None
        if not isinstance(verdict, dict) or verdict.get("status") not in VERDICTS:
            raise BadEntry(
                f"field {ENTRY_VERDICT!r} is {_shown(raw_verdict)}, not a verdict genq check writes"
            )
    return Entry(kind, want, data, fields.get(_LOGPROBS), index, verdict)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shown(value: object, limit: int = 60) -> str:
    """A value in an error line: short, whatever it is."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text):,} characters)"


def quarantine(
    pipe: Pipeline, keys: Keys, dataset: str, entry_id: bytes, fields: dict, why: str, checked: bool = False
) -> None:
    """Queue, in ``pipe`` (a MULTI), the move of one entry of ``dataset``'s stream (its unchecked
    stream: ``checked``, the check stage's) to its dead letter: its fields (each cut to KEPT_BYTES),
    the reason, where and when it was found; counted in ``quarantined``, then acknowledged and
    deleted from the stream."""
    stream = keys.unchecked(dataset) if checked else keys.results(dataset)
    letter: dict[bytes | str, bytes | str] = {
        "stream": stream,
        "entry": entry_id,
        "reason": why,
        "found_at": now_iso(),
    }
    for name, value in fields.items():
        value = value if isinstance(value, bytes) else str(value).encode()
        letter[b"field:" + name] = value[:KEPT_BYTES]
        if len(value) > KEPT_BYTES:
            letter[b"size:" + name] = str(len(value))
    pipe.xadd(keys.dead_letter(dataset), letter, maxlen=DEAD_LETTER_LEN, approximate=True)
    pipe.hincrby(keys.quarantined, dataset, 1)
    pipe.xack(stream, keys.checkers_group if checked else keys.results_group, entry_id)
    pipe.xdel(stream, entry_id)


@dataclass(frozen=True)
class DeadLetter:
    """One quarantined entry, as ``genq failed`` shows it."""

    dataset: str
    entry: str  # the id it had in the stream
    reason: str
    found_at: str


def dead_letters(conn: redis.Redis, keys: Keys, dataset: str, count: int = 100) -> list[DeadLetter]:
    """The last ``count`` quarantined entries of ``dataset``, newest first."""
    out = []
    for _, fields in conn.xrevrange(keys.dead_letter(dataset), count=count):

        def text(name: bytes, letter: dict = fields) -> str:
            return letter.get(name, b"").decode("utf-8", "replace")

        out.append(DeadLetter(dataset, text(b"entry"), text(b"reason"), text(b"found_at")))
    return out


def quarantined(conn: redis.Redis, keys: Keys) -> dict[str, int]:
    """Per dataset, how many entries were ever quarantined."""
    return {name.decode(): int(n) for name, n in conn.hgetall(keys.quarantined).items()}
