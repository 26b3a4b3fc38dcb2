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


def _repo_id(name: str) -> bool:
    """Whether ``name`` can be a Hub repo id, by the Hub's own rule (huggingface_hub's
    utils/_validators.py validate_repo_id), so a mistyped path is not reported as a repo."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _cached(repo: str) -> bool:
    """Whether the local Hugging Face cache holds the repo's tokenizer config."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo, "tokenizer_config.json"), str)


class ChatTemplate:
    def __init__(self, name: str, kwargs: dict[str, Any] | None = None):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch was not found": by design
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise TemplateError(f"--tokenizer needs transformers: {INSTALL_HINT}") from exc
        if not os.path.exists(name) and not _repo_id(name):
            raise TemplateError(
                f"tokenizer {name!r} not found: not a local folder and not a Hugging Face repo id; pass a "
                "path or a repo id"
            )
        if not os.path.exists(name) and not _cached(name):
            raise TemplateError(
                f"tokenizer {name!r} not found: not a local folder, and the Hugging Face repo is not in the "
                f"local cache (genq never downloads: `hf download {name}` first, or pass a path)"
            )
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError) as exc:
            why = " ".join(str(exc).split())  # transformers' messages run over several lines
            raise TemplateError(f"--tokenizer {name}: cannot load it (genq never downloads): {why}") from exc
        if not getattr(self.tokenizer, "chat_template", None):
            raise TemplateError(f"--tokenizer {name}: it has no chat template")
        self.name = name
        self.kwargs = dict(kwargs or {})

    @classmethod
    def from_spec(cls, spec: dict[str, Any], prompting: dict[str, Any]) -> ChatTemplate:
        """The template a job names (:meth:`spec`), loaded here. TemplateError if it is not the one
        its dataset's settings (``prompting``) recorded: a job is Redis content, and must not pick
        the tokenizer folder or smuggle a ``chat_template`` in through the kwargs; or if this
        host's copy of the tokenizer renders with another template than enqueue's did."""
        recorded = {
            "tokenizer": prompting.get("tokenizer"),
            "kwargs": prompting.get("chat_template_kwargs") or {},
            "fingerprint": prompting.get("chat_template"),
        }
        if {**spec, "kwargs": spec.get("kwargs") or {}} != recorded:
            raise TemplateError(
                f"the job's chat template {spec} is not the one its dataset recorded {recorded}"
            )
        template = cls(spec["tokenizer"], spec.get("kwargs"))
        if template.fingerprint != spec.get("fingerprint"):
            raise TemplateError(
                f"--tokenizer {spec['tokenizer']}: this host's chat template ({template.fingerprint}) is "
                f"not the one the dataset was enqueued with ({spec.get('fingerprint')})"
            )
        return template

    def spec(self) -> dict[str, Any]:
        """What a worker needs to load this template again: name, kwargs, fingerprint."""
        return {"tokenizer": self.name, "kwargs": self.kwargs, "fingerprint": self.fingerprint}

    @property
    def fingerprint(self) -> str:
        """A short hash of the template that renders: a changed template is another recipe (decision
        12). A ``chat_template`` in the kwargs replaces the tokenizer's (or picks one of its named
        ones), so it is hashed too; the other kwargs are recorded beside it (``chat_template_kwargs``),
        and a fingerprint without them matches the ones datasets already carry."""
        template = self.tokenizer.chat_template
        text = template if isinstance(template, str) else repr(sorted(template.items()))
        override = self.kwargs.get("chat_template")
        if override is not None:
            text += "\0" + str(override)
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

    def ids(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        """One conversation's ids (raises what the template raises)."""
        encoded = self.tokenizer.apply_chat_template(
            [messages],
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=True,
            **self.kwargs,
        )
        return list(encoded["input_ids"][0])

    def assistant_spans(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]] | str:
        """The whole conversation's ids and a loss mask of 1 over every assistant turn (its end-of-turn
        tokens included), 0 elsewhere — what SpecForge's preprocessing trains a drafter on. A
        string says why not: the template renders a prefix differently once more turns follow it."""
        try:
            whole = self.ids(messages, generation_prompt=False)
            mask = [0] * len(whole)
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                before = self.ids(messages[:i], generation_prompt=True)
                through = self.ids(messages[: i + 1], generation_prompt=False)
                if through[: len(before)] != before or whole[: len(through)] != through:
                    return f"the chat template renders turn {i} differently once more turns follow it"
                mask[len(before) : len(through)] = [1] * (len(through) - len(before))
        except Exception as exc:  # a template can raise anything; the record says what
            return f"chat template: {type(exc).__name__}: {exc}"
        return whole, mask

    def encode(self, text: str) -> list[int]:
        """Plain text as an engine's tokenizer manager reads a ``text`` prompt (SGLang's
        tokenizer_manager.py: ``tokenizer.encode(text)``, special tokens such as BOS added)."""
        return list(self.tokenizer.encode(text))

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
