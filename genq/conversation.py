"""A conversation regenerated turn by turn (``genq enqueue --turns all``), as SpecForge regenerates
EAGLE-3 drafter data: the model answers user turn 1, its answer replaces the dataset's assistant
turn, it answers user turn 2 with its own earlier answer in the context, and so on.

The job holds the source conversation; the worker asks :func:`turn_prompt` for the conversation
of each turn and renders it (token backends: the dataset's chat template; a chat backend: the
server). The producer and the worker share these rules, so what enqueue checks is what is sent.
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant")
# What a conversation record keeps of each turn (its ``turns`` list).
TURN_FIELDS = (
    "input_ids",
    "output_ids",
    "text",
    "reasoning",
    "content",
    "finish_reason",
    "matched_stop",
    "finish_length",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "attempts",
)


def check(messages: list[dict[str, Any]]) -> str | None:
    """Why a conversation cannot be regenerated turn by turn, or None."""
    for i, message in enumerate(messages):
        if message.get("role") == "tool" or message.get("tool_calls"):
            return (
                f"turn {i} is tool use: --turns all regenerates dialogues of {', '.join(ROLES)} turns only "
                "(the model's own calls would need the tools run again); --turns last answers the last "
                "user turn or tool result with the conversation before it"
            )
        if message.get("role") not in ROLES:
            return (
                f"turn {i} has role {message.get('role')!r}: --turns all regenerates dialogues of "
                f"{', '.join(ROLES)} turns only"
            )
    if not any(m["role"] == "user" for m in messages):
        return "the conversation has no user turn"
    return None


def user_turns(messages: list[dict[str, Any]]) -> int:
    return sum(1 for m in messages if m["role"] == "user")


def turn_prompt(
    messages: list[dict[str, Any]], answers: list[dict[str, Any]], k: int
) -> list[dict[str, Any]]:
    """The conversation sent for user turn ``k`` (0-based): the system turns and the user turns up
    to ``k``, each earlier user turn followed by the model's own answer (``answers[i]``) in place of
    the dataset's assistant turn."""
    out: list[dict[str, Any]] = []
    seen = 0
    for message in messages:
        role = message["role"]
        if role == "assistant":
            continue  # the dataset's answers are what is regenerated
        if role == "user":
            if seen > k:
                break
            out.append(message)
            if seen < k:
                out.append(answers[seen])
            seen += 1
        else:
            out.append(message)
    return out


def first_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return turn_prompt(messages, [], 0)


def answer_message(content: str | None, reasoning: str | None) -> dict[str, Any]:
    """The model's answer as the next turn's context: its content, and its reasoning under
    ``reasoning_content`` for templates that render (or drop) earlier thoughts."""
    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def totals(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """A conversation record's counts: the sums of its turns' (cached tokens unknown if any is)."""
    cached = [t["cached_tokens"] for t in turns]
    return {
        "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "completion_tokens": sum(t["completion_tokens"] for t in turns),
        "cached_tokens": None if any(c is None for c in cached) else sum(cached),
        "attempts": sum(t["attempts"] for t in turns),
    }
