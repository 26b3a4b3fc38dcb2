"""Engine backends (decision 13): one module per engine API, behind :class:`Backend`.

The worker sends through them; ``genq enqueue --server`` probes through them for the context
length and the vocabulary. They live in the shared contract because both roles need them.
"""

from __future__ import annotations

import asyncio

from genq.backends.base import Answer, AttemptError, Backend, Http, ServerInfo, ServerRefused
from genq.backends.sglang import SGLang

BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (SGLang,)}

__all__ = [
    "BACKENDS",
    "Answer",
    "AttemptError",
    "Backend",
    "Http",
    "ServerInfo",
    "ServerRefused",
    "open_backend",
    "probe",
]


def open_backend(name: str, http: Http) -> Backend:
    try:
        return BACKENDS[name](http)
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}") from None


def probe(url: str, name: str = "sglang") -> ServerInfo:
    """What a server says about itself (blocking; for commands that are not async)."""

    async def run() -> ServerInfo:
        async with Http(url) as http:
            return await open_backend(name, http).probe()

    return asyncio.run(run())
