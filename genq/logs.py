"""Logging set-up shared by every long-running command: one line per event worth knowing."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # RQ logs a line per job at INFO; at 100s of jobs/s that drowns what matters.
    for name in ("rq", "rq.worker", "rq.job", "rq.queue"):
        logging.getLogger(name).setLevel(logging.WARNING)
