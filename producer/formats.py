"""Row formats: what a row of a source holds, turned into a :class:`Prompt`.

- ``input_ids``: pre-tokenized, sent as is.
- ``messages``: OpenAI style, a list of ``{"role", "content"}``.
- ``sharegpt``: ``conversations``, a list of ``{"from", "value"}`` with ``human``/``gpt``/``system``.
- ``prompt``: one text; ``instruction``: ``instruction`` and an optional ``input`` (Alpaca style).
- ``openai-batch``: an OpenAI Batch API request line (genq/openai_batch.py): ``/v1/chat/completions``
  a conversation, ``/v1/completions`` a text prompt sent as is (no chat template, as that endpoint
  does); its body's sampling fields travel with the prompt, to be checked against the dataset's.

Regeneration semantics for conversations: the conversation up to its last user turn (or the last
tool result after it: an agentic row is answered where its tool's result came back) is the prompt;
what follows (the assistant answers being regenerated) is dropped. A row's ``tools`` (OpenAI
function declarations) go to the chat template and into the record; assistant ``tool_calls`` and
``tool`` turns are rendered as the template renders them. Content may be a string or a list of
parts: text parts are joined (as vLLM does for string-content templates), other parts (images,
audio) refuse the row: genq sends text only. ``--system-prompt`` replaces the
system turn or adds one. With a tokenizer, text prompts become a one-turn conversation too, so every
prompt goes through the model's chat template; without one, text is sent as ``text`` and
conversations are refused (genq never guesses a chat template).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from genq import conversation, openai_batch
from genq.sampling import SamplingError
from genq.sampling import check as check_sampling

if TYPE_CHECKING:
    from genq.producer.row_template import RowTemplate

FORMATS = ("input_ids", "messages", "sharegpt", "prompt", "instruction", "openai-batch")
# The column each format is detected by, in the order ``auto`` tries them.
KEY_COLUMN = {
    "input_ids": "input_ids",
    "messages": "messages",
    "sharegpt": "conversations",
    "prompt": "prompt",
    "instruction": "instruction",
    "openai-batch": "custom_id",
}
FIELDS = (
    "id",
    "input_ids",
    "messages",
    "conversations",
    "prompt",
    "instruction",
    "input",
    "system",
    "role",
    "content",
    "from",
    "value",
    "tools",
)
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
}
CHAT_FORMATS = ("messages", "sharegpt")


class RowError(ValueError):
    """A row that cannot become a job; the message names the field and what was expected."""


class ShapeError(Exception):
    """Rows of this format cannot be used with these settings at all (not one row's fault)."""


@dataclass
class Prompt:
    """What is sent: ``input_ids``, or ``text``; ``messages`` is the conversation to render
    (and to keep for exports, once rendered)."""

    input_ids: list[int] | None = None
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    source_id: str | None = None
    sampling: dict[str, Any] | None = None  # an openai-batch row's own sampling (genq's names)
    batch: dict[str, Any] | None = None  # an openai-batch row's url and model, kept in the record
    tools: list[dict[str, Any]] | None = None  # the row's function declarations, for the template
    fields: dict[str, Any] | None = None  # the row's own fields kept for the check stage (--keep-field)
    parent: str | None = None  # a stage's row: the id of the record it was made from (producer/stage.py)


@dataclass(frozen=True)
class Shape:
    """How rows become prompts: the format (or ``auto``), column names, and the chat settings."""

    format: str = "auto"
    fields: dict[str, str] = field(default_factory=dict)  # genq's name -> the dataset's column
    system_prompt: str | None = None
    chat: bool = False  # conversations can be sent: a tokenizer renders them, or the server does
    server_renders: bool = False  # the server renders them (a chat backend): no token ids here
    turns: str = "last"  # "all": every user turn is answered in order (genq/conversation.py)
    keep_fields: tuple[str, ...] = ()  # the row's fields copied into its records (a checker's reference)
    template: RowTemplate | None = None  # --template: the row made from the fields first (row_template.py)

    def col(self, name: str) -> str:
        return self.fields.get(name, name)

    def detect(self, data: dict[str, Any]) -> str | None:
        """The format of one row: the first format whose key column it has."""
        if self.format != "auto":
            return self.format
        return next((f for f in FORMATS if self.col(KEY_COLUMN[f]) in data), None)

    def parse(self, data: Any) -> tuple[str, Prompt]:
        """(format, prompt) of one row, with its kept fields; raises :class:`RowError` naming the field.
        With a template, the row it makes of ``data`` (kept fields from either, the made row's first)."""
        if self.template is not None:
            if not isinstance(data, dict):
                raise RowError(f"expected a JSON object, got {_type(data)}")
            made = self.template.apply(data)
            data = {**data, **made}
            fmt, prompt = self._parse(made)
        else:
            fmt, prompt = self._parse(data)
        if self.keep_fields:
            missing = [name for name in self.keep_fields if name not in data]
            if missing:
                raise RowError(f"field '{missing[0]}': missing (--keep-field {missing[0]})")
            prompt.fields = {name: data[name] for name in self.keep_fields}
        return fmt, prompt

    def _parse(self, data: Any) -> tuple[str, Prompt]:
        if not isinstance(data, dict):
            raise RowError(f"expected a JSON object, got {_type(data)}")
        fmt = self.detect(data)
        if fmt is None:
            present = ", ".join(sorted(map(str, data))) or "none"
            names = [repr(self.col(KEY_COLUMN[f])) for f in FORMATS]
            wanted = ", ".join(names[:-1]) + " or " + names[-1]
            hint = self._hint(data)
            raise RowError(f"no prompt: expected field {wanted} (fields present: {present}){hint}")
        if self.col(KEY_COLUMN[fmt]) not in data:
            present = ", ".join(sorted(map(str, data))) or "none"
            raise RowError(f"field '{self.col(KEY_COLUMN[fmt])}': missing (fields present: {present})")
        if fmt == "openai-batch":
            return fmt, self._batch(data)
        self.check_usable(fmt)
        source_id = _source_id(data, self.col("id"))
        if fmt == "input_ids":
            return fmt, Prompt(input_ids=self._ids(data), source_id=source_id)
        if fmt in CHAT_FORMATS:
            turns = self._messages(data) if fmt == "messages" else self._sharegpt(data)
            messages = self._chat(data, turns, fmt)
            return fmt, Prompt(messages=messages, source_id=source_id, tools=self._tools(data))
        text = self._prompt(data) if fmt == "prompt" else self._instruction(data)
        if self.chat:
            turns = [{"role": "user", "content": text}]
            return fmt, Prompt(messages=self._conversation(data, turns, fmt), source_id=source_id)
        return fmt, Prompt(text=text, source_id=source_id)

    def _hint(self, data: dict[str, Any]) -> str:
        """The --field that would read this row, when one of its fields looks like a key column
        (``convos`` for ``conversations``)."""
        present = [str(k) for k in data if k not in FIELDS]  # genq's own names are read as such
        for fmt in FORMATS:
            name = KEY_COLUMN[fmt]
            column = next((c for c in present if _alike(c, self.col(name))), None)
            if column is not None:
                return f"; if '{column}' holds the {fmt} rows, pass --field {name}={column}"
        return ""

    def check_usable(self, fmt: str, what: str | None = None) -> None:
        """``what``: how the rows are named in the message (default: their format)."""
        what = what or f"format {fmt}"
        if fmt == "input_ids" and self.server_renders:
            raise ShapeError(
                "format input_ids is already tokenized: a chat backend (openai-chat) sends messages; use a "
                "token backend (sglang, vllm) for these rows"
            )
        if fmt in CHAT_FORMATS and not self.chat:
            raise ShapeError(
                f"{what} holds conversations: give --tokenizer so they are rendered with the "
                "model's chat template (genq does not guess one), or --backend openai-chat so the "
                "server renders them"
            )
        if fmt == "input_ids" and self.system_prompt is not None:
            raise ShapeError("format input_ids is already tokenized: --system-prompt cannot apply to it")

    # -- one format each ------------------------------------------------------------------

    def _chat(self, data: dict[str, Any], turns: list[dict[str, Any]], fmt: str) -> list[dict[str, Any]]:
        messages = self._conversation(data, turns, fmt)
        why = conversation.check(messages) if self.turns == "all" else None
        if why is not None:
            raise RowError(f"field '{self.col(KEY_COLUMN[fmt])}': {why}")
        return messages

    def _batch(self, data: dict[str, Any]) -> Prompt:
        """A Batch API request: its conversation or text, its sampling checked with SGLang's rules."""
        try:
            request = openai_batch.parse(data)
        except openai_batch.BatchError as exc:
            raise RowError(str(exc)) from exc
        try:
            check_sampling(request.sampling)
        except SamplingError as exc:
            raise RowError(f"field 'body': {exc}") from exc
        prompt = Prompt(source_id=request.custom_id, sampling=request.sampling, batch=request.note)
        if request.url == openai_batch.CHAT_URL:
            self.check_usable("messages", f"url {request.url}")
            prompt.messages = self._chat(request.body, self._messages(request.body), "messages")
            prompt.tools = self._tools(request.body)
            return prompt
        if self.server_renders:
            raise ShapeError(
                f"url {request.url} sends a plain text prompt, no chat template: the openai-chat backend "
                "sends conversations; use a token backend (sglang, vllm, llamacpp) for these rows"
            )
        prompt.text = _text(request.body, "prompt")
        return prompt

    def _ids(self, data: dict[str, Any]) -> list[int]:
        name = self.col("input_ids")
        ids = data[name]
        if not isinstance(ids, list) or not ids:
            raise RowError(f"field '{name}': expected a non-empty list of integers, got {_type(ids)}")
        if set(map(type, ids)) == {int} and min(ids) >= 0:  # the common case, checked in C
            return ids
        i, tok = next((i, t) for i, t in enumerate(ids) if type(t) is not int or t < 0)
        raise RowError(f"field '{name}'[{i}]: expected a non-negative integer, got {tok!r}")

    def _prompt(self, data: dict[str, Any]) -> str:
        return _text(data, self.col("prompt"))

    def _instruction(self, data: dict[str, Any]) -> str:
        text = _text(data, self.col("instruction"))
        extra = data.get(self.col("input"))
        if extra is None or extra == "":
            return text
        if not isinstance(extra, str):
            raise RowError(f"field '{self.col('input')}': expected a string, got {_type(extra)}")
        return f"{text}\n\n{extra}"

    def _messages(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        name, role, content = self.col("messages"), self.col("role"), self.col("content")
        turns = []
        for i, turn in enumerate(_turns(data, name)):
            where = f"field '{name}'[{i}]"
            if not isinstance(turn, dict):
                raise RowError(
                    f"{where}: expected an object with '{role}' and '{content}', not {_type(turn)}"
                )
            if role not in turn:
                raise RowError(f"{where}.{role}: missing (the turn has {_keys(turn)})")
            if not isinstance(turn.get(role), str) or not turn[role]:
                raise RowError(f"{where}.{role}: expected a non-empty string, got {_type(turn.get(role))}")
            text = turn.get(content)
            if content not in turn and not turn.get("tool_calls"):
                raise RowError(f"{where}.{content}: missing (the turn has {_keys(turn)})")
            if isinstance(text, list):
                text = _text_parts(text, f"{where}.{content}")
            if not isinstance(text, str) and not (text is None and turn.get("tool_calls")):
                raise RowError(
                    f"{where}.{content}: expected a string or a list of text parts, got {_type(text)}"
                )
            calls = turn.get("tool_calls")
            if calls is not None and not (
                isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
            ):
                raise RowError(f"{where}.tool_calls: expected a list of objects, got {_type(calls)}")
            rest = {k: v for k, v in turn.items() if k not in (role, content)}
            turns.append({"role": turn[role], "content": text, **rest})
        return turns

    def _sharegpt(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        name, speaker, value = self.col("conversations"), self.col("from"), self.col("value")
        turns = []
        for i, turn in enumerate(_turns(data, name)):
            where = f"field '{name}'[{i}]"
            if not isinstance(turn, dict):
                raise RowError(
                    f"{where}: expected an object with '{speaker}' and '{value}', not {_type(turn)}"
                )
            for key in (speaker, value):
                if key not in turn:
                    raise RowError(f"{where}.{key}: missing (the turn has {_keys(turn)})")
            role = SHAREGPT_ROLES.get(turn.get(speaker)) if isinstance(turn.get(speaker), str) else None
            if role is None:
                known = ", ".join(SHAREGPT_ROLES)
                raise RowError(f"{where}.{speaker}: expected one of {known}, got {turn.get(speaker)!r}")
            if not isinstance(turn.get(value), str):
                raise RowError(f"{where}.{value}: expected a string, got {_type(turn.get(value))}")
            turns.append({"role": role, "content": turn[value]})
        return turns

    def _conversation(self, data: dict[str, Any], turns: list[dict[str, Any]], fmt: str) -> list[dict]:
        """The prompt: up to the last user turn, with the system turn of the row or --system-prompt."""
        name = self.col(KEY_COLUMN[fmt])
        last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=None)
        if last_user is None:
            roles = ", ".join(t["role"] for t in turns)
            raise RowError(f"field '{name}': the conversation has no user turn to answer (roles: {roles})")
        # The last turn the assistant answers: the last user turn, or a tool's result after it.
        last = max(
            i for i, t in enumerate(turns) if i == last_user or (i > last_user and t["role"] == "tool")
        )
        turns = turns[: last + 1]
        system = self.system_prompt
        if system is None:
            system = self._row_system(data)
            if system is None or turns[0]["role"] == "system":  # the row's own system turn wins
                return turns
        if turns[0]["role"] == "system":
            return [{**turns[0], "content": system}, *turns[1:]]
        return [{"role": "system", "content": system}, *turns]

    def _tools(self, data: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The row's function declarations (OpenAI's ``tools``: ``{"type": "function", "function":
        {"name", ...}}``), a list or a JSON text of one (as some ShareGPT sets store it); None: none."""
        name = self.col("tools")
        tools = data.get(name)
        if tools is None or tools == [] or tools == "":
            return None
        if isinstance(tools, str):
            try:
                tools = orjson.loads(tools)
            except orjson.JSONDecodeError as exc:
                raise RowError(f"field '{name}': a string that is not JSON ({exc})") from exc
        if not isinstance(tools, list):
            raise RowError(f"field '{name}': expected a list of function declarations, got {_type(tools)}")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RowError(
                    f'field \'{name}\'[{i}]: expected {{"type": "function", "function": {{"name": ...}}}}'
                )
        return tools

    def _row_system(self, data: dict[str, Any]) -> str | None:
        """A system prompt in its own column (some ShareGPT sets have one), if set."""
        name = self.col("system")
        system = data.get(name)
        if system is not None and not isinstance(system, str):
            raise RowError(f"field '{name}': expected a string, got {_type(system)}")
        return system or None


def _turns(data: dict[str, Any], name: str) -> list[Any]:
    turns = data[name]
    if not isinstance(turns, list) or not turns:
        raise RowError(f"field '{name}': expected a non-empty list of turns, got {_describe(turns)}")
    return turns


def _text_parts(parts: list[Any], where: str) -> str:
    """A content list of text parts as one text; another part (an image, audio) refuses the row."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"a {kind!r} part" if isinstance(kind, str) else f"{_type(part)}, not a text part"
            raise RowError(
                f"{where}[{j}]: {what}: genq sends text only (images and audio are not rendered into "
                "token ids); drop the part, or the row"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _text(data: dict[str, Any], name: str) -> str:
    text = data.get(name)
    if not isinstance(text, str) or not text.strip():
        raise RowError(f"field '{name}': expected a non-empty string")
    return text


def _source_id(data: dict[str, Any], name: str) -> str | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise RowError(f"field '{name}': expected a string or integer, got {_type(value)}")
    return str(value)


def _alike(column: str, wanted: str) -> bool:
    """A column name that is probably ``wanted`` under another name: a prefix of 4+ letters
    either way (convos, conv, prompts), or close in spelling."""
    if column == wanted:
        return False
    a, b = column.lower(), wanted.lower()
    if len(a) >= 4 and len(b) >= 4 and (a.startswith(b[:4]) or b.startswith(a[:4])):
        return True
    return difflib.SequenceMatcher(None, a, b).ratio() >= 0.8


def _keys(turn: dict[str, Any]) -> str:
    return ", ".join(repr(str(k)) for k in turn) or "no fields"


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _describe(value: Any) -> str:
    return "an empty list" if value == [] else _type(value)
