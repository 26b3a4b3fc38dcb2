"""`genq enqueue` (also installed as `enqueue`)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import click
import redis

from genq import backends, backoff, datasets, sources
from genq.connection import HASH_VALUE_LIMIT, connect, redact, wait_for_redis
from genq.keys import Keys, validate_name
from genq.sampling import FLAGGED, Sampling, SamplingError, sampling_options
from genq.sampling import check as check_sampling
from genq.settings import Refused, json_object, option, redis_options
from genq.templates import ChatTemplate, RemoteCodeRefused, TemplateError
from producer import thinking
from producer.context import Limits
from producer.dry_run import check_files, describe
from producer.enqueue import Options, Summary, enqueue_dataset
from producer.formats import CHAT_FORMATS, FIELDS, FORMATS, Shape
from producer.lease import LeaseLost
from producer.readers import first_sampling
from producer.rejects import RejectsFile

# The exit status of an enqueue that rejected rows (the rest enqueued), unless --allow-rejects.
EXIT_REJECTED = 3
SIZE_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def dataset_name(dataset: str | None, files: tuple[str, ...]) -> str:
    name = dataset or Path(files[0]).stem
    try:
        return validate_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--dataset") from exc


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
@click.argument("files", nargs=-1, required=True)
@option("--dataset", default=None, help="Dataset name (default: the first file's stem).")
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
    "--split", default=None, help="Split of a Hugging Face dataset folder (default: train, or the only one)."
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
def enqueue_command(
    files,
    dataset,
    fmt,
    fields,
    split,
    tokenizer,
    trust_remote_code,
    chat_template_kwargs,
    system_prompt,
    turns,
    logprobs,
    continue_to,
    keep_prompt,
    keep_fields,
    checked,
    accept,
    max_samples,
    sampling: Sampling,
    replace_settings,
    register_only,
    context_length,
    server,
    backend,
    vocab_size,
    clip_max_new_tokens,
    max_queued,
    max_row_bytes,
    rejects,
    allow_rejects,
    reasoning_preset,
    think_start,
    think_start_token_id,
    think_end,
    think_end_token_id,
    dry_run,
    redis_wait,
    redis_url,
    namespace,
):
    """Enqueue one job per prompt of FILES: JSON Lines, JSON arrays, Parquet, or Hugging Face dataset
    folders; globs allowed. Rows hold input_ids, messages, conversations, prompt or instruction.

    Idempotent: rows already queued, in flight or on disk are skipped, so the same command can
    be run again safely, even at once (a second enqueue of a dataset waits for the first). Rows are
    numbered across FILES in order: give the same files first; a file whose rows enqueued before
    have changed is refused.
    """
    name = dataset_name(dataset, files)
    limits = Limits(context_length=context_length, vocab_size=vocab_size)
    accepted = backends.BACKENDS[backend].sampling_keys if backend in backends.BACKENDS else None
    if server:
        try:
            info = _probe_patiently(server, backend)
        except (backends.ServerRefused, backends.AttemptError) as exc:
            bare = backends.split_credentials(server)[0]
            hint = (
                "; is the server running? check the URL" if getattr(exc, "kind", None) == "connection" else ""
            )
            raise click.ClickException(f"could not read the limits of {bare}: {exc}{hint}") from exc
        backend = info.backend
        vllm_chat = backend == "openai-chat" and (info.version or "").startswith("vllm")
        accepted = backends.VLLM_SAMPLING_KEYS if vllm_chat else backends.BACKENDS[backend].sampling_keys
        found = Limits.of_server(info)
        limits = Limits(
            limits.context_length or found.context_length,
            found.max_input_len,
            limits.vocab_size or found.vocab_size,
        )
    if accepted is not None:
        try:
            check_sampling(sampling.params(), accepted, backend)
        except SamplingError as exc:
            raise click.UsageError(str(exc)) from exc
    if logprobs is not None and backend in backends.BACKENDS and not backends.BACKENDS[backend].logprobs:
        raise click.UsageError(f"--logprobs: the {backend} backend cannot return them (sglang and vllm can)")
    if logprobs is not None and turns == "all":
        raise click.UsageError("--logprobs is not kept for --turns all conversations yet")
    server_renders = backend == "openai-chat"
    if continue_to is not None:
        _check_continue_to(continue_to, sampling.params()["max_new_tokens"], server_renders, turns)
    if server_renders and tokenizer:
        raise click.UsageError(
            "--tokenizer renders prompts into token ids; the openai-chat backend sends messages"
        )
    if tokenizer is None and not server_renders:
        if chat_template_kwargs:
            raise click.UsageError(
                "--chat-template-kwargs needs --tokenizer (it goes through the chat template)"
            )
        if system_prompt:
            raise click.UsageError("--system-prompt needs --tokenizer, or --backend openai-chat")
        if fmt in CHAT_FORMATS:
            raise click.UsageError(
                f"--format {fmt} needs --tokenizer (genq does not guess a chat template), "
                "or --backend openai-chat"
            )
    samples, check = check_stage(checked, accept, max_samples, sampling.samples)
    if dry_run and register_only:
        raise click.UsageError("--dry-run records nothing: it cannot go with --register-only")
    if clip_max_new_tokens and limits.context_length is None:
        raise click.UsageError("--clip-max-new-tokens needs --context-length or --server")
    try:
        paths = sources.expand(list(files))
        template = ChatTemplate(tokenizer, chat_template_kwargs, trust_remote_code) if tokenizer else None
        think, special = thinking.resolve(
            reasoning_preset, think_start, think_start_token_id, think_end, think_end_token_id, template
        )
        if template is not None and limits.vocab_size is None:
            limits.vocab_size = len(template.tokenizer)
    except RemoteCodeRefused as exc:
        raise Refused(str(exc)) from exc
    except (sources.SourceError, TemplateError) as exc:
        raise click.ClickException(str(exc)) from exc
    except thinking.ThinkError as exc:
        raise click.UsageError(str(exc)) from exc
    params = sampling.params()
    if special:
        params["skip_special_tokens"] = False
        click.echo(
            f"{name}: the think end {think['end']!r} is a special token: sending skip_special_tokens=false "
            "so it stays in the text",
            err=True,
        )
    shape = Shape(
        fmt,
        fields,
        system_prompt,
        chat=template is not None or server_renders,
        server_renders=server_renders,
        turns=turns,
        keep_fields=tuple(dict.fromkeys(keep_fields)),
    )
    row_base = None
    try:
        first = first_sampling(paths, shape, split, max_row_bytes)
    except sources.SourceError as exc:
        raise click.ClickException(str(exc)) from exc
    if first is not None:  # OpenAI Batch rows: the first one's sampling is the dataset's
        row_base, params = params, rows_recipe(params, *first)
        if accepted is not None:
            try:
                check_sampling(params, accepted, backend)
            except SamplingError as exc:
                raise click.UsageError(f"{first[0]}: {exc}") from exc
    options = Options(
        shape=shape,
        split=split,
        template=template,
        think=think,
        keep_prompt=keep_prompt,
        logprobs=logprobs,
        limits=limits,
        clip=clip_max_new_tokens,
        max_queued=max_queued,
        max_row_bytes=max_row_bytes,
        row_base=row_base,
        continue_to=continue_to,
        check=check,
        # The server renders (a chat backend): the template's switches go with each request.
        server_kwargs=chat_template_kwargs if server_renders and chat_template_kwargs else None,
    )
    if dry_run:
        report_dry_run(name, paths, params, samples, options)
        return
    conn = connect(redis_url)
    try:
        wait_for_redis(conn, redis_url, give_up_after=redis_wait)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise click.ClickException(
            f"Redis unreachable at {redact(redis_url)}: {exc} Start redis-server there (or point --redis, "
            "GENQ_REDIS_URL, at yours), or use `genq run`, which starts a private one"
        ) from exc
    if not register_only:
        hint_hash_encoding(conn, Keys(namespace))
    rejects_file = RejectsFile(rejects) if rejects is not None and not register_only else None
    try:
        summary = enqueue_dataset(
            conn,
            Keys(namespace),
            paths,
            name,
            params,
            samples,
            options,
            replace_settings,
            report=lambda line: click.echo(line, err=True),
            register_only=register_only,
            rejects=rejects_file,
        )
    except (datasets.SettingsMismatch, LeaseLost) as exc:
        raise click.ClickException(str(exc)) from exc
    except sources.SourceError as exc:  # the count pass of --max-queued met a broken file
        raise click.ClickException(str(exc)) from exc
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise click.ClickException(
            f"Redis went away ({exc}): each batch is one MULTI, so nothing is half-enqueued; run the same "
            "command again (it skips what is already queued or done)"
        ) from exc
    finally:
        if rejects_file is not None:
            rejects_file.close()
    if register_only:
        click.echo(f"{name}: settings recorded")
        return
    print_summary(name, summary)
    if summary.fatal:
        raise click.ClickException(summary.fatal)
    if summary.read == 0:
        raise click.ClickException(
            f"{name}: no rows in {', '.join(map(str, paths))}: nothing to enqueue (empty, or blank lines)"
        )
    if summary.rejected and not allow_rejects:
        listed = f"listed in {rejects}" if rejects is not None else "listed above; --rejects FILE keeps them"
        others = "the other rows are enqueued" if summary.read > summary.rejected else "no row was enqueued"
        click.echo(
            f"Error: {name}: {summary.rejected} rows rejected ({listed}); {others}. "
            f"Fix them and run again, or pass --allow-rejects to accept (exit {EXIT_REJECTED})",
            err=True,
        )
        sys.exit(EXIT_REJECTED)


def rows_recipe(params: dict[str, Any], where: str, own: dict[str, Any]) -> dict[str, Any]:
    """The dataset's sampling when its rows carry their own (OpenAI Batch lines): the command line's,
    with the first row's laid over them. A setting given on the command line that the row contradicts
    is refused: neither would be silently dropped."""
    ctx = click.get_current_context()
    flag = {"sampling_seed" if name == "seed" else name: name for name in FLAGGED}
    for key, value in own.items():
        given = key in params and (
            key not in flag or ctx.get_parameter_source(flag[key]) != click.core.ParameterSource.DEFAULT
        )
        if given and params[key] != value:
            raise click.UsageError(
                f"{where}: the row asks for {key} {value!r}, the command line for {params[key]!r}: a dataset "
                "has one recipe (decision 12); drop the flag, or change the file"
            )
    return {**params, **own}


def check_stage(checked: bool, accept: int | None, max_samples: int | None, samples: int) -> tuple[int, dict]:
    """(samples a prompt at most, the dataset's check settings) from --checked, --accept K,
    --max-samples M and --samples."""
    if accept is None:
        if max_samples is not None:
            raise click.UsageError("--max-samples goes with --accept K")
        return samples, {"accept": None} if checked else {}
    if samples != 1:
        raise click.UsageError(
            "--accept K draws samples until K are accepted: use --max-samples, not --samples"
        )
    if max_samples is None:
        raise click.UsageError("--accept K needs --max-samples M, the most samples drawn for one prompt")
    if max_samples < accept:
        raise click.UsageError(f"--max-samples {max_samples} is under --accept {accept}")
    return max_samples, {"accept": accept}


def report_dry_run(
    name: str, paths: list[Path], params: dict[str, Any], samples: int, options: Options
) -> None:
    """--dry-run: each file's counts and first prompt on stdout, rejected rows on stderr."""
    checks = check_files(paths, params, options, report=lambda line: click.echo(line, err=True))
    for check in checks:
        for line in describe(check, samples, options):
            click.echo(line)
    jobs = sum(c.usable for c in checks) * samples
    rejected = sum(c.rejected for c in checks)
    click.echo(
        f"{name}: dry run: would enqueue {jobs} jobs, reject {rejected} rows, with sampling "
        f"{json.dumps(params)}; nothing enqueued, no settings recorded (rows an earlier enqueue "
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


def _check_continue_to(continue_to: int, max_new_tokens: int, server_renders: bool, turns: str) -> None:
    """--continue-to sends prompt + output so far as token ids (worker/pieces.py): refused in one
    line where that cannot be done."""
    if continue_to <= max_new_tokens:
        raise click.UsageError(
            f"--continue-to {continue_to} must be above --max-new-tokens {max_new_tokens}: each request asks "
            "for at most --max-new-tokens (a piece), continued up to --continue-to"
        )
    if server_renders:
        raise click.UsageError(
            "--continue-to sends the prompt and the output so far as token ids; the openai-chat backend "
            "sends messages (give --tokenizer and a token backend: sglang, vllm or llamacpp)"
        )
    if turns == "all":
        raise click.UsageError("--continue-to continues one answer; it does not go with --turns all")


def enqueue_main() -> None:
    """Entry point of the `enqueue` script."""
    sys.exit(enqueue_command.main(prog_name="enqueue"))


# How long enqueue --server waits out a server that fails its limits probe for now (a 500, a 503 while
# it starts, a timeout, a refused connection while it restarts) before it gives up with one line.
PROBE_PATIENCE_S = 60.0


def _probe_patiently(server: str, backend: str) -> backends.ServerInfo:
    """``backends.probe``, its transient failures retried with backoff for PROBE_PATIENCE_S, as a
    worker retries them; a refusal (wrong engine, bad key, a 400) at once."""
    deadline = time.monotonic() + PROBE_PATIENCE_S
    for delay in backoff.doubling(0.5, 8.0):
        try:
            return backends.probe(server, backend)
        except backends.AttemptError as exc:
            if exc.cost in (backends.Cost.FATAL, backends.Cost.AUTH) or time.monotonic() + delay > deadline:
                raise
            bare = backends.split_credentials(server)[0]
            click.echo(
                f"enqueue: {bare} failed its limits probe ({exc}); retrying in {delay:.1f} s", err=True
            )
            time.sleep(delay)
    raise AssertionError("unreachable")  # doubling() never ends
