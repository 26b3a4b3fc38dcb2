"""`genq check`."""

from __future__ import annotations

import asyncio
import logging
import sys

import click
import redis

from genq.checker.loop import CheckConfig, CheckLoop
from genq.checker.runner import Checker, CheckerError, CommandChecker, PythonChecker
from genq.connection import connect, wait_for_redis
from genq.keys import Keys
from genq.logs import logging_options, setup_logging
from genq.redis_errors import fatal
from genq.settings import option, redis_options

log = logging.getLogger("genq.check")


@click.command("check")
@option(
    "--check",
    "target",
    default=None,
    metavar="MODULE:FUNCTION",
    help="The checker: a Python function on this host's path that takes a record (a dict) and "
    "returns a verdict: true/false, a reward (accepted above 0), or {accepted, score, reason}. "
    "Built in: genq.checker.builtin:answer_match, :regex, :json_valid, :length. Running it is this "
    "host's consent, never Redis's.",
)
@option(
    "--check-option",
    "check_options",
    multiple=True,
    metavar="NAME=VALUE",
    help="A keyword argument for the --check function (a string), e.g. field=answer. Repeatable.",
)
@option(
    "--check-cmd",
    default=None,
    metavar="CMD",
    help="The checker as a command run for each record (split like a shell would, run without one): "
    "the record as JSON on its stdin, a verdict as JSON on its stdout, exit 0.",
)
@option(
    "--dataset",
    "names",
    env="GENQ_CHECK_DATASET",
    multiple=True,
    help="Judge only this checked dataset (repeatable; default: all).",
)
@option(
    "--concurrency",
    env="GENQ_CHECK_CONCURRENCY",
    type=click.IntRange(min=1),
    default=4,
    help="Records judged at once by this process.",
)
@option(
    "--timeout",
    env="GENQ_CHECK_TIMEOUT",
    type=click.FloatRange(min=0.1),
    default=60.0,
    help="Seconds the checker has for one record.",
)
@option(
    "--max-check-attempts",
    type=click.IntRange(min=1),
    default=3,
    help="Tries of the checker on one record (across processes) before it is filed check_failed.",
)
@option(
    "--stream-limit",
    env="GENQ_CHECK_STREAM_LIMIT",
    type=click.IntRange(min=1),
    default=10_000,
    help="Judge no more of a dataset while its result stream holds this many entries (collector behind).",
)
@option(
    "--burst",
    env="GENQ_CHECK_BURST",
    is_flag=True,
    help="Exit once no checked dataset has anything queued, running or to judge.",
)
@logging_options
@redis_options
def check_command(
    target,
    check_options,
    check_cmd,
    names,
    concurrency,
    timeout,
    max_check_attempts,
    stream_limit,
    burst,
    log_level,
    log_format,
    redis_url,
    namespace,
):
    """Judge the records of checked datasets (enqueue --checked / --accept K) with this host's checker
    before the collector files them: accepted ones go to raw_responses.jsonl, the rest to
    rejected_samples.jsonl with their reason. Any number of these processes, on any hosts.
    SIGTERM lets the judgements under way finish, then exits 0."""
    setup_logging(log_level, log_format)
    if (target is None) == (check_cmd is None):
        raise click.UsageError("give the checker: --check MODULE:FUNCTION or --check-cmd CMD (one of them)")
    if check_options and target is None:
        raise click.UsageError("--check-option goes with --check MODULE:FUNCTION")
    try:
        checker: Checker = (
            PythonChecker(target, list(check_options), concurrency) if target else CommandChecker(check_cmd)
        )
    except CheckerError as exc:
        raise click.ClickException(str(exc)) from exc
    config = CheckConfig(concurrency, timeout, max_check_attempts, stream_limit, burst, tuple(names))
    conn = connect(redis_url)
    wait_for_redis(conn, redis_url)
    log.info("check: judging with %s, %d at once", checker.identity, concurrency)
    try:
        status = asyncio.run(CheckLoop(conn, Keys(namespace), checker, config).run())
    except redis.RedisError as exc:
        log.critical("%s", fatal(exc))
        sys.exit(4)
    sys.exit(status)
