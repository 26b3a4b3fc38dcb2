"""What to enqueue and how, as one object: `genq enqueue`'s options, checked before a row is read.

:class:`EnqueueRequest` is what `genq enqueue` builds from its command line and what `genq run`
checks before it starts a process. Its life: :meth:`~EnqueueRequest.probe` asks ``--server`` for
its API and limits (:meth:`~EnqueueRequest.with_server` takes them in), :meth:`~EnqueueRequest.check`
refuses, in one usage line, options that cannot go together, and :meth:`~EnqueueRequest.plan`
reads what the options name (files, tokenizer, think markers) into what `enqueue_dataset` runs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from genq import backends, backoff, sources
from genq.keys import validate_name
from genq.pieces import cannot_continue
from genq.producer import thinking
from genq.producer.context import Limits
from genq.producer.enqueue import Options
from genq.producer.formats import CHAT_FORMATS, Shape
from genq.producer.readers import first_row
from genq.producer.row_template import RowTemplate, TemplateRefused
from genq.producer.stage import StageSource
from genq.sampling import Sampling, SamplingError
from genq.sampling import check as check_sampling
from genq.settings import Refused
from genq.templates import ChatTemplate, RemoteCodeRefused, TemplateError

# How long --server is waited out when it fails its limits probe for now (a 500, a 503 while it
# starts, a timeout, a refused connection while it restarts) before enqueue gives up in one line.
PROBE_PATIENCE_S = 60.0


@dataclass(frozen=True)
class Plan:
    """What the options name, read: the files, the dataset's sampling and the enqueue's options."""

    name: str
    paths: list[Path]
    params: dict[str, Any]
    samples: int
    options: Options


@dataclass(frozen=True)
class EnqueueRequest:
    """`genq enqueue`'s options (the flags of the same names; docs/commands.md)."""

    files: tuple[str, ...]
    sampling: Sampling = field(default_factory=Sampling)
    dataset: str | None = None
    # --template: a file (the command line), or a function of the row (Python's API)
    row_template: Path | str | Callable[[Mapping[str, Any]], Any] | None = None
    from_dataset: str | None = None  # a stage: its rows from this dataset's records
    from_out: Path | None = None  # where those records land
    only_accepted: bool = False
    only_stopped: bool = False
    fmt: str = "auto"
    fields: Mapping[str, str] = field(default_factory=dict)
    split: str | None = None
    config: str | None = None
    limit: int | None = None
    tokenizer: str | None = None
    trust_remote_code: bool = False
    chat_template_kwargs: Mapping[str, Any] | None = None
    system_prompt: str | None = None
    turns: str = "last"
    logprobs: int | None = None
    continue_to: int | None = None
    keep_prompt: bool = True
    keep_fields: tuple[str, ...] = ()
    checked: bool = False
    accept: int | None = None
    max_samples: int | None = None
    replace_settings: bool = False
    register_only: bool = False
    wait_collector: float | None = None
    context_length: int | None = None
    server: str | None = None
    backend: str = "auto"
    vocab_size: int | None = None
    clip_max_new_tokens: bool = False
    max_queued: int | None = None
    max_row_bytes: int = sources.MAX_ROW_BYTES
    rejects: Path | None = None
    allow_rejects: bool = False
    reasoning_preset: str | None = None
    think_start: str | None = None
    think_start_token_id: int | None = None
    think_end: str | None = None
    think_end_token_id: int | None = None
    dry_run: bool = False
    # Sampling keys set on purpose (not left at their default): an OpenAI Batch row may not
    # contradict them (rows_recipe).
    given: frozenset[str] = frozenset()
    # What --server said (with_server): its prompt limit and, for a chat API, its engine's version.
    max_input_len: int | None = None
    server_version: str | None = None

    @property
    def name(self) -> str:
        """The dataset's name: --dataset, else the first file's stem."""
        if not self.dataset and not self.files:
            raise click.UsageError("--from-dataset makes a new dataset: name it with --dataset")
        name = self.dataset or Path(self.files[0]).stem
        try:
            return validate_name(name)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--dataset") from exc

    @property
    def server_renders(self) -> bool:
        """Conversations go as messages and the server renders them (a chat backend)."""
        return self.backend == "openai-chat"

    @property
    def limits(self) -> Limits:
        return Limits(self.context_length, self.max_input_len, self.vocab_size)

    def sampling_keys(self) -> frozenset[str] | None:
        """The sampling keys the backend has an equivalent for; None: not known yet (auto)."""
        if self.backend not in backends.BACKENDS:
            return None
        if self.server_renders and (self.server_version or "").startswith("vllm"):
            return backends.VLLM_SAMPLING_KEYS
        return backends.BACKENDS[self.backend].sampling_keys

    # -- the server --------------------------------------------------------------------------

    def probe(self) -> backends.ServerInfo | None:
        """What --server says of itself (None without one); its failures for now waited out for
        PROBE_PATIENCE_S, as a worker waits them out, a refusal said at once in one line."""
        if not self.server:
            return None
        bare = backends.split_credentials(self.server)[0]
        deadline = time.monotonic() + PROBE_PATIENCE_S
        for delay in backoff.doubling(0.5, 8.0):
            try:
                return backends.probe(self.server, self.backend)
            except backends.ServerRefused as exc:
                raise click.ClickException(f"could not read the limits of {bare}: {exc}") from exc
            except backends.AttemptError as exc:
                done = exc.cost in (backends.Cost.FATAL, backends.Cost.AUTH)
                if done or time.monotonic() + delay > deadline:
                    hint = "; is the server running? check the URL" if exc.kind == "connection" else ""
                    raise click.ClickException(f"could not read the limits of {bare}: {exc}{hint}") from exc
                click.echo(
                    f"enqueue: {bare} failed its limits probe ({exc}); retrying in {delay:.1f} s", err=True
                )
                time.sleep(delay)
        raise AssertionError("unreachable")  # doubling() never ends

    def with_server(self, info: backends.ServerInfo | None) -> EnqueueRequest:
        """This request as ``info`` answers it: the server's API, and its limits where no flag set them."""
        if info is None:
            return self
        return dataclasses.replace(
            self,
            backend=info.backend,
            context_length=self.context_length or info.prompt_limit(),
            max_input_len=info.max_input_len,
            vocab_size=self.vocab_size or info.vocab_size,
            server_version=info.version,
        )

    # -- the checks --------------------------------------------------------------------------

    def check(self) -> None:
        """Options that cannot go together, refused in one usage line each, before a row is read."""
        accepted = self.sampling_keys()
        if accepted is not None:
            try:
                check_sampling(self.sampling.params(), accepted, self.backend)
            except SamplingError as exc:
                raise click.UsageError(str(exc)) from exc
        known = backends.BACKENDS.get(self.backend)
        if self.logprobs is not None and known is not None and not known.logprobs:
            raise click.UsageError(
                f"--logprobs: the {self.backend} backend cannot return them (sglang and vllm can)"
            )
        if self.logprobs is not None and self.turns == "all":
            raise click.UsageError("--logprobs is not kept for --turns all conversations yet")
        self._check_stage_source()
        if self.continue_to is not None:
            self._check_continue_to()
        self._check_rendering()
        self.check_stage()
        if self.dry_run and self.register_only:
            raise click.UsageError("--dry-run records nothing: it cannot go with --register-only")
        if self.wait_collector is not None and (self.dry_run or self.register_only):
            raise click.UsageError(
                "--wait-collector goes with an enqueue: not with --dry-run or --register-only"
            )
        if self.clip_max_new_tokens and self.context_length is None:
            raise click.UsageError("--clip-max-new-tokens needs --context-length or --server")

    def _check_stage_source(self) -> None:
        """FILES or --from-dataset (with --template and --from-out), and the filters only with a stage."""
        if bool(self.files) == bool(self.from_dataset):
            raise click.UsageError("give FILES, or --from-dataset NAME (a stage), not both or neither")
        if self.from_dataset is None:
            if self.only_accepted or self.only_stopped or self.from_out is not None:
                raise click.UsageError(
                    "--only-accepted, --only-stopped and --from-out go with --from-dataset"
                )
            return
        if self.row_template is None:
            raise click.UsageError("--from-dataset needs --template: what a record becomes as a row")
        if self.from_out is None:
            raise click.UsageError(
                "--from-dataset needs --from-out DIR, the collector's folder its records land in"
            )
        if self.limit is not None or self.max_queued is not None or self.wait_collector is not None:
            raise click.UsageError("--limit, --max-queued and --wait-collector are for FILES, not a stage")
        if self.dry_run:
            raise click.UsageError("--dry-run reads FILES; a stage's rows are records still to come")

    def row_template_of(self) -> RowTemplate | None:
        """--template read (a file), or the API's function; TemplateRefused in one line."""
        if self.row_template is None:
            return None
        if callable(self.row_template):
            return RowTemplate.from_function(self.row_template)
        if isinstance(self.row_template, str) and ("{{" in self.row_template or "{%" in self.row_template):
            return RowTemplate.from_text(self.row_template)  # the API's inline template text
        return RowTemplate.from_file(Path(self.row_template))

    def stage_source(self) -> StageSource | None:
        if self.from_dataset is None or self.from_out is None:
            return None
        try:
            validate_name(self.from_dataset)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--from-dataset") from exc
        folder = Path(self.from_out) / self.from_dataset
        return StageSource(self.from_dataset, folder, self.only_accepted, self.only_stopped)

    def _check_continue_to(self) -> None:
        """--continue-to sends prompt + output so far as token ids (worker/pieces.py)."""
        most = self.sampling.params()["max_new_tokens"]
        if self.continue_to is not None and self.continue_to <= most:
            raise click.UsageError(
                f"--continue-to {self.continue_to} must be above --max-new-tokens {most}: each request asks "
                "for at most --max-new-tokens (a piece), continued up to --continue-to"
            )
        why = cannot_continue(self.server_renders, self.turns)
        if why is not None:
            raise click.UsageError(f"--continue-to: {why}")

    def _check_rendering(self) -> None:
        """Who renders conversations: genq with --tokenizer, or the server (openai-chat); not both."""
        if self.server_renders and self.tokenizer:
            raise click.UsageError(
                "--tokenizer renders prompts into token ids; the openai-chat backend sends messages"
            )
        if self.tokenizer is not None or self.server_renders:
            return
        if self.chat_template_kwargs:
            raise click.UsageError(
                "--chat-template-kwargs needs --tokenizer (it goes through the chat template)"
            )
        if self.system_prompt:
            raise click.UsageError("--system-prompt needs --tokenizer, or --backend openai-chat")
        if self.fmt in CHAT_FORMATS:
            raise click.UsageError(
                f"--format {self.fmt} needs --tokenizer (genq does not guess a chat template), "
                "or --backend openai-chat"
            )

    def check_stage(self) -> tuple[int, dict[str, Any]]:
        """(samples a prompt at most, the dataset's check settings) from --checked, --accept K,
        --max-samples M and --samples."""
        samples = self.sampling.samples
        if self.accept is None:
            if self.max_samples is not None:
                raise click.UsageError("--max-samples goes with --accept K")
            return samples, {"accept": None} if self.checked else {}
        if samples != 1:
            raise click.UsageError(
                "--accept K draws samples until K are accepted: use --max-samples, not --samples"
            )
        if self.max_samples is None:
            raise click.UsageError("--accept K needs --max-samples M, the most samples drawn for one prompt")
        if self.max_samples < self.accept:
            raise click.UsageError(f"--max-samples {self.max_samples} is under --accept {self.accept}")
        return self.max_samples, {"accept": self.accept}

    # -- the plan ----------------------------------------------------------------------------

    def plan(self) -> Plan:
        """The files, the tokenizer and the think markers the options name, read; the dataset's
        sampling (an OpenAI Batch file's first row's own); the options `enqueue_dataset` runs."""
        name, limits = self.name, self.limits
        try:
            row_template = self.row_template_of()
        except TemplateRefused as exc:
            raise click.ClickException(str(exc)) from exc
        try:
            paths = sources.expand(list(self.files), self.config)
            template = (
                ChatTemplate(self.tokenizer, self.chat_template_kwargs, self.trust_remote_code)
                if self.tokenizer
                else None
            )
            think, special = thinking.resolve(
                self.reasoning_preset,
                self.think_start,
                self.think_start_token_id,
                self.think_end,
                self.think_end_token_id,
                template,
            )
            if template is not None and limits.vocab_size is None:
                limits.vocab_size = len(template.tokenizer)
        except RemoteCodeRefused as exc:
            raise Refused(str(exc)) from exc
        except (sources.SourceError, TemplateError) as exc:
            raise click.ClickException(str(exc)) from exc
        except thinking.ThinkError as exc:
            raise click.UsageError(str(exc)) from exc
        params = self.sampling.params()
        if special:
            params["skip_special_tokens"] = False
            click.echo(
                f"{name}: the think end {think['end']!r} is a special token: sending "
                "skip_special_tokens=false so it stays in the text",
                err=True,
            )
        shape = Shape(
            self.fmt,
            dict(self.fields),
            self.system_prompt,
            chat=template is not None or self.server_renders,
            server_renders=self.server_renders,
            turns=self.turns,
            keep_fields=tuple(dict.fromkeys(self.keep_fields)),
            template=row_template,
        )
        row_base = None
        try:
            first = first_row(paths, shape, self.split, self.max_row_bytes)
        except sources.SourceError as exc:
            raise click.ClickException(str(exc)) from exc
        if (
            first is not None and first.prompt.sampling is not None
        ):  # OpenAI Batch: the row's is the dataset's
            row_base, params = params, self._rows_recipe(params, first.where, first.prompt.sampling)
        if (
            first is not None
            and self.continue_to is not None
            and template is None
            and first.prompt.input_ids is None
        ):
            raise click.UsageError(
                f"--continue-to needs the prompts as token ids, and {first.where} is text: give --tokenizer "
                "(or rows of input_ids); nothing was enqueued"
            )
        samples, check = self.check_stage()
        kwargs = dict(self.chat_template_kwargs) if self.chat_template_kwargs else None
        options = Options(
            shape=shape,
            split=self.split,
            config=self.config,
            limit=self.limit,
            template=template,
            think=think,
            keep_prompt=self.keep_prompt,
            logprobs=self.logprobs,
            limits=limits,
            clip=self.clip_max_new_tokens,
            max_queued=self.max_queued,
            max_row_bytes=self.max_row_bytes,
            row_base=row_base,
            continue_to=self.continue_to,
            check=check,
            # The server renders (a chat backend): the template's switches go with each request.
            server_kwargs=kwargs if self.server_renders else None,
            stage=self.stage_source(),
        )
        return Plan(name, paths, params, samples, options)

    def _rows_recipe(self, params: dict[str, Any], where: str, own: dict[str, Any]) -> dict[str, Any]:
        """The dataset's sampling when its rows carry their own (OpenAI Batch lines): the command
        line's, with the first row's laid over them. A setting given on purpose that the row
        contradicts is refused: neither would be silently dropped."""
        for key, value in own.items():
            if key in params and key in self.given and params[key] != value:
                raise click.UsageError(
                    f"{where}: the row asks for {key} {value!r}, the command line for {params[key]!r}: a "
                    "dataset has one recipe (decision 12); drop the flag, or change the file"
                )
        merged = {**params, **own}
        accepted = self.sampling_keys()
        if accepted is not None:
            try:
                check_sampling(merged, accepted, self.backend)
            except SamplingError as exc:
                raise click.UsageError(f"{where}: {exc}") from exc
        return merged
