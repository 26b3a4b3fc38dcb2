"""genq's Python API, the floor above the commands: what ``import genq`` offers (docs/python.md).

Each operation is the one the command line runs (enqueue's request, checks and plan; status; the
readers of an output folder; `genq run`), called from Python, its refusals raised as
:class:`GenqError` with the line the command would print.
"""

from genq.api.client import Client, EnqueueResult, connect, results
from genq.api.errors import GenqError, UsageError, WaitTimeout
from genq.api.local import LocalRun
from genq.api.results import Results

__all__ = [
    "Client",
    "EnqueueResult",
    "GenqError",
    "LocalRun",
    "Results",
    "UsageError",
    "WaitTimeout",
    "connect",
    "results",
]
