"""Reading Redis bitmaps locally: one GET instead of a round trip per job.

Redis numbers bits from the most significant bit of the first byte.
"""

from __future__ import annotations


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
