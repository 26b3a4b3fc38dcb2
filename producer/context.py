"""The model's context length, so prompts that cannot fit are rejected (or clipped) before they are queued.

SGLang answers such a prompt with a 400 anyway; catching it here names the row in the source
file and keeps it out of the queue and off the GPU hosts. Ids outside the vocabulary are worse:
SGLang does not check them at all, and they can crash the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from genq.backends import ServerInfo
from genq.producer.readers import Rejected, Row


@dataclass
class Limits:
    """What a prompt must respect to be worth queueing; None where nobody said."""

    context_length: int | None = None  # prompt + max_new_tokens must stay below it
    max_input_len: int | None = None  # prompts must be shorter (SGLang's max_req_input_len)
    vocab_size: int | None = None  # ids must lie in [0, vocab_size)

    @classmethod
    def of_server(cls, info: ServerInfo) -> Limits:
        return cls(info.prompt_limit(), info.max_input_len, info.vocab_size)


def check_vocab(item: Row, vocab_size: int) -> Row | Rejected:
    """Ids outside the vocabulary are not refused by SGLang: they reach the embedding and can crash
    the server (and every generation on it). Only a real id may be queued."""
    ids = item.prompt.input_ids
    if ids is None or max(ids) < vocab_size:
        return item
    i, token = next((i, t) for i, t in enumerate(ids) if t >= vocab_size)
    return Rejected(
        item.where,
        item.row,
        f"field 'input_ids'[{i}]: token id {token} is outside the vocabulary [0, {vocab_size})",
    )


def check_fits(
    item: Row,
    max_new_tokens: int,
    context_length: int | None,
    clip: bool = False,
    max_input_len: int | None = None,
) -> Row | Rejected:
    """SGLang refuses prompt + max_new_tokens >= the context length with a 400, and its scheduler
    a prompt of max_req_input_len tokens or more.

    With ``clip``, a prompt that leaves room for at least one new token gets ``max_new_tokens``
    lowered to what fits (``item.max_new_tokens``) instead. Text prompts have no known length here.
    """
    prompt = item.prompt.input_ids
    if prompt is not None and max_input_len is not None and len(prompt) >= max_input_len:
        return Rejected(
            item.where,
            item.row,
            f"field 'input_ids': {len(prompt)} prompt tokens; the server takes only prompts shorter "
            f"than {max_input_len}",
        )
    if prompt is None or context_length is None or len(prompt) + max_new_tokens < context_length:
        return item
    room = context_length - 1 - len(prompt)
    if clip and room >= 1:
        item.max_new_tokens = room
        return item
    why = "leave no room for a new token" if clip else f"+ max_new_tokens {max_new_tokens} do not fit"
    return Rejected(
        item.where,
        item.row,
        f"field 'input_ids': {len(prompt)} prompt tokens {why} in the context length of {context_length}",
    )


def check_recipe(item: Row, base: dict[str, Any], params: dict[str, Any]) -> Row | Rejected:
    """A row carrying its own sampling (an OpenAI Batch request line) runs only with it: laid over
    ``base`` it must be the dataset's ``params`` (decision 12), or the row is rejected, never run
    with settings it did not ask for."""
    wanted = {**base, **(item.prompt.sampling or {})}
    if wanted == params:
        return item
    diff = "; ".join(
        f"{key} {wanted.get(key, 'unset')!r}, the dataset's {params.get(key, 'unset')!r}"
        for key in sorted(set(wanted) | set(params))
        if wanted.get(key) != params.get(key)
    )
    return Rejected(
        item.where,
        item.row,
        f"field 'body': its sampling is not the dataset's (one recipe per dataset, set by its first such "
        f"row): {diff}; put rows with other settings in a file of their own, enqueued as another --dataset",
    )
