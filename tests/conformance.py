"""The simulator checked against a real engine: the same requests to both, the answers compared.

Each case is one request; both servers answer it and what genq could ever read is compared: the
status, the content type, the body's skeleton (every key, and each value's JSON kind, recursively;
a list by its first item) and, for errors whose text genq matches or shows, the message itself.
Generated ids and text differ by design (the simulator's toy model is not the tiny llama), so
values are compared only where a case says so.

Cases that need two requests at once (a duplicate rid, an abort of a running request, health while
busy) are functions that return an observation; they run against both servers too.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass(frozen=True)
class Case:
    """One request, and how much of its answer must agree."""

    name: str
    path: str
    body: Any = None  # JSON body (POST); None: GET
    raw: bytes | None = None  # a body that is not JSON
    message: bool = False  # compare the error message text as well
    values: tuple[str, ...] = ()  # dotted paths whose values must be equal too (e.g. finish_reason)
    keys: tuple[str, ...] = ()  # compare only these top-level keys' skeletons (a deliberate subset)


@dataclass
class Answer:
    status: int
    content_type: str
    body: Any
    elapsed: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def call(
    url: str,
    path: str,
    body: Any = None,
    raw: bytes | None = None,
    timeout: float = 120,
    headers: dict[str, str] | None = None,
) -> Answer:
    data = raw if raw is not None else (orjson.dumps(body) if body is not None else None)
    headers = {**({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
    req = urllib.request.Request(url + path, data=data, headers=headers, method="POST" if data else "GET")
    started = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, ctype, payload = resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as exc:
        status, ctype, payload = exc.code, exc.headers.get("Content-Type", ""), exc.read()
    try:
        parsed: Any = orjson.loads(payload) if payload else None
    except orjson.JSONDecodeError:
        parsed = payload.decode(errors="replace")
    return Answer(status, ctype.split(";")[0].strip(), parsed, time.monotonic() - started)


def skeleton(value: Any) -> Any:
    """Keys and JSON kinds, recursively; numbers are one kind (JSON does not tell 0 from 0.0), and an
    object keyed by tokens (vLLM's top_logprobs) is a map of its first value's kind."""
    if isinstance(value, dict):
        if value and all(k.startswith("token_id:") for k in value):
            return {"token_id:*": skeleton(next(iter(value.values())))}
        return {k: skeleton(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [skeleton(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "str"
    return None


def agree(real: Any, sim: Any) -> bool:
    """Two skeletons agree key for key; a null on either side stands for any kind (fields such as
    SGLang's cached_tokens_details are null or an object depending on the prefix cache's state)."""
    if real is None or sim is None:
        return True
    if isinstance(real, dict) and isinstance(sim, dict):
        return real.keys() == sim.keys() and all(agree(real[k], sim[k]) for k in real)
    if isinstance(real, list) and isinstance(sim, list):
        return not real or not sim or agree(real[0], sim[0])
    return real == sim


def at(body: Any, path: str) -> Any:
    for key in path.split("."):
        body = body.get(key) if isinstance(body, dict) else None
    return body


def message(body: Any) -> Any:
    """The error text wherever the engine put it: {"error": {"message"}}, {"error": str}, {"message"}."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            return error.get("message")
        return error if error is not None else body.get("message")
    return body


def differences(case: Case, real: Answer, sim: Answer) -> list[str]:
    """What the simulator answered differently from the real engine, one line each."""
    out = []
    if real.status != sim.status:
        out.append(f"status {sim.status}, real {real.status}: real body {str(real.body)[:300]}")
        return out
    if real.content_type != sim.content_type:
        out.append(f"content type {sim.content_type!r}, real {real.content_type!r}")
    shapes = [skeleton(a.body) for a in (real, sim)]
    if case.keys:
        shapes = [{k: shape.get(k, "<missing>") for k in case.keys} for shape in shapes]
    if not agree(*shapes):
        out.append(f"body {shapes[1]}, real {shapes[0]}")
    if case.message and message(real.body) != message(sim.body):
        out.append(f"message {message(sim.body)!r}, real {message(real.body)!r}")
    for path in case.values:
        if at(real.body, path) != at(sim.body, path):
            out.append(f"{path} {at(sim.body, path)!r}, real {at(real.body, path)!r}")
    return out


def compare(
    real_url: str,
    sim_url: str,
    cases: list[Case],
    deliberate: dict[str, str],
    real_only: Callable[[Any], Any] = lambda body: body,
) -> list[str]:
    """Every difference, as 'case: what', except the cases written down as deliberate.
    ``real_only`` drops from a real answer what the test's own server flags add (e.g. metrics)."""
    found = []
    for case in cases:
        if case.name in deliberate:
            continue
        real, sim = (call(url, case.path, case.body, case.raw) for url in (real_url, sim_url))
        real.body = real_only(real.body)
        found += [f"{case.name}: {d}" for d in differences(case, real, sim)]
    return found


def concurrently(*calls: Callable[[], Answer], stagger: float = 0.3) -> list[Answer]:
    """Start each call in a thread, ``stagger`` seconds apart; the answers in order."""
    answers: list[Answer | None] = [None] * len(calls)

    def run(i: int) -> None:
        answers[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
        time.sleep(stagger)
    for thread in threads:
        thread.join(180)
    assert all(a is not None for a in answers), "a request did not finish"
    return answers  # type: ignore[return-value]
