"""Log-probabilities for distillation, stored beside the records in a compact binary file.

``OUT/<dataset>/logprobs.bin`` holds one frame per record that asked for them (``genq enqueue
--logprobs K``), keyed by the record id. As JSON, 8K tokens × top-20 would be megabytes per
record; here each output token costs 4 + 6·K bytes (K = 20: 124 B): the sampled token's logprob
(float32), the top-K ids (int32) and their logprobs (float16). The collector appends frames with
the same rule as the lines of raw_responses.jsonl (fsync before acknowledging), writes a batch's
frames before its lines, and at start-up cuts frames whose record is not on disk (they are
replayed).

A frame: ``GQLP`` | version (u8) | flags (u8) | id length (u16) | tokens n (u32) | K (u16) | 0
(u16) | payload length (u32) | CRC32 of the payload (u32) | payload = id (UTF-8), float32[n],
int32[n·K], float16[n·K]; little-endian. Read them with :func:`frames`.

What a server sends is data, never a reason to lose the answer: a null (or NaN) logprob is stored
as -inf and sets FLAG_NULL; a finite one beyond what its type holds (float16: ±65504, float32:
±3.4e38) is stored clamped to that bound and sets FLAG_CLAMPED. Shorter top rows are padded with
id -1 and -inf (no flag: the vocabulary ran out). The worker checks each frame before sending it
and the collector again before writing it (:func:`check`).
"""

from __future__ import annotations

import functools
import math
import operator
import struct
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GQLP"
VERSION = 1
HEADER = struct.Struct("<4sBBHIHHII")
FILE = "logprobs.bin"
FLAG_NULL = 1  # a logprob was null or NaN: stored as -inf
FLAG_CLAMPED = 2  # a finite logprob beyond its type's range: stored as the nearest bound
F16_MAX = 65504.0
F32_MAX = 3.4028234663852886e38
INT32 = range(-(2**31), 2**31)


class Invalid(ValueError):
    """Log-probabilities that cannot make a frame (a shape or id that is not a server's), or a
    frame that does not hold what its record says."""


def number(value: object) -> float | None:
    """A logprob as a server sent it: a float, or None for null (and NaN); Invalid otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Invalid(f"logprob {value!r} is not a number")
    try:
        x = float(value)
    except OverflowError:  # an int beyond a double: as far out as it can be
        x = math.inf if value > 0 else -math.inf
    return None if math.isnan(x) else x


@dataclass
class LogProbs:
    """One answer's log-probabilities: per output token, the sampled one and the top K."""

    token: list[float | None]  # n; None: the server sent null
    top_ids: list[list[int]]  # n × K
    top: list[list[float | None]]  # n × K
    flags: int = 0  # read back from a frame: FLAG_NULL | FLAG_CLAMPED

    @property
    def k(self) -> int:
        return max((len(row) for row in self.top_ids), default=0)


def pack(record_id: str, lp: LogProbs) -> bytes:
    """One frame, checked; rows of the top lists shorter than K (the vocabulary ran out) are padded.
    Nulls and values out of range become data (module docstring); a shape no server sends, an id
    that is not an int32, or a frame that does not read back as written is Invalid."""
    n, k = len(lp.token), lp.k
    if len(lp.top_ids) not in (0, n) or len(lp.top) != len(lp.top_ids):
        raise Invalid(f"{len(lp.top_ids)} top-id rows and {len(lp.top)} top rows for {n} tokens")
    rows = lp.top_ids or [[] for _ in range(n)]
    tops_rows = lp.top or [[] for _ in range(n)]
    ids = []
    for row, values in zip(rows, tops_rows, strict=True):
        if len(row) != len(values):
            raise Invalid(f"a top row of {len(row)} ids and {len(values)} logprobs")
        if any(isinstance(i, bool) or not isinstance(i, int) or i not in INT32 for i in row):
            raise Invalid(f"a top id that is not an int32: {row}")
        ids += (*row, *[-1] * (k - len(row)))
    token, token_flags = _fit(lp.token, F32_MAX)
    tops, top_flags = _fit([x for row in tops_rows for x in (*row, *[-math.inf] * (k - len(row)))], F16_MAX)
    name = record_id.encode()
    payload = (
        name + array("f", token).tobytes() + array("i", ids).tobytes() + struct.pack(f"<{len(tops)}e", *tops)
    )
    flags, crc = token_flags | top_flags | lp.flags, zlib.crc32(payload)
    frame = HEADER.pack(MAGIC, VERSION, flags, len(name), n, k, 0, len(payload), crc) + payload
    why = check(frame, record_id, n)
    if why is not None:
        raise Invalid(why)
    return frame


