"""Logging set-up shared by every long-running command: one line per event worth knowing.

``--log-format json`` (env GENQ_LOG_FORMAT) prints one JSON object a line for log shippers: ``ts``,
``level``, ``logger``, ``msg``, and the event's context (``job_id``, ``dataset``, ``worker``, ...)
passed by the caller with ``extra=``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

import click
import orjson

from genq.settings import option

FORMATS = ("text", "json")
# Context fields a log call may pass with ``extra=``; JSON lines carry them as fields.
CONTEXT = ("job_id", "dataset", "worker", "server", "attempt", "error", "delay_s")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in CONTEXT:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class TextFormatter(logging.Formatter):
    """The classic line, with the worker's name when the event is a worker's (jobs are named in
    the message already)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(who)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        worker = getattr(record, "worker", None)
        record.who = f"[{worker}]" if worker else ""
        return super().format(record)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)
    # RQ logs a line per job at INFO; at 100s of jobs/s that drowns what matters.
    for name in ("rq", "rq.worker", "rq.job", "rq.queue"):
        logging.getLogger(name).setLevel(logging.WARNING)


def logging_options(func: Callable) -> Callable:
    """``--log-level`` and ``--log-format``, for every command that calls :func:`setup_logging`."""
    func = option(
        "--log-format",
        type=click.Choice(FORMATS),
        default="text",
        help="json: one JSON object a line (ts, level, logger, msg, job_id, dataset, worker).",
    )(func)
    return option("--log-level", default="INFO", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))(
        func
    )
