"""The process a Python checker runs in: ``python -P -m genq.checker.host module:function [key=value ...]``.

One JSON record a line on stdin, one JSON answer a line on stdout: ``{"verdict": {...}}`` or
``{"error": "..."}`` when the function raised or answered no verdict. A checker runs in a process
of its own so that one that hangs can be killed (a thread cannot) and one that crashes takes
nothing else with it; ``genq check`` starts one per checking slot and a new one after a kill.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from genq.checker.verdict import CheckerError, verdict_of


def search_working_folder() -> None:
    """A checker's module is looked for on this host's Python path (PYTHONPATH, the installed
    packages), then in the working folder, last: started with ``-P``, Python puts no folder ahead
    of genq's own packages, so a user's ``checker.py`` or ``genq/`` there shadows nothing of genq's."""
    folder = os.getcwd()
    if folder not in sys.path:
        sys.path.append(folder)


def load(target: str) -> Callable[..., Any]:
    """The callable named ``module:function`` (dots in the module and in the attribute path)."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise CheckerError(f"--check {target!r}: expected module:function, e.g. mychecks:math_answer")
    function: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        function = getattr(function, part)
    if not callable(function):
        raise CheckerError(f"--check {target!r} names a {type(function).__name__}, not a function")
    return function


def options(pairs: list[str]) -> dict[str, str]:
    """``key=value`` strings as keyword arguments."""
    found = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise CheckerError(f"--check-option {pair!r}: expected name=value")
        found[key] = value
    return found


def main(argv: list[str]) -> int:
    search_working_folder()
    function, kwargs = load(argv[0]), options(argv[1:])
    out = sys.stdout
    sys.stdout = sys.stderr  # a checker's prints must not end up in the answers
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        try:
            answer: dict[str, Any] = {"verdict": verdict_of(function(json.loads(line), **kwargs)).to_json()}
        except Exception as exc:  # noqa: BLE001 - whatever the user's code raises is the record's failure
            answer = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        print(json.dumps(answer), file=out, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
