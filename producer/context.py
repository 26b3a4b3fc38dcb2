"""The model's context length, so prompts that cannot fit are rejected (or clipped) before they are queued.

SGLang answers such a prompt with a 400 anyway; catching it here names the row in the source
file and keeps it out of the queue and off the GPU hosts.
"""

from __future__ import annotations

import json
import urllib.request

from producer.readers import Rejected, Row


def context_length_of(server: str, timeout: float = 15.0) -> int:
    """From SGLang's ``/server_info``: ``context_length`` if set, else ``max_req_input_len`` + 1."""
    url = server.rstrip("/") + "/server_info"
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - the user's own server
        info = json.loads(resp.read())
    if isinstance(info.get("context_length"), int):
        return info["context_length"]
    if isinstance(info.get("max_req_input_len"), int):
        return info["max_req_input_len"] + 1
    raise ValueError(f"{url} names neither context_length nor max_req_input_len")


def check_fits(item: Row, max_new_tokens: int, context_length: int, clip: bool = False) -> Row | Rejected:
    """SGLang refuses prompt + max_new_tokens >= the context length with a 400.

    With ``clip``, a prompt that leaves room for at least one new token gets ``max_new_tokens``
    lowered to what fits (``item.max_new_tokens``) instead. Text prompts have no known length here.
    """
    prompt = item.prompt.input_ids
    if prompt is None or len(prompt) + max_new_tokens < context_length:
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
