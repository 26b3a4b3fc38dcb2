"""Think markers: where a reasoning model's thought starts and ends, so workers can split the output.

The worker has no tokenizer, so every job carries its dataset's markers as text (to split SGLang's
``text``) and, where known, as token ids (to split ``output_ids``). With ``--tokenizer`` the ids and
texts are looked up in it; without one a marker needs its text. An end marker that is a special
token vanishes from ``text`` under SGLang's default ``skip_special_tokens=true``, so such datasets
are sent with ``skip_special_tokens: false``.

Preset ids, from each family's tokenizer files (``added_tokens_decoder``):
- deepseek-r1: ``<think>`` 128798, ``</think>`` 128799, not special (DeepSeek-R1/V3.1 tokenizer).
- qwen3: ``<think>`` 151667, ``</think>`` 151668, not special (Qwen3 tokenizer_config.json).
- kimi-k2: ``</think>`` 163607, special (Kimi-K2-Thinking / K2.5; ``<think>`` taken as 163606, the id
  before it, not checked against the tokenizer files). With ``--tokenizer`` the tokenizer's own ids win.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from genq.templates import ChatTemplate

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class Preset:
    start_id: int
    end_id: int
    special: bool


PRESETS: dict[str, Preset | None] = {
    "deepseek-r1": Preset(128798, 128799, special=False),
    "qwen3": Preset(151667, 151668, special=False),
    "kimi-k2": Preset(163606, 163607, special=True),
    "none": None,
}


class ThinkError(ValueError):
    """Markers that cannot work: the message says which flag to give."""


def resolve(
    preset: str | None,
    start: str | None,
    start_id: int | None,
    end: str | None,
    end_id: int | None,
    template: ChatTemplate | None,
) -> tuple[dict[str, Any] | None, bool]:
    """The markers a job carries (``start``, ``start_id``, ``end``, ``end_id``; unknown ones left
    out), or None for no split; and whether the end marker is a special token."""
    explicit = any(v is not None for v in (start, start_id, end, end_id))
    if preset == "none":
        if explicit:
            raise ThinkError("--reasoning-preset none splits nothing: drop the --think-* flags")
        return None, False
    chosen = PRESETS[preset] if preset else None
    if chosen is not None:
        start = start if start is not None or start_id is not None else THINK_START
        end = end if end is not None or end_id is not None else THINK_END
    if end is None and end_id is None:
        if explicit:
            raise ThinkError("--think-start needs --think-end or --think-end-token-id: the end splits")
        return None, False
    if template is not None:
        start, start_id = _lookup(template, "start", start, start_id)
        end, end_id = _lookup(template, "end", end, end_id)
        special = end_id is not None and template.is_special(end_id)
    else:
        if chosen is not None and start_id is None and start == THINK_START:
            start_id = chosen.start_id
        if chosen is not None and end_id is None and end == THINK_END:
            end_id = chosen.end_id
        for name, text, token in (("start", start, start_id), ("end", end, end_id)):
            if token is not None and text is None:
                raise ThinkError(
                    f"--think-{name}-token-id {token} needs its text (--think-{name} TEXT) or --tokenizer to "
                    "look it up: workers split SGLang's text and have no tokenizer"
                )
        special = chosen is not None and chosen.special and end_id == chosen.end_id
    markers = {"start": start, "start_id": start_id, "end": end, "end_id": end_id}
    return {k: v for k, v in markers.items() if v is not None}, special


def _lookup(
    template: ChatTemplate, name: str, text: str | None, token: int | None
) -> tuple[str | None, int | None]:
    """Complete a marker from the tokenizer; refuse a text and an id that disagree."""
    if text is None and token is None:
        return None, None
    if text is None:
        return template.token_text(token), token
    found = template.token_id(text)
    if token is not None and found != token:
        what = f"is token {found}" if found is not None else "is not a single token"
        raise ThinkError(f"--think-{name} {text!r} {what} in {template.name}, not {token}")
    return text, found
