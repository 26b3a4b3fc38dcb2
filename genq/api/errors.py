"""The Python API's errors: genq's own words in one exception, whatever layer refused.

The operations the API shares with the command line say what went wrong as click exceptions (the
command line prints them in one line and exits); :func:`genq_errors` gives the same message to a
Python caller as :class:`GenqError` (a usage mistake as :class:`UsageError`, also a ValueError).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import click
import redis


class GenqError(Exception):
    """An operation of genq refused or failed; the message is the line the command line prints."""


class UsageError(GenqError, ValueError):
    """Options that cannot go together, or a value genq cannot take (the command line's usage error)."""


class WaitTimeout(GenqError, TimeoutError):
    """``Client.wait`` reached its timeout before the datasets settled (the run goes on)."""


@contextlib.contextmanager
def genq_errors() -> Iterator[None]:
    """Run a shared operation, its click exceptions (and a Redis that does not answer) raised as
    genq's own."""
    try:
        yield
    except click.UsageError as exc:
        raise UsageError(exc.format_message()) from None
    except click.ClickException as exc:
        raise GenqError(exc.format_message()) from None
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise GenqError(f"Redis did not answer ({exc}); is it running where connect() points?") from None