def unpack(frame: bytes) -> LogProbs:
    """The log-probabilities of one whole frame, checked first (:func:`check`); its flags kept."""
    _, _, flags, id_len, n, k, _, _, _ = HEADER.unpack_from(frame)
    lp = _unpack(frame[HEADER.size + id_len :], n, k)
    lp.flags = flags
    return lp


def record_id(frame: bytes) -> str:
    """The record id a whole frame is of."""
    id_len = HEADER.unpack_from(frame)[3]
    return frame[HEADER.size : HEADER.size + id_len].decode()


def join(parts: list[LogProbs]) -> LogProbs:
    """One answer's log-probabilities from those of its pieces, in order (worker/pieces.py)."""
    return LogProbs(
        [x for p in parts for x in p.token],
        [row for p in parts for row in p.top_ids],
        [row for p in parts for row in p.top],
        flags=functools.reduce(operator.or_, (p.flags for p in parts), 0),
    )


def _fit(values: list[float | None], bound: float) -> tuple[list[float], int]:
    """The values as stored, and the flags they set: None and NaN as -inf, finite ones past
    ``bound`` as ``bound``."""
    out, flags = [], 0
    for x in values:
        if x is None or x != x:
            out.append(-math.inf)
            flags |= FLAG_NULL
        elif abs(x) > bound and not math.isinf(x):
            out.append(math.copysign(bound, x))
            flags |= FLAG_CLAMPED
        else:
            out.append(x)
    return out, flags


def check(frame: bytes, record_id: object, tokens: object) -> str | None:
    """Why ``frame`` is not one whole frame of ``record_id`` with ``tokens`` output tokens (what
    its record says), or None when it is. Anything from Redis is checked so before it is written:
    a bad frame in logprobs.bin would end the frames a reader (and the start-up check) can see."""
    if len(frame) < HEADER.size:
        return f"{len(frame)} bytes: shorter than a frame header"
    magic, version, _, id_len, n, k, _, size, crc = HEADER.unpack_from(frame)
    payload = frame[HEADER.size :]
    if magic != MAGIC or version != VERSION:
        return f"not a version-{VERSION} frame (magic {magic!r}, version {version})"
    if len(payload) != size or zlib.crc32(payload) != crc:
        return f"payload of {len(payload)} bytes, header says {size}, or its CRC32 does not match"
    if size != id_len + 4 * n + 6 * n * k:
        return f"payload of {size} bytes for {n} tokens × top {k} and a {id_len}-byte id"
    if payload[:id_len] != str(record_id).encode():
        return f"the frame is of {payload[:id_len].decode(errors='replace')!r}, not of {record_id!r}"
    if n != tokens:
        return f"{n} tokens in the frame, {tokens!r} in the record"
    return None


def without_frame(meta: object, why: str) -> dict:
    """A record's ``logprobs`` when its frame could not be stored: what it said, and why not."""
    return {**(meta if isinstance(meta, dict) else {}), "file": FILE, "error": why}


def frames(path: Path, offset: int = 0) -> Iterator[tuple[int, int, str, LogProbs]]:
    """(start, end, record id, log-probabilities) of each whole frame from ``offset``; stops at a
    torn or corrupt one (whose start is the last frame's end)."""
    if not path.exists():
        return
    with path.open("rb") as fh:
        fh.seek(offset)
        pos = offset
        while True:
            head = fh.read(HEADER.size)
            if len(head) < HEADER.size:
                return
            magic, version, flags, id_len, n, k, _, size, crc = HEADER.unpack(head)
            payload = fh.read(size)
            if magic != MAGIC or version != VERSION or len(payload) < size or zlib.crc32(payload) != crc:
                return
            if size != id_len + 4 * n + 6 * n * k:
                return
            lp = _unpack(payload[id_len:], n, k)
            lp.flags = flags
            yield pos, pos + HEADER.size + size, payload[:id_len].decode(errors="replace"), lp
            pos += HEADER.size + size


def _unpack(data: bytes, n: int, k: int) -> LogProbs:
    token, ids = array("f"), array("i")
    token.frombytes(data[: 4 * n])
    ids.frombytes(data[4 * n : 4 * n + 4 * n * k])
    tops = struct.unpack(f"<{n * k}e", data[4 * n + 4 * n * k :])
    rows = range(0, n * k, k) if k else range(n)
    return LogProbs(
        list(token),
        [list(ids[i : i + k]) for i in rows] if k else [[] for _ in rows],
        [list(tops[i : i + k]) for i in rows] if k else [[] for _ in rows],
    )


def valid_end(path: Path, offset: int = 0) -> int:
    """Where the last whole frame ends (from ``offset``): anything after it is torn."""
    last = offset
    for _, last, _, _ in frames(path, offset):  # noqa: B007 - the loop variable is the answer
        pass
    return last
