"""`genq worker`."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys

import click
import redis

from genq.backends import MAX_BODY_MB, NAMES, Http, split_credentials
from genq.connection import connect, wait_for_redis
from genq.keys import Keys
from genq.logs import logging_options, setup_logging
from genq.metrics import metrics_options, serve
from genq.redis_errors import fatal
from genq.settings import DEFAULT_HEARTBEAT_TTL_S, option, redis_options
from genq.worker import metrics
from genq.worker.config import AUTO, ConcurrencyParam, WorkerConfig
from genq.worker.daemon import Worker

log = logging.getLogger("genq.worker")


@click.command("worker")
@option(
    "--server",
    required=True,
    help="Base URL of the SGLang server, e.g. http://127.0.0.1:30000. Its API key (--api-key) comes "
    "from GENQ_SERVER_API_KEY or GENQ_SERVER_API_KEY_FILE, never from the command line; user:password@ "
    "in the URL is sent as Basic auth (when there is no key) and stored nowhere.",
)
@option(
    "--backend",
    type=click.Choice(NAMES),
    default="auto",
    help="The server's API: sglang (/generate), vllm (/v1/completions, token ids), openai-chat "
    "(/v1/chat/completions, text); auto asks the server.",
)
@option(
    "--model", default=None, help="The model to ask for (OpenAI-style servers; default: the first listed)."
)
@option(
    "--concurrency",
    type=ConcurrencyParam(),
    default=AUTO,
    help="Jobs in flight in this process; auto: steered by the server's load, up to --max-concurrency "
    "(docs/design.md decision 16); a number: that many, fixed.",
)
@option(
    "--max-concurrency",
    type=click.IntRange(min=1),
    default=1024,
    help="With --concurrency auto: the most jobs in flight (the connection pool's size).",
)
@option(
    "--max-attempts",
    type=click.IntRange(min=1),
    default=5,
    help="Sends charged to a job before it fails, counted across workers (docs/failures.md).",
)
@option(
    "--max-spared",
    type=click.IntRange(min=0),
    default=20,
    help="Sends the server failed while serving no other job (503, drops) that a job is spared.",
)
@option(
    "--max-crashes",
    type=click.IntRange(min=1),
    default=3,
    help="Server crashes a job may be in flight at before it fails as suspect_crash.",
)
@option(
    "--request-timeout",
    type=click.FloatRange(min=1),
    default=None,
    help="Seconds per attempt; default 120 + max_new_tokens / 8.",
)
@option(
    "--max-response-mb",
    type=click.IntRange(min=1),
    default=MAX_BODY_MB,
    help="Read no server answer past this many MiB: one that long is a bad_response, charged an attempt.",
)
@option(
    "--grace",
    type=click.FloatRange(min=0),
    default=60.0,
    help="On SIGTERM, seconds to let in-flight jobs finish before putting them back.",
)
@option(
    "--heartbeat-ttl",
    type=click.IntRange(min=5),
    default=DEFAULT_HEARTBEAT_TTL_S,
    help="Seconds without a heartbeat after which a worker's jobs run elsewhere.",
)
@option(
    "--stream-limit",
    type=click.IntRange(min=1),
    default=10_000,
    help="Take no new jobs of a dataset while its result stream holds this many entries.",
)
@option(
    "--trust-remote-code",
    is_flag=True,
    help="Run a dataset's tokenizer code (Kimi-K2's tokenization_kimi.py) to render --turns all "
    "conversations; without it such datasets stay queued for a worker that may. Never taken from Redis.",
)
@option("--burst", is_flag=True, help="Exit once the queues are empty and nothing is in flight.")
@logging_options
@metrics_options
@redis_options
def worker_command(
    server,
    backend,
    model,
    concurrency,
    max_concurrency,
    max_attempts,
    max_spared,
    max_crashes,
    request_timeout,
    max_response_mb,
    grace,
    heartbeat_ttl,
    stream_limit,
    trust_remote_code,
    burst,
    log_level,
    log_format,
    metrics_port,
    metrics_bind,
    redis_url,
    namespace,
):
    """Run jobs of every dataset in the namespace against one inference server.

    At start it probes the server (version, context length, key, one tiny generation) and
    exits 78 with one line if genq cannot use it. SIGTERM drains: no new jobs, in-flight ones
    finish (up to --grace), the rest go back to the queue, exit 0. A second signal exits at once.
    """
    setup_logging(log_level, log_format)
    serve(metrics_port, metrics_bind, metrics.REGISTRY)
    config = WorkerConfig(
        server=split_credentials(server)[0],  # the password goes to Http only: config.server is shown
        backend=backend,
        model=model,
        concurrency=None if concurrency == AUTO else concurrency,
        max_concurrency=max_concurrency,
        max_attempts=max_attempts,
        max_spared=max_spared,
        max_crashes=max_crashes,
        request_timeout=request_timeout,
        grace=grace,
        burst=burst,
        heartbeat_ttl=heartbeat_ttl,
        stream_limit=stream_limit,
        trust_remote_code=trust_remote_code,
    )
    conn = connect(redis_url)
    wait_for_redis(conn, redis_url)
    # What start-up made (modules, classes, RQ's and aiohttp's tables) lives as long as the process:
    # kept out of the collector's full passes, which otherwise walk it again and again as jobs
    # allocate (bench/real_engine.py, llama.cpp at 16 in flight: 1.16 -> 1.08 ms of worker CPU per job).
    gc.freeze()
    try:
        status = asyncio.run(_run(conn, Keys(namespace), config, server, max_response_mb << 20))
    except redis.RedisError as exc:  # not an outage (genq/redis_errors.py): a bug, said in one line
        log.critical("%s", fatal(exc))
        sys.exit(4)
    sys.exit(status)


async def _run(conn, keys: Keys, config: WorkerConfig, server: str, max_body: int) -> int:
    async with Http(server, config.ceiling, max_body) as http:
        return await Worker(conn, keys, config, http).run()
