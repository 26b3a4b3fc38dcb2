"""Log-probabilities for distillation, stored beside the records in a compact binary file.

``OUT/<dataset>/logprobs.bin`` holds one frame per record that asked for them (``genq enqueue
--logprobs K``), keyed by the record id. As JSON, 8K tokens × top-20 would be megabytes per
record; here each output token costs 4 + 6·K bytes (K = 20: 124 B): the sampled token's logprob
(float32), the top-K ids (int32) and their logprobs (float16). The collector appends frames with
the same rule as the lines of raw_responses.jsonl (fsync before acknowledging), writes a batch's
frames before its lines, and at start-up cuts frames whose record is not on disk (they are
replayed).

A frame: ``GQLP`` | version (u8) | 0 (u8) | id length (u16) | tokens n (u32) | K (u16) | 0 (u16)
| payload length (u32) | CRC32 of the payload (u32) | payload = id (UTF-8), float32[n],
int32[n·K], float16[n·K]; little-endian. Read them with :func:`frames`.
"""

from __future__ import annotations

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


@dataclass
class LogProbs:
    """One answer's log-probabilities: per output token, the sampled one and the top K."""

    token: list[float]  # n
    top_ids: list[list[int]]  # n × K
    top: list[list[float]]  # n × K

    @property
    def k(self) -> int:
        return len(self.top_ids[0]) if self.top_ids else 0

    def bytes_per_token(self) -> int:
        return 4 + 6 * self.k


def pack(record_id: str, lp: LogProbs) -> bytes:
    """One frame; rows of the top lists shorter than K (the vocabulary ran out) are padded."""
    n, k = len(lp.token), lp.k
    ids = array("i", (i for row in lp.top_ids for i in (*row, *[-1] * (k - len(row)))))
    tops = [x for row in lp.top for x in (*row, *[float("-inf")] * (k - len(row)))]
    name = record_id.encode()
    payload = name + array("f", lp.token).tobytes() + ids.tobytes() + struct.pack(f"<{len(tops)}e", *tops)
    return HEADER.pack(MAGIC, VERSION, 0, len(name), n, k, 0, len(payload), zlib.crc32(payload)) + payload


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
            magic, version, _, id_len, n, k, _, size, crc = HEADER.unpack(head)
            payload = fh.read(size)
            if magic != MAGIC or version != VERSION or len(payload) < size or zlib.crc32(payload) != crc:
                return
            yield pos, pos + HEADER.size + size, payload[:id_len].decode(), _unpack(payload[id_len:], n, k)
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
