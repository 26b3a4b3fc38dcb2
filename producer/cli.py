"""`genq enqueue` (also installed as `enqueue`)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import click
import redis

from genq import backends, datasets, progress, sources
from genq.connection import HASH_VALUE_LIMIT, connect, redact, wait_for_redis
from genq.keys import Keys
from genq.producer import thinking
from genq.producer.dry_run import check_files, describe
from genq.producer.enqueue import Summary, enqueue_dataset
from genq.producer.formats import FIELDS, FORMATS
from genq.producer.lease import LeaseLost
from genq.producer.rejects import RejectsFile
from genq.producer.request import EnqueueRequest, Plan
from genq.producer.row_template import TemplateRefused
from genq.producer.stage import StageRefused, enqueue_stage
from genq.sampling import FLAGGED, sampling_options
from genq.settings import json_object, option, redis_options

# The exit status of an enqueue that rejected rows (the rest enqueued), unless --allow-rejects.
EXIT_REJECTED = 3
SIZE_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def _fields(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, column = value.partition("=")
        if not sep or name not in FIELDS or not column:
            names = ", ".join(FIELDS)
            raise click.BadParameter(f"expected NAME=COLUMN with NAME one of {names}, got {value!r}")
        out[name] = column
    return out


def _size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    """A byte count: 67108864, 64MiB, 64M, 512KiB."""
    found = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(value))
    if found is None or found[2].lower() not in SIZE_UNITS or int(found[1]) < 1:
        raise click.BadParameter(f"expected a size in bytes such as 67108864, 64MiB or 512KiB, got {value!r}")
    return int(found[1]) * SIZE_UNITS[found[2].lower()]


@click.command("enqueue")
@click.argument("files", nargs=-1)
@option("--dataset", default=None, help="Dataset name (default: the first file's stem).")
@option(
    "--template",
    "row_template",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A Jinja template (sandboxed) that makes each row from the fields of a row of FILES, or of a "
    "record of --from-dataset: its text is the prompt, or a JSON object the row, or a JSON list the "
    "messages.",
)
@option(
    "--from-dataset",
    default=None,
    metavar="NAME",
    help="A stage: take the rows from dataset NAME's records as they land in --from-out (with "
    "--template), one row of this dataset per record, until NAME is settled.",
)
@option(
    "--from-out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    metavar="DIR",
    help="The collector's folder, where --from-dataset's records land (DIR/NAME/raw_responses.jsonl).",
)
@option("--only-accepted", is_flag=True, help="A stage takes only the records the check stage accepted.")
@option(
    "--only-stopped",
    is_flag=True,
    help="A stage takes only the records that stopped by themselves (finish_reason stop).",
)
@option(
    "--format",
    "fmt",
    type=click.Choice(["auto", *FORMATS]),
    default="auto",
    help="Row format; auto detects it per row and reports what each file holds.",
)
@option(
    "--field",
    "fields",
    multiple=True,
    callback=_fields,
    help="NAME=COLUMN: read genq's NAME (prompt, messages, conversations, id, role, content, from, "
    "value, instruction, input, input_ids, system) from another column. Repeatable.",
)
@option(
    "--split",
    default=None,
    help="Split of a Hugging Face dataset, folder or id (default: train, or the only one).",
)
@option(
    "--config",
    default=None,
    help="Configuration of a Hugging Face dataset given by its id (owner/name), as load_dataset takes it.",
)
@option(
    "--limit",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Only the first N rows, for a trial: the next enqueue without it enqueues the rest.",
)
@option(
    "--tokenizer", default=None, help="Render prompts with its chat template (a local folder, or the cache)."
)
@option(
    "--trust-remote-code",
    is_flag=True,
    help="Run the --tokenizer's own code (Kimi-K2's tokenization_kimi.py, ...): this host's consent, "
    "never taken from Redis.",
)
@option(
    "--chat-template-kwargs",
    callback=json_object('{"enable_thinking": true}'),
    default=None,
    help='JSON object passed to the chat template, e.g. {"enable_thinking": true}.',
)
@option("--system-prompt", default=None, help="Replace each conversation's system turn, or add one.")
@option(
    "--turns",
    type=click.Choice(["last", "all"]),
    default="last",
    help="Conversations: answer the last user turn (last), or every user turn in order, each with the "
    "model's own earlier answers (all: one job per conversation, rendered turn by turn by the worker).",
)
@option(
    "--logprobs",
    type=click.IntRange(min=0, max=100),
    default=None,
    help="Keep the log-probabilities of every output token and its top K alternatives, in "
    "OUT/<dataset>/logprobs.bin (backends sglang and vllm).",
)
@option(
    "--continue-to",
    type=click.IntRange(min=2),
    default=None,
    metavar="N",
    help="Continue an output cut at --max-new-tokens, a piece of at most that many tokens at a time "
    "(prompt + output so far as token ids), until the model stops or the output has N tokens; a crash "
    "costs one piece.",
)
@option(
    "--keep-prompt/--no-keep-prompt", default=True, help="Keep input_ids and the conversation in records."
)
@option(
    "--keep-field",
    "keep_fields",
    multiple=True,
    metavar="NAME",
    help="Copy this field of each row into its records as fields.NAME (a reference answer a checker "
    "compares with); a row without it is refused. Repeatable.",
)
@option(
    "--checked",
    is_flag=True,
    help="Records pass the check stage (`genq check`, the host's own checker) before the collector "
    "files them: accepted ones in raw_responses.jsonl, the others in rejected_samples.jsonl.",
)
@option(
    "--accept",
    type=click.IntRange(min=1),
    default=None,
    metavar="K",
    help="Checked, and sampled until K samples of each prompt are accepted: K drawn at first, one more "
    "for each not accepted, never more than --max-samples (needs it; instead of --samples).",
)
@option(
    "--max-samples",
    type=click.IntRange(min=1),
    default=None,
    metavar="M",
    help="With --accept: the most samples drawn for one prompt.",
)
@sampling_options
@option("--replace-settings", is_flag=True, help="Allow other settings for an existing dataset.")
@option(
    "--register-only",
    is_flag=True,
    help="Record the dataset's settings (checking them against earlier enqueues) and enqueue nothing.",
)
@option(
    "--wait-collector",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="Record the dataset's settings, wait (at most SECONDS) until a collector has taken the dataset "
    "and reconciled its files on disk, then enqueue: rows already on disk are skipped even on a fresh "
    "Redis (genq run does this).",
)
@option(
    "--context-length",
    type=click.IntRange(min=2),
    default=None,
    help="Reject prompts that cannot fit with --max-new-tokens (default: ask --server, if given).",
)
@option(
    "--server",
    default=None,
    help="Inference server to ask for its context length and limits (SGLang: /server_info). Its API key "
    "comes from GENQ_SERVER_API_KEY(_FILE).",
)
@option(
    "--backend",
    type=click.Choice(backends.NAMES),
    default="auto",
    help="The API the workers will use: with openai-chat the server renders conversations (no "
    "--tokenizer), else prompts go as token ids. auto: ask --server, or assume a token backend.",
)
@option(
    "--vocab-size",
    type=click.IntRange(min=1),
    default=None,
    help="Reject prompts with token ids outside [0, N) (default: the --tokenizer's size, or the server's).",
)
@option("--clip-max-new-tokens", is_flag=True, help="Lower max_new_tokens of a prompt that would not fit.")
@option(
    "--max-queued",
    type=click.IntRange(min=1),
    default=None,
    help="Keep at most N jobs waiting in Redis; top the queue up as it drains.",
)
@option(
    "--max-row-bytes",
    callback=_size,
    default="64MiB",
    metavar="SIZE",
    help="Reject a row larger than this (JSON Lines and JSON arrays), without reading it whole.",
)
@option(
    "--rejects",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write each rejected row (file, line, field, reason, the row's first 4 KiB) to this JSON Lines "
    "file, anew each run.",
)
@option(
    "--allow-rejects",
    is_flag=True,
    help=f"Exit 0 when rows were rejected (default: exit {EXIT_REJECTED}); the good rows are enqueued "
    "either way.",
)
@option(
    "--reasoning-preset",
    type=click.Choice(list(thinking.PRESETS)),
    default=None,
    help="Think markers of a model family, to split reasoning from content.",
)
@option("--think-start", default=None, help="Text that opens the reasoning (e.g. <think>).")
@option("--think-start-token-id", type=click.IntRange(min=0), default=None, help="Token id that opens it.")
@option("--think-end", default=None, help="Text that closes the reasoning (e.g. </think>).")
@option("--think-end-token-id", type=click.IntRange(min=0), default=None, help="Token id that closes it.")
@option(
    "--dry-run",
    is_flag=True,
    help="Read, check and render every row, print per file what would be enqueued and rejected and "
    "its first prompt; enqueue nothing, record nothing, touch no Redis.",
)
@option(
    "--redis-wait",
    type=click.FloatRange(min=0),
    default=60.0,
    metavar="SECONDS",
    help="How long to wait for a Redis that does not answer (yet) before giving up: one started "
    "beside enqueue, as in compose, where podman honours no health condition.",
)
@redis_options
def enqueue_command(redis_url: str, namespace: str, redis_wait: float, **options: Any) -> None:
    """Enqueue one job per prompt of FILES: JSON Lines, JSON arrays, Parquet, or Hugging Face dataset
    folders; globs allowed. Rows hold input_ids, messages, conversations, prompt or instruction.

    Idempotent: rows already queued, in flight or on disk are skipped, so the same command can
    be run again safely, even at once (a second enqueue of a dataset waits for the first). Rows are
    numbered across FILES in order: give the same files first; a file whose rows enqueued before
    have changed is refused.
    """
    request, plan = prepared(request_of(click.get_current_context(), options))
    if request.dry_run:
        report_dry_run(plan)
        return
    conn = connect(redis_url)
    try:
        wait_for_redis(conn, redis_url, give_up_after=redis_wait)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise click.ClickException(
            f"Redis unreachable at {redact(redis_url)}: {exc} Start redis-server there (or point --redis, "
            "GENQ_REDIS_URL, at yours), or use `genq run`, which starts a private one"
        ) from exc
    summary = submit(conn, Keys(namespace), request, plan)
    if request.register_only:
        click.echo(f"{plan.name}: settings recorded")
        return
    _say_outcome(request, plan, summary)


def prepared(request: EnqueueRequest) -> tuple[EnqueueRequest, Plan]:
    """The request as its --server answers it, checked, and its plan: all an enqueue does before
    Redis is touched (`genq enqueue` and the Python API's ``Client.enqueue`` alike)."""
    request.name  # noqa: B018 - a name that cannot be a dataset's is refused before the server is asked
    request = request.with_server(request.probe())
    request.check()
    return request, request.plan()


def submit(
    conn: redis.Redis, keys: Keys, request: EnqueueRequest, plan: Plan, rejects: RejectsFile | None = None
) -> Summary:
    """The plan enqueued (after its collector took the dataset, with --wait-collector); rejected
    rows go to ``rejects``, else to the request's --rejects file."""
    if not request.register_only:
        hint_hash_encoding(conn, keys)
    if request.wait_collector is not None:
        _enqueue(conn, keys, dataclasses.replace(request, register_only=True), plan)
        _wait_for_collector(conn, keys, plan.name, request.wait_collector)
    return _enqueue(conn, keys, request, plan, rejects)


def _wait_for_collector(conn: redis.Redis, keys: Keys, name: str, seconds: float) -> None:
    """Until a collector holds the dataset (its settings registered just before), at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not progress.collector_holds(conn, keys, name):
        if time.monotonic() > deadline:
            raise click.ClickException(
                f"{name}: no collector took the dataset within {seconds:g} s (--wait-collector); start "
                "`genq collect --out OUT` for this Redis, or see its log (the settings are recorded, "
                "nothing is enqueued)"
            )
        time.sleep(0.1)


def request_of(ctx: click.Context, options: dict[str, Any]) -> EnqueueRequest:
    """The command line's enqueue options as a request; a sampling flag counts as given (an OpenAI
    Batch row may not contradict it) when set on the command line, every --sampling-params key."""
    flag = {"sampling_seed" if name == "seed" else name: name for name in FLAGGED}
    params = options["sampling"].params()
    given = frozenset(
        key
        for key in params
        if key not in flag or ctx.get_parameter_source(flag[key]) != click.core.ParameterSource.DEFAULT
    )
    return EnqueueRequest(**{**options, "files": tuple(options["files"])}, given=given)


def _enqueue(
    conn: redis.Redis, keys: Keys, request: EnqueueRequest, plan: Plan, given: RejectsFile | None = None
) -> Summary:
    """The plan run into Redis; its failures said in one line with what to do."""
    rejects = request.rejects
    opened = None
    if given is None and rejects is not None and not request.register_only:
        opened = RejectsFile(rejects)
    rejects_file = given if not request.register_only else None
    rejects_file = rejects_file or opened
    common: dict[str, Any] = {
        "replace_settings": request.replace_settings,
        "report": lambda line: click.echo(line, err=True),
        "register_only": request.register_only,
        "rejects": rejects_file,
    }
    try:
        if plan.options.stage is not None:  # a stage: another dataset's records, followed
            return enqueue_stage(conn, keys, plan.name, plan.params, plan.samples, plan.options, **common)
        return enqueue_dataset(
            conn, keys, plan.paths, plan.name, plan.params, plan.samples, plan.options, **common
        )
    except (datasets.SettingsMismatch, LeaseLost, StageRefused, TemplateRefused) as exc:
        raise click.ClickException(str(exc)) from exc
    except sources.SourceError as exc:  # the count pass of --max-queued met a broken file
        raise click.ClickException(str(exc)) from exc
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise click.ClickException(
            f"Redis went away ({exc}): each batch is one MULTI, so nothing is half-enqueued; run the same "
            "command again (it skips what is already queued or done)"
        ) from exc
    finally:
        if opened is not None:
            opened.close()


def _say_outcome(request: EnqueueRequest, plan: Plan, summary: Summary) -> None:
    """The counts, then what went wrong: a file that could not be read on, no rows, rejected rows
    (exit EXIT_REJECTED unless --allow-rejects)."""
    name = plan.name
    print_summary(name, summary)
    if summary.fatal:
        raise click.ClickException(summary.fatal)
    if summary.read == 0:
        raise click.ClickException(
            f"{name}: no rows in {', '.join(map(str, plan.paths))}: nothing to enqueue (empty, or blank "
            "lines)"
        )
    if summary.rejected and not request.allow_rejects:
        rejects = request.rejects
        listed = f"listed in {rejects}" if rejects is not None else "listed above; --rejects FILE keeps them"
        others = "the other rows are enqueued" if summary.read > summary.rejected else "no row was enqueued"
        click.echo(
            f"Error: {name}: {summary.rejected} rows rejected ({listed}); {others}. "
            f"Fix them and run again, or pass --allow-rejects to accept (exit {EXIT_REJECTED})",
            err=True,
        )
        sys.exit(EXIT_REJECTED)


def report_dry_run(plan: Plan) -> None:
    """--dry-run: each file's counts and first prompt on stdout, rejected rows on stderr."""
    checks = check_files(
        plan.paths, plan.params, plan.options, report=lambda line: click.echo(line, err=True)
    )
    for check in checks:
        for line in describe(check, plan.samples, plan.options):
            click.echo(line)
    jobs = sum(c.usable for c in checks) * plan.samples
    rejected = sum(c.rejected for c in checks)
    click.echo(
        f"{plan.name}: dry run: would enqueue {jobs} jobs, reject {rejected} rows, with sampling "
        f"{json.dumps(plan.params)}; nothing enqueued, no settings recorded (rows an earlier enqueue "
        "queued are not looked up)"
    )
    fatal = next((c.fatal for c in checks if c.fatal), None)
    if fatal:
        raise click.ClickException(fatal)


def hint_hash_encoding(conn: redis.Redis, keys: Keys) -> None:
    """Say once (per namespace: not on every enqueue) when Redis keeps job hashes as hashtables: a
    queued job then costs ~1.1 KB beyond its prompt ids instead of ~0.5 KB. A Redis that refuses
    CONFIG (managed, ACLs) is not asked."""
    try:
        limit = conn.config_get("hash-max-listpack-value").get("hash-max-listpack-value")
    except redis.ResponseError:
        return
    if limit is None or int(limit) >= HASH_VALUE_LIMIT:
        return
    if conn.set(keys.noted("hash-encoding"), 1, nx=True):
        click.echo(
            f"note: this Redis's hash-max-listpack-value is {int(limit)}: each queued job takes ~1.1 KB of "
            f"Redis beyond its prompt ids, ~0.5 KB with {HASH_VALUE_LIMIT} (docs/cluster.md); said once",
            err=True,
        )


def print_summary(name: str, summary: Summary) -> None:
    counts = summary.as_dict()
    click.echo(f"{name}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


def enqueue_main() -> None:
    """Entry point of the `enqueue` script."""
    sys.exit(enqueue_command.main(prog_name="enqueue"))
