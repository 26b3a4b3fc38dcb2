"""A toy prefix cache: a prompt seen before reports cached_tokens and skips most of its prefill.

SGLang's radix cache makes a retried or repeated prompt cheap; modelling whole prompts only is
enough to show that effect without a radix tree.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


class PromptCache:
    """LRU of prompt digests; lookup() answers how many prompt tokens were already cached."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def lookup(self, input_ids: Sequence[int]) -> int:
        """Cached tokens for this prompt (all but the last, which is recomputed), then remember it."""
        if self.capacity <= 0 or not input_ids:
            return 0
        key = hashlib.blake2b(array("q", input_ids).tobytes(), digest_size=16).digest()
        hit = key in self._seen
        self._seen[key] = None
        self._seen.move_to_end(key)
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return len(input_ids) - 1 if hit else 0

    def clear(self) -> None:
        self._seen.clear()
