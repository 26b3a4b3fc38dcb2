"""Reading Redis bitmaps locally: one GET instead of a round trip per job.

Redis numbers bits from the most significant bit of the first byte.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def is_set(bitmap: bytes, index: int) -> bool:
    byte = index >> 3
    return byte < len(bitmap) and bool(bitmap[byte] & (0x80 >> (index & 7)))


def indexes(bitmap: bytes) -> list[int]:
    """Every set bit's index, in order."""
    out = []
    for byte_no, byte in enumerate(bitmap):
        if byte:
            base = byte_no << 3
            out.extend(base + bit for bit in range(8) if byte & (0x80 >> bit))
    return out


# Bits per BITFIELD: a command stays small enough for a Lua script to pass on (its unpack stops
# near 8,000 values; collector/checkpoint.py).
BITS_PER_COMMAND = 1000


def set_bits(pipe, key: str, indexes: Iterable[int], value: int = 1) -> None:
    """Queue BITFIELDs that set every bit of ``indexes`` to ``value``, a thousand bits each: a
    SETBIT per job would be a Redis command per job, and commands, not bits, are what Redis spends
    its CPU on."""
    args: list[object] = []
    for index in indexes:
        args += ("SET", "u1", index, value)
        if len(args) == 4 * BITS_PER_COMMAND:
            pipe.execute_command("BITFIELD", key, *args)
            args = []
    if args:
        pipe.execute_command("BITFIELD", key, *args)


def get_bits(pipe, key: str, indexes: Sequence[int]) -> None:
    """Queue one BITFIELD_RO reading the bits of ``indexes``; its reply is a list of 0s and 1s,
    one per index. Nothing is queued for no indexes."""
    args: list[object] = []
    for index in indexes:
        args += ("GET", "u1", index)
    if args:
        pipe.execute_command("BITFIELD_RO", key, *args)
