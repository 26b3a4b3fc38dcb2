"""The model's chat template, applied offline and in batches (decision 6: token ids are the truth).

A tokenizer is loaded with transformers from a local folder or the local Hugging Face cache, never
downloaded. Each batch of conversations goes through one ``apply_chat_template(...,
add_generation_prompt=True, tokenize=True)`` call: one Jinja render per conversation, then one
batched encode in the Rust tokenizer (in transformers 5 that call returns a ``BatchEncoding``).
A conversation the template refuses (many raise on roles that do not alternate) is rejected alone.

transformers is imported here only, and only when a template is used: `genq enqueue --tokenizer`,
`genq export --tokenizer`, a worker rendering a conversation's turns.

A tokenizer may be code: Kimi-K2/K2.5 ship ``tokenization_kimi.py`` (a PreTrainedTokenizer over a
tiktoken rank file) named by ``auto_map`` in tokenizer_config.json, which transformers imports
only with ``trust_remote_code=True`` (transformers/models/auto/tokenization_auto.py,
``resolve_trust_remote_code``; left at None it asks ``[y/N]`` on a terminal). genq always passes
it explicitly, from the host's own consent (``--trust-remote-code``), never from Redis; without
consent such a tokenizer is refused before transformers is asked, naming the file that would run.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'genq[datasets]'"
TRUST_FLAG = "--trust-remote-code (or GENQ_TRUST_REMOTE_CODE=1)"
# Layouts that need a package beyond transformers: (a file that marks it, no file that spares it,
# the package, genq's extra that installs it).
_LAYOUT_PACKAGES = (
    ("tiktoken.model", None, "tiktoken", "tiktoken"),  # Kimi-K2's rank file, read by its code
    ("tokenizer.model", "tokenizer.json", "sentencepiece", "sentencepiece"),  # Llama-2/Mistral era
)


class TemplateError(Exception):
    """The tokenizer cannot be loaded, or has no chat template."""


class RemoteCodeRefused(TemplateError):
    """The tokenizer is code, and this host has not consented to run it."""


def _folder(name: str) -> Path | None:
    """The folder the tokenizer loads from: the local folder, or the cached repo's snapshot."""
    if os.path.isdir(name):
        return Path(name)
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "tokenizer_config.json")
    return Path(found).parent if isinstance(found, str) else None


def code_files(folder: Path) -> list[str]:
    """The Python files transformers would import to build the folder's tokenizer: the modules
    ``auto_map`` names for AutoTokenizer, in tokenizer_config.json or else config.json (as
    tokenization_auto.py looks them up); ``repo--module.Class`` names code in another repo."""
    for file in ("tokenizer_config.json", "config.json"):
        try:
            auto_map = json.loads((folder / file).read_text()).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue
        refs = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
        if refs:
            refs = [refs] if isinstance(refs, str) else refs
            return sorted({f"{str(ref).rsplit('.', 1)[0]}.py" for ref in refs if ref})
    return []


