"""``--template``: a row made from fields, rendered at enqueue on the enqueueing host.

A Jinja template (sandboxed: no attribute of Python's internals, no file, no import) turns the
fields of a row — an ordinary dataset's columns, or a record of the dataset a stage follows
(producer/stage.py) — into the row genq enqueues: the rendered text is the ``prompt``, unless it
is a JSON object (the row itself: ``messages``, ``prompt``, ...) or a JSON list (its
``messages``). A field the template names that the row lacks is that row's error (StrictUndefined),
never an empty string. In Python the template may be a function of the row instead, run here only:
a Redis entry is never code. Its fingerprint (of the template's text, or of the function's source)
is recorded in the dataset's settings, so a changed template is refused as a changed recipe.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson

from genq.producer.formats import RowError


class TemplateRefused(ValueError):
    """A template that cannot be used (it does not parse, or names what no row has): one line."""


class RowTemplate:
    """A template or function that makes a row from fields; :meth:`apply` raises RowError."""

    def __init__(
        self, render: Callable[[Mapping[str, Any]], Any], fingerprint: str, names: frozenset[str] | None
    ):
        self._render = render
        self.fingerprint = fingerprint
        self.names = names  # the fields a Jinja template reads (None: a function, not known)

    @classmethod
    def from_text(cls, text: str, where: str = "--template") -> RowTemplate:
        from jinja2 import StrictUndefined, TemplateSyntaxError, meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=False)
        env.filters["tojson"] = lambda value: orjson.dumps(value).decode()
        try:
            parsed = env.parse(text)
            compiled = env.from_string(text)
        except TemplateSyntaxError as exc:
            raise TemplateRefused(f"{where}: line {exc.lineno}: {exc.message}") from None
        names = frozenset(meta.find_undeclared_variables(parsed))
        fingerprint = "jinja:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        return cls(lambda fields: compiled.render(**fields), fingerprint, names)

    @classmethod
    def from_file(cls, path: Path) -> RowTemplate:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise TemplateRefused(f"--template {path}: cannot read it ({exc})") from None
        return cls.from_text(text, str(path))

    @classmethod
    def from_function(cls, function: Callable[[Mapping[str, Any]], Any]) -> RowTemplate:
        """A Python function of the row (the API's): its fingerprint is its source (or its name)."""
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):
            source = getattr(function, "__qualname__", repr(function))
        fingerprint = "python:" + hashlib.blake2b(source.encode(), digest_size=16).hexdigest()
        return cls(function, fingerprint, None)

    def check_names(self, known: frozenset[str], what: str) -> None:
        """Refuse, in one line, a template that names a field none of ``what`` has."""
        if self.names is None:
            return
        unknown = sorted(self.names - known)
        if unknown:
            raise TemplateRefused(
                f"--template names {', '.join(map(repr, unknown))}, which {what} do not have "
                f"(they have: {', '.join(sorted(known))})"
            )

    def apply(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """The row the template makes of ``fields``; RowError with the template's own message."""
        try:
            made = self._render(fields)
        except Exception as exc:  # noqa: BLE001 - whatever the user's template raises is that row's error
            raise RowError(f"the template failed: {type(exc).__name__}: {exc}") from None
        return _as_row(made)


def _as_row(made: Any) -> dict[str, Any]:
    """A rendering as a row: a dict as it is, JSON text of an object or list parsed, text the prompt."""
    if isinstance(made, Mapping):
        return dict(made)
    if isinstance(made, list):
        return {"messages": made}
    if not isinstance(made, str):
        raise RowError(f"the template made a {type(made).__name__}, not text or a row (a dict)")
    text = made.strip()
    if text[:1] in "{[":
        try:
            parsed = orjson.loads(text)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
        if isinstance(parsed, list):
            return {"messages": parsed}
    if not text:
        raise RowError("the template made an empty prompt")
    return {"prompt": made}
