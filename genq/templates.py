"""The model's chat template, applied offline and in batches (decision 6: token ids are the truth).

A tokenizer is loaded with transformers from a local folder or the local Hugging Face cache, never
downloaded. Each batch of conversations goes through one ``apply_chat_template(...,
add_generation_prompt=True, tokenize=True)`` call: one Jinja render per conversation, then one
batched encode in the Rust tokenizer (in transformers 5 that call returns a ``BatchEncoding``).
A conversation the template refuses (many raise on roles that do not alternate) is rejected alone.

transformers is imported here only, and only when a template is used: `genq enqueue --tokenizer`,
`genq export --tokenizer`.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

INSTALL_HINT = "pip install 'genq[datasets]'"


class TemplateError(Exception):
    """The tokenizer cannot be loaded, or has no chat template."""


class ChatTemplate:
    def __init__(self, name: str, kwargs: dict[str, Any] | None = None):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch was not found": by design
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise TemplateError(f"--tokenizer needs transformers: {INSTALL_HINT}") from exc
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise TemplateError(
                f"--tokenizer {name}: cannot load it from a local folder or the local Hugging Face cache "
                f"(genq never downloads): {exc}"
            ) from exc
        if not getattr(self.tokenizer, "chat_template", None):
            raise TemplateError(f"--tokenizer {name}: it has no chat template")
        self.name = name
        self.kwargs = dict(kwargs or {})

    @property
    def fingerprint(self) -> str:
        """A short hash of the template text: a changed template is another recipe (decision 12)."""
        template = self.tokenizer.chat_template
        text = template if isinstance(template, str) else repr(sorted(template.items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def render(self, conversations: list[list[dict[str, Any]]]) -> list[list[int] | str]:
        """Prompt ids for each conversation, or the template's error message for that one."""
        try:
            return self._render(conversations)
        except Exception:  # one bad conversation fails the batch: find it below
            pass
        out: list[list[int] | str] = []
        for conversation in conversations:
            try:
                out.extend(self._render([conversation]))
            except Exception as exc:  # a template can raise anything; the row says what
                out.append(f"chat template: {type(exc).__name__}: {exc}")
        return out

    def _render(self, conversations: list[list[dict[str, Any]]]) -> list[list[int]]:
        encoded = self.tokenizer.apply_chat_template(
            conversations, add_generation_prompt=True, tokenize=True, return_dict=True, **self.kwargs
        )
        return [list(ids) for ids in encoded["input_ids"]]

    def render_answer(
        self, messages: list[dict[str, Any]], answer: dict[str, Any]
    ) -> tuple[list[int], list[int]] | str:
        """(prompt ids, answer ids) of a conversation and its regenerated answer, as the template
        renders the whole: the answer's ids are what follows the prompt (its end-of-turn tokens
        included). A string says why it cannot be done (the template rewrote the prompt part)."""
        prompt = self._render([messages])[0]
        whole = self.tokenizer.apply_chat_template(
            [[*messages, answer]], tokenize=True, return_dict=True, **self.kwargs
        )["input_ids"][0]
        whole = list(whole)
        if whole[: len(prompt)] != prompt:
            return "the chat template renders the prompt differently once the answer follows it"
        return prompt, whole[len(prompt) :]

    # -- single tokens (think markers) ----------------------------------------------------

    def token_id(self, text: str) -> int | None:
        """The id of ``text`` when it is exactly one token, else None."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        """Special tokens vanish from SGLang's ``text`` under its default skip_special_tokens."""
        added = self.tokenizer.added_tokens_decoder.get(token_id)
        return bool(added is not None and added.special)
