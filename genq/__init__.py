"""genq: datasets of prompts to synthetic training data on inference servers, through Redis.

``import genq`` offers the Python API (genq/api: ``genq.connect``, ``genq.LocalRun``,
``genq.results``; docs/python.md), loaded on first use, so a role importing the contract below
does not load it.

The floors, top to bottom: ``python -m genq`` (__main__.py) and the API (genq.api) > genq.commands
(the command line and its tools) > the roles: genq.producer, genq.worker, genq.collector,
genq.checker, genq.outputs and genq.sim, each on its own (their folders sit at the top of the
repository; genq/<role> links to each) > the contract, the rest of this package, which imports no
role and no command. `lint-imports` enforces it (the contracts are in pyproject.toml).
"""

from typing import Any

from genq.version import __version__

API = (
    "Client",
    "EnqueueResult",
    "GenqError",
    "LocalRun",
    "Results",
    "UsageError",
    "WaitTimeout",
    "connect",
    "results",
)
__all__ = ["__version__", *API]


def __getattr__(name: str) -> Any:
    """The API's names, imported when first asked for (PEP 562)."""
    if name in API:
        from genq import api

        return getattr(api, name)
    raise AttributeError(f"module 'genq' has no attribute {name!r}")
