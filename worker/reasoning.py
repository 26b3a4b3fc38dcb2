"""Split a reasoning model's output into ``reasoning`` and ``content`` by the job's think markers.

The text split uses the end marker's text in SGLang's ``text`` (the producer makes sure it stays
there); ``reasoning_tokens`` counts the output ids up to and including the end marker's id, so the
ids can be split the same way. An output whose thought never ends (cut by ``max_new_tokens``) is
all reasoning when the thought was open: the chat template put the start marker at the end of the
prompt (R1-0528, Qwen3-Thinking, Kimi-K2.5 do) or the output starts with it. Otherwise an output
without the end marker is all content (the model did not think).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PROMPT_TAIL_IDS = 8  # where a template's opening marker sits: the last few prompt tokens
PROMPT_TAIL_CHARS = 64


@dataclass
class Split:
    reasoning: str | None
    content: str | None
    reasoning_tokens: int | None


def split(
    think: dict[str, Any],
    output_ids: list[int],
    text: str | None,
    prompt_ids: list[int] | None = None,
    prompt_text: str | None = None,
) -> Split:
    start, end = think.get("start"), think["end"]
    start_id, end_id = think.get("start_id"), think.get("end_id")
    opened = _opened_by_prompt(think, prompt_ids, prompt_text) or _opens_output(
        start, start_id, output_ids, text
    )
    reasoning: str | None = None
    content = text
    pos = text.find(end) if text is not None else -1
    if pos >= 0:
        reasoning = _drop_start(text[:pos], start).strip()
        content = text[pos + len(end) :].lstrip()
    elif opened and text is not None:
        reasoning, content = _drop_start(text, start).strip(), None
    return Split(reasoning, content, _reasoning_tokens(end_id, output_ids, opened))


def _reasoning_tokens(end_id: int | None, output_ids: list[int], opened: bool) -> int | None:
    """Output ids up to and including the end marker; all of them for a thought that never ended."""
    if end_id is None:
        return None
    if end_id in output_ids:
        return output_ids.index(end_id) + 1
    return len(output_ids) if opened else 0


def _opened_by_prompt(think: dict[str, Any], prompt_ids: list[int] | None, prompt_text: str | None) -> bool:
    """The prompt ends inside a thought: its last start marker is not followed by an end marker."""
    start, end = think.get("start"), think["end"]
    start_id, end_id = think.get("start_id"), think.get("end_id")
    if prompt_ids is not None and start_id is not None:
        tail = prompt_ids[-PROMPT_TAIL_IDS:]
        if start_id in tail:
            last = len(tail) - 1 - tail[::-1].index(start_id)
            return end_id is None or end_id not in tail[last:]
        return False
    if prompt_text is not None and start:
        tail = prompt_text[-PROMPT_TAIL_CHARS:]
        last = tail.rfind(start)
        return last >= 0 and end not in tail[last:]
    return False


def _opens_output(start: str | None, start_id: int | None, output_ids: list[int], text: str | None) -> bool:
    if start_id is not None and output_ids[:1] == [start_id]:
        return True
    return bool(start) and text is not None and text.lstrip().startswith(start)


def _drop_start(text: str, start: str | None) -> str:
    stripped = text.lstrip()
    return stripped[len(start) :] if start and stripped.startswith(start) else text
