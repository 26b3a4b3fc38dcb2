"""The common checks, each a few lines on the interface a user's own checker has: a callable that
takes the record (a dict: ``content`` is the answer without its reasoning, ``text`` all of it,
``fields`` the row's own fields kept by ``enqueue --keep-field``) and options, and returns a
:class:`~checker.verdict.Verdict` (or a bool, a number, a mapping). Named on the command line as
``--check genq.checker.builtin:answer_match --check-option field=answer``; options arrive as strings.
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any

from genq.checker.verdict import CheckerError, Verdict


def answer_of(record: dict[str, Any]) -> str:
    """The answer a check reads: the content after any reasoning, else the whole text."""
    answer = record.get("content")
    if answer is None:
        answer = record.get("text")
    return answer if isinstance(answer, str) else ""


def normalized(text: str) -> str:
    """Case, Unicode form, surrounding space and punctuation, inner runs of space, a LaTeX
    ``\\boxed{}`` around it and a trailing period set aside: "The answer is \\boxed{42}." and "42"
    do not match, "  \\boxed{42}. " and "42" do."""
    text = unicodedata.normalize("NFKC", text).strip()
    boxed = re.fullmatch(r"\\boxed\{(.*)\}\.?", text, flags=re.S)
    if boxed:
        text = boxed.group(1)
    return re.sub(r"\s+", " ", text).strip(" .").casefold()


def answer_match(record: dict[str, Any], field: str = "answer", exact: str = "false") -> Verdict:
    """The answer equals the row's ``field`` (normalized, unless ``exact=true``); the last
    ``\\boxed{...}`` of a longer answer is what is compared, as math graders do."""
    fields = record.get("fields") or {}
    if field not in fields:
        raise CheckerError(f"the record has no field '{field}' (enqueue --keep-field {field})")
    expected, answer = str(fields[field]), answer_of(record)
    if exact.lower() != "true":
        boxes = re.findall(r"\\boxed\{([^{}]*)\}", answer)
        answer, expected = normalized(boxes[-1] if boxes else answer), normalized(expected)
    if answer == expected:
        return Verdict(True, 1.0, f"matches {field}")
    return Verdict(False, 0.0, f"{answer[:80]!r} is not {field} {expected[:80]!r}")


def regex(record: dict[str, Any], must: str | None = None, must_not: str | None = None) -> Verdict:
    """The answer matches ``must`` (searched, anywhere) and does not match ``must_not``."""
    if must is None and must_not is None:
        raise CheckerError("regex needs must=PATTERN or must_not=PATTERN")
    answer = answer_of(record)
    if must is not None and not re.search(must, answer):
        return Verdict(False, 0.0, f"does not match {must!r}")
    if must_not is not None and (found := re.search(must_not, answer)):
        return Verdict(False, 0.0, f"matches {must_not!r} at {found.start()}")
    return Verdict(True, 1.0, "")


def json_valid(record: dict[str, Any], schema: str | None = None) -> Verdict:
    """The answer is one JSON value (a fenced ```json block is unwrapped), valid against the JSON
    Schema in the file ``schema`` if one is named (the ``jsonschema`` package)."""
    answer = answer_of(record).strip()
    fenced = re.fullmatch(r"```(?:json)?\s*\n(.*)\n```", answer, flags=re.S)
    try:
        value = json.loads(fenced.group(1) if fenced else answer)
    except ValueError as exc:
        return Verdict(False, 0.0, f"not JSON: {exc}")
    if schema is not None:
        import jsonschema  # noqa: PLC0415 - only this check needs it

        with open(schema, encoding="utf-8") as fh:
            validator = jsonschema.Draft202012Validator(json.load(fh))
        if error := next(iter(validator.iter_errors(value)), None):
            return Verdict(
                False, 0.0, f"{'/'.join(map(str, error.absolute_path)) or 'the value'}: {error.message}"
            )
    return Verdict(True, 1.0, "")


def length(record: dict[str, Any], min_tokens: str = "0", max_tokens: str | None = None) -> Verdict:
    """The output's length in tokens (``completion_tokens``) within [min_tokens, max_tokens]."""
    tokens = record.get("completion_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool):
        raise CheckerError("the record has no completion_tokens")
    low, high = int(min_tokens), int(max_tokens) if max_tokens is not None else None
    if tokens < low or (high is not None and tokens > high):
        return Verdict(
            False, float(tokens), f"{tokens} tokens, not within [{low}, {high if high is not None else '∞'}]"
        )
    return Verdict(True, float(tokens), "")