def _code_digest(folder: Path) -> str:
    """A hash of every Python file of the folder (the auto_map module and whatever it imports
    beside it): a changed ``tokenization_*.py`` is another tokenizer."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _missing_package(folder: Path) -> str | None:
    """The one line naming the package this layout needs and this host lacks, or None."""
    import importlib.util

    for marker, spares, package, extra in _LAYOUT_PACKAGES:
        needed = (folder / marker).exists() and not (spares and (folder / spares).exists())
        if needed and importlib.util.find_spec(package) is None:
            return f"its {marker} needs the {package} package: pip install 'genq[{extra}]'"
    return None


def _others_can_write(folder: Path, files: list[str]) -> str | None:
    """The first of the folder and its code files that another user could change (owned by
    another user than this one or root, or writable by group or others), or None: consent is
    for code this host's owner put there, not for a file dropped in a shared folder."""
    for path in [folder, *(folder / f for f in files if "--" not in f)]:
        try:
            info = path.stat()
        except OSError:
            continue
        if info.st_uid not in (0, os.getuid()) or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return str(path)
    return None


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
    def __init__(self, name: str, kwargs: dict[str, Any] | None = None, trust_remote_code: bool = False):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # "PyTorch was not found" on every load: by design (tokenizers only). transformers 4.x says it
        # as an advisory warning, 5.x through its logger at import, at the level TRANSFORMERS_VERBOSITY sets.
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise TemplateError(f"--tokenizer needs transformers: {INSTALL_HINT}") from exc
        if not os.path.exists(name) and not _repo_id(name):
            raise TemplateError(
                f"tokenizer {name!r} not found: not a local folder and not a Hugging Face repo id; pass a "
                "path or a repo id"
            )
        if not os.path.exists(name) and not _cached(name) and "/" not in name:
            raise TemplateError(
                f"tokenizer {name!r} not found: not a local folder, and not in the local Hugging Face cache; "
                "a Hub repo id names its owner too (e.g. Qwen/Qwen3-8B): pass that, or a path"
            )
        if not os.path.exists(name) and not _cached(name):
            raise TemplateError(
                f"tokenizer {name!r} not found: not a local folder, and the Hugging Face repo is not in the "
                f"local cache (genq never downloads: `hf download {name}` first, or pass a path)"
            )
        folder = _folder(name)
        self.code = code_files(folder) if folder is not None else []
        self._code_digest = _code_digest(folder) if folder is not None and self.code else None
        if self.code and not trust_remote_code:
            raise RemoteCodeRefused(
                f"--tokenizer {name}: the tokenizer is code ({', '.join(self.code)}), which genq runs only "
                f"on a host that consents: give {TRUST_FLAG} if you trust it"
            )
        if self.code and folder is not None:
            shared = _others_can_write(folder, self.code)
            if shared is not None:
                raise RemoteCodeRefused(
                    f"--tokenizer {name}: {shared} can be changed by other users of this host, so its code "
                    "is not run even with --trust-remote-code: copy the tokenizer into a folder of your own"
                )
        missing = _missing_package(folder) if folder is not None else None
        if missing is not None:
            raise TemplateError(f"--tokenizer {name}: {missing}")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(
                name, local_files_only=True, trust_remote_code=bool(self.code)
            )
        except (OSError, ValueError, ImportError) as exc:
            why = " ".join(str(exc).split())  # transformers' messages run over several lines
            raise TemplateError(f"--tokenizer {name}: cannot load it (genq never downloads): {why}") from exc
        if not getattr(self.tokenizer, "chat_template", None):
            raise TemplateError(f"--tokenizer {name}: it has no chat template")
        self.name = name
        self.kwargs = dict(kwargs or {})

    @classmethod
    def from_spec(
        cls, spec: dict[str, Any], prompting: dict[str, Any], trust_remote_code: bool = False
    ) -> ChatTemplate:
        """The template a job names (:meth:`spec`), loaded here. TemplateError if it is not the one
        its dataset's settings (``prompting``) recorded: a job is Redis content, and must not pick
        the tokenizer folder or smuggle a ``chat_template`` in through the kwargs; or if this
        host's copy of the tokenizer renders with another template than enqueue's did (its code
        too). Code runs only with this host's ``trust_remote_code``, whatever Redis says."""
        cls.check_spec(spec, prompting)
        return cls.load_spec(spec, trust_remote_code)

    @staticmethod
    def check_spec(spec: dict[str, Any], prompting: dict[str, Any]) -> None:
        """TemplateError unless ``spec`` is the template its dataset's settings recorded."""
        recorded = {
            "tokenizer": prompting.get("tokenizer"),
            "kwargs": prompting.get("chat_template_kwargs") or {},
            "fingerprint": prompting.get("chat_template"),
        }
        if {**spec, "kwargs": spec.get("kwargs") or {}} != recorded:
            raise TemplateError(
                f"the job's chat template {spec} is not the one its dataset recorded {recorded}"
            )

    @classmethod
    def load_spec(cls, spec: dict[str, Any], trust_remote_code: bool = False) -> ChatTemplate:
        """The template of a ``spec`` checked with :meth:`check_spec`, loaded here; TemplateError if
        this host's copy renders with another template (or code) than enqueue's did."""
        template = cls(spec["tokenizer"], spec.get("kwargs"), trust_remote_code)
        if template.fingerprint != spec.get("fingerprint"):
            what = "chat template and code" if template.code else "chat template"
            raise TemplateError(
                f"--tokenizer {spec['tokenizer']}: this host's {what} "
                f"({template.fingerprint}) are not the ones the dataset was enqueued with "
                f"({spec.get('fingerprint')}): give this host the tokenizer the dataset was enqueued with"
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
        if self._code_digest is not None:  # a tokenizer that is code: the code is part of it
            text += "\0code\0" + self._code_digest
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def render(
        self,
        conversations: list[list[dict[str, Any]]],
        tools: list[list[dict[str, Any]] | None] | None = None,
    ) -> list[list[int] | str]:
        """Prompt ids for each conversation (with its ``tools``, if any), or the template's error
        message for that one. One batched call when no conversation declares tools (the template
        takes one ``tools`` per call), else one call each."""
        tools = tools or [None] * len(conversations)
        if not any(tools):
            try:
                return self._render(conversations)
            except Exception:  # one bad conversation fails the batch: find it below
                pass
        out: list[list[int] | str] = []
        for conversation, declared in zip(conversations, tools, strict=True):
            try:
                out.extend(self._render([conversation], declared))
            except Exception as exc:  # a template can raise anything; the row says what
                out.append(f"chat template: {type(exc).__name__}: {exc}")
        return out

    def _render(
        self, conversations: list[list[dict[str, Any]]], tools: list[dict[str, Any]] | None = None
    ) -> list[list[int]]:
        encoded = self.tokenizer.apply_chat_template(
            conversations,
            tools=tools,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **self.kwargs,
        )
        return [list(ids) for ids in encoded["input_ids"]]

    def ids(
        self,
        messages: list[dict[str, Any]],
        generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """One conversation's ids (raises what the template raises)."""
        encoded = self.tokenizer.apply_chat_template(
            [messages],
            tools=tools,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=True,
            **self.kwargs,
        )
        return list(encoded["input_ids"][0])

    def assistant_spans(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[int]] | str:
        """The whole conversation's ids and a loss mask of 1 over every assistant turn (its end-of-turn
        tokens included), 0 elsewhere — what SpecForge's preprocessing trains a drafter on. A
        string says why not: the template renders a prefix differently once more turns follow it."""
        try:
            whole = self.ids(messages, generation_prompt=False, tools=tools)
            mask = [0] * len(whole)
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                before = self.ids(messages[:i], generation_prompt=True, tools=tools)
                through = self.ids(messages[: i + 1], generation_prompt=False, tools=tools)
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
