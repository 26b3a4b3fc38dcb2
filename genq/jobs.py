"""The function every genq RQ job names.

genq's asyncio worker reads a job's payload and calls the inference server itself; it never
calls this. It exists so that a job picked up by a plain ``rq worker`` fails with a clear reason
instead of an import error.
"""

from __future__ import annotations

from typing import Any


def generate(**payload: Any) -> None:
    raise RuntimeError(
        "genq jobs are run by `genq worker`, not by `rq worker`: "
        f"job for dataset {payload.get('dataset')!r} row {payload.get('row')!r} was not run"
    )
