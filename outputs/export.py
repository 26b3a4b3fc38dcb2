"""`genq export`: training files made from what the collector wrote, which it only reads.

- ``eagle3``: ``tokenized_data.jsonl``, ``input_ids`` = prompt ids + output ids and ``loss_mask`` = 0
  over the prompt, 1 over the output (EAGLE-3 drafter training). The prompt ids come from the record
  (kept by ``enqueue``, the default) and must match its ``prompt_tokens``.
- ``sharegpt``: ``sharegpt.jsonl``, ``conversations`` of ``{"from", "value"}``: the prompt conversation
  and the regenerated ``gpt`` turn.
- ``messages``: ``messages.jsonl``, OpenAI-style ``messages`` likewise.
- ``openai-batch``: ``batch_output.jsonl``, the OpenAI Batch API's output lines (genq/openai_batch.py),
  a chat or text completion as each request's url asked; every record, truncated ones too (the Batch
  API answers them with ``finish_reason`` length), and each failure of ``errors.jsonl`` as a line
  with ``error`` set, all in row order.

Records are exported in the order of their rows in the dataset (then samples), each with the row's
own ``source_id``, whatever order they finished in; a line still being written (no newline yet) is
left for the next export. Besides genq's records, the older shapes users have on disk are read
too: OpenAI chat completions (``choices[0].message``) and pre-tokenized rows (``input_ids`` +
``loss_mask``). Every record left out is counted with its reason. Each file is written aside and
renamed into place, so an export cut short never looks finished.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import importlib.util
import os
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import orjson

from genq import datasets, openai_batch
from genq.outputs import card, parquet
from genq.outputs.stats import percentiles
from genq.schema import ERRORS, EXPORTS, RAW, REJECTED_SAMPLES
from genq.settings import Refused, option
from genq.templates import ChatTemplate, RemoteCodeRefused, TemplateError

SHAREGPT_FROM = {"user": "human", "assistant": "gpt", "system": "system"}


@dataclass
class Exported:
    path: Path
    written: int = 0
    rendered: int = 0  # text records turned into ids with --tokenizer
    files: list[Path] = field(default_factory=list)  # what was written: one JSONL file, or Parquet shards
    lengths: list[int] = field(default_factory=list)  # completion tokens of the records exported
    skipped: Counter[str] = field(default_factory=Counter)


@dataclass
class _View:
    """What an export needs of one record, whatever its shape."""

    id: Any
    prompt_ids: list[int] | None
    output_ids: list[int] | None
    prompt_tokens: int | None
    messages: list[dict[str, Any]] | None
    content: str | None
    reasoning: str | None
    finish: str | None
    loss_mask: list[int] | None = None  # a pre-tokenized row: already in eagle3 shape
    turns: list[dict[str, Any]] | None = None  # a conversation regenerated turn by turn
    tools: list[dict[str, Any]] | None = None  # the functions the prompt offered (rendered with it)


def export_dataset(
    raw: Path,
    out: Path,
    fmt: str,
    reasoning_content: bool = False,
    include_truncated: bool = False,
    template: Callable[[], ChatTemplate | None] = lambda: None,
    shard_bytes: int | None = None,
) -> Exported:
    """Write ``out`` from ``raw`` (a raw_responses.jsonl) in format ``fmt``; ``template`` gives the
    chat template that renders text-only records (a chat backend's) and conversations into ids for
    eagle3, loaded when a record first needs it (records with their ids need none). With
    ``shard_bytes`` (``parquet``, and eagle3 with --parquet) Parquet shards of about that size go
    beside ``out``, named after its stem (outputs/parquet.py)."""
    result = Exported(out)
    rows = _rows(raw, fmt, reasoning_content, include_truncated, template, result)
    if shard_bytes is not None:
        columns = parquet.EAGLE3_COLUMNS if fmt == "eagle3" else parquet.RECORD_COLUMNS
        stem = out.name.split(".")[0]
        result.files, result.written = parquet.write(
            rows, out.parent, stem, columns, shard_bytes, result.skipped
        )
        return result
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    with tmp.open("wb") as fh:
        for row in rows:
            fh.write(orjson.dumps(row) + b"\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out)
    result.files = [out]
    return result


def _rows(
    raw: Path,
    fmt: str,
    reasoning_content: bool,
    include_truncated: bool,
    template: Callable[[], ChatTemplate | None],
    result: Exported,
) -> Iterator[dict[str, Any]]:
    """The rows of format ``fmt``, in row order, each counted in ``result`` (written, or left out
    with the reason)."""
    if fmt == "openai-batch":
        for line in _batch_lines(raw, reasoning_content):
            result.written += 1
            yield line
        return
    if fmt == "parquet":  # every record, each id's last: the record store, truncated ones too
        for record in records(raw):
            if not isinstance(record.get("schema"), int) or not isinstance(record.get("id"), str):
                result.skipped["not a genq record (parquet holds genq's records)"] += 1
                continue
            result.written += 1
            _note_length(result, record)
            yield parquet.record_row(record)
        return
    for record in records(raw):
        view = _view(record)
        if view is None:
            result.skipped["not a record genq knows (no output_ids, choices or input_ids)"] += 1
            continue
        if view.finish == "length" and not include_truncated:
            result.skipped["truncated (finish_reason length; --include-truncated keeps them)"] += 1
            continue
        rendered = view.turns is not None or view.output_ids is None
        chat = template() if fmt == "eagle3" and rendered and view.messages else None
        if chat is not None:
            row = _rendered(view, chat, reasoning_content)
            result.rendered += not isinstance(row, str)
        elif fmt == "eagle3" and view.turns is not None:
            row = "a conversation: eagle3 renders it whole with --tokenizer (the dataset's)"
        elif fmt == "eagle3" and view.prompt_ids is None and _text_prompt(view) is not None:
            row = _text_prompted(view, template())
        elif fmt == "eagle3":
            row = _eagle3(view)
        else:
            row = _chat(view, fmt, reasoning_content)
        if isinstance(row, str):
            result.skipped[row] += 1
            continue
        if record.get("source_id") is not None:
            row["source_id"] = record["source_id"]  # the user's own id of the row
        result.written += 1
        _note_length(result, record)
        yield row


def _note_length(result: Exported, record: dict[str, Any]) -> None:
    if type(record.get("completion_tokens")) is int:
        result.lengths.append(record["completion_tokens"])


def _batch_lines(raw: Path, reasoning_content: bool) -> Iterator[dict[str, Any]]:
    """The Batch API's output lines: records and failures (errors.jsonl beside ``raw``) merged in row
    order; a job both failed and then answered (requeued) has only its answer's line."""
    errors = raw.with_name(ERRORS)
    answered = ((key, False, r) for key, r in _keyed(raw))
    failed = ((key, True, e) for key, e in _keyed(errors)) if errors.is_file() else iter(())
    last = None
    for key, is_error, data in heapq.merge(answered, failed, key=lambda entry: (entry[0], entry[1])):
        if key == last:
            continue
        last = key
        yield openai_batch.error_line(data) if is_error else openai_batch.output_line(data, reasoning_content)


def records(raw: Path) -> Iterator[dict[str, Any]]:
    """The records in the order of their rows in the dataset (and samples within a row)."""
    return (record for _, record in _keyed(raw))


def _keyed(raw: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """The lines with their order, in the order of their rows in the dataset (and samples within a
    row), not the order they finished in; lines without a row (other tools' shapes) after them, in
    file order. Of an id's several lines (a record and its extensions) only the last.

    Two passes keep memory small: the first notes each line's row, sample and offset (16 bytes a
    line), the second reads the lines in order."""
    keys, offsets = array("q"), array("q")
    with raw.open("rb") as fh:
        offset = 0
        for line_no, line in enumerate(fh, start=1):
            if not line.endswith(b"\n"):
                break  # the collector is writing it: the next export takes it
            if line.strip():
                keys.append(_order(_parse(raw, line_no, line), line_no))
                offsets.append(offset)
            offset += len(line)
        order = sorted(range(len(keys)), key=keys.__getitem__)  # stable: an id's lines in file order
        for at, index in enumerate(order):
            if at + 1 < len(order) and keys[order[at + 1]] == keys[index]:
                continue  # superseded by its id's later line (the supersede rule: genq/schema.py extends)
            fh.seek(offsets[index])
            yield keys[index], orjson.loads(fh.readline())


def _parse(raw: Path, line_no: int, line: bytes) -> Any:
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise click.ClickException(f"{raw}:{line_no}: malformed JSON: {exc}") from exc


def _order(record: Any, line_no: int) -> int:
    """A sort key: the row, then the sample (fewer than 2**20 per row); past every row, the line."""
    row = record.get("row") if isinstance(record, dict) else None
    sample = record.get("sample") or 0 if isinstance(record, dict) else 0
    if isinstance(row, int) and isinstance(sample, int) and 0 <= row < 2**40 and 0 <= sample < 2**20:
        return row << 20 | sample
    return 2**62 + line_no


def _view(record: dict[str, Any]) -> _View | None:
    if "output_ids" in record:  # genq's own records
        return _View(
            record.get("id"),
            record.get("input_ids"),
            record["output_ids"],
            record.get("prompt_tokens"),
            record.get("messages"),
            record.get("content"),
            record.get("reasoning"),
            record.get("finish_reason"),
            turns=record.get("turns"),
            tools=record.get("tools"),
        )
    choices = record.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):  # OpenAI chat completion
        message = choices[0].get("message") or {}
        usage = record.get("usage") or {}
        return _View(
            record.get("id"),
            None,
            None,
            usage.get("prompt_tokens"),
            record.get("messages"),
            message.get("content"),
            message.get("reasoning_content") or message.get("reasoning"),
            choices[0].get("finish_reason"),
        )
    if "input_ids" in record and "loss_mask" in record:  # pre-tokenized training rows
        ids = record["input_ids"]
        return _View(record.get("id"), ids, None, None, None, None, None, None, record["loss_mask"])
    return None


def _eagle3(view: _View) -> dict[str, Any] | str:
    """prompt ids + output ids, loss on the output only; or why the record cannot be exported."""
    if view.loss_mask is not None:
        if not isinstance(view.prompt_ids, list) or len(view.loss_mask) != len(view.prompt_ids):
            return "input_ids and loss_mask of different lengths"
        return {"id": view.id, "input_ids": view.prompt_ids, "loss_mask": view.loss_mask}
    if view.output_ids is None:
        return (
            "no output_ids (a text-only record: a chat backend's, or OpenAI-style; --tokenizer renders them)"
        )
    if view.prompt_ids is None:
        return "no prompt input_ids in the record (enqueued with --no-keep-prompt, or by an older genq)"
    if view.prompt_tokens is not None and len(view.prompt_ids) != view.prompt_tokens:
        return "prompt input_ids do not match the server's prompt_tokens"
    return {
        "id": view.id,
        "input_ids": view.prompt_ids + view.output_ids,
        "loss_mask": [0] * len(view.prompt_ids) + [1] * len(view.output_ids),
    }


def _text_prompt(view: _View) -> str | None:
    """The prompt text of a record whose prompt was sent as plain text (no chat template, so no
    ids kept): the one user message the worker keeps for it (worker/record.py)."""
    messages = view.messages or []
    if view.output_ids is None or view.turns is not None or len(messages) != 1:
        return None
    content = messages[0].get("content") if messages[0].get("role") == "user" else None
    return content if isinstance(content, str) else None


def _text_prompted(view: _View, template: ChatTemplate | None) -> dict[str, Any] | str:
    """eagle3 of a text prompt: its ids as the server read them (the tokenizer's plain encoding,
    checked against the server's prompt_tokens), then the server's own output ids."""
    if template is None:
        return (
            "a text prompt sent without a tokenizer (the server tokenized it; the record has no "
            "prompt ids): pass --tokenizer with the server's model to encode it as the server did"
        )
    ids = template.encode(_text_prompt(view) or "")
    if view.prompt_tokens is not None and len(ids) != view.prompt_tokens:
        return (
            f"--tokenizer reads the prompt text as {len(ids)} tokens where the server read "
            f"{view.prompt_tokens}: not the server's tokenizer"
        )
    return _eagle3(dataclasses.replace(view, prompt_ids=ids))


def _rendered(view: _View, template: ChatTemplate, reasoning_content: bool) -> dict[str, Any] | str:
    """The regenerated conversation rendered whole with the chat template, loss on every assistant
    turn: a conversation (``--turns all``), or a text-only record (a chat backend's). The ids are
    the template's reading of the text, not the ids the server sampled."""
    if view.content is None:
        return "no answer after the reasoning (the thought never ended)"
    rendered = template.assistant_spans(_conversation(view, reasoning_content), view.tools)
    if isinstance(rendered, str):
        return rendered
    ids, mask = rendered
    return {"id": view.id, "input_ids": ids, "loss_mask": mask}


def _conversation(view: _View, reasoning_content: bool) -> list[dict[str, Any]]:
    """The prompt conversation and the regenerated answer; the answers keep their reasoning as
    reasoning_content only when asked."""
    answer: dict[str, Any] = {"role": "assistant", "content": view.content}
    if reasoning_content and view.reasoning is not None:
        answer["reasoning_content"] = view.reasoning
    turns = [*(view.messages or []), answer]
    if not reasoning_content:
        turns = [{k: v for k, v in t.items() if k != "reasoning_content"} for t in turns]
    return turns


def _chat(view: _View, fmt: str, reasoning_content: bool) -> dict[str, Any] | str:
    """The prompt conversation and the regenerated assistant turn; or why not."""
    if not view.messages:
        return "no prompt conversation in the record (pre-tokenized rows, or --no-keep-prompt)"
    if view.content is None:
        return "no answer after the reasoning (the thought never ended)"
    turns = _conversation(view, reasoning_content)
    tools = {"tools": view.tools} if view.tools else {}
    if fmt == "messages":
        return {"id": view.id, "messages": turns, **tools}
    conversations = []
    for turn in turns:
        shared = {"from": SHAREGPT_FROM.get(turn["role"], turn["role"]), "value": turn.get("content")}
        if "reasoning_content" in turn:
            shared["reasoning_content"] = turn["reasoning_content"]
        conversations.append(shared)
    return {"id": view.id, "conversations": conversations, **tools}


def recorded_template(folder: Path, trust_remote_code: bool = False) -> ChatTemplate | None:
    """The chat template of the tokenizer the dataset was enqueued with (its dataset.json, which
    the collector writes), for eagle3 without --tokenizer; None, said in one line, when none was
    recorded usable here."""
    try:
        settings = datasets.read_file(folder)
    except ValueError as exc:
        click.echo(f"{folder.name}: {exc}; pass --tokenizer", err=True)
        return None
    name = settings.prompting.get("tokenizer") if settings else None
    if not isinstance(name, str):
        return None
    spec = {
        "tokenizer": name,
        "kwargs": settings.prompting.get("chat_template_kwargs") or {},
        "fingerprint": settings.prompting.get("chat_template"),
    }
    try:  # the worker's own check: the template enqueue hashed, or none
        return ChatTemplate.from_spec(spec, settings.prompting, trust_remote_code)
    except TemplateError as exc:
        click.echo(f"{folder.name}: the dataset's tokenizer is not usable here: {exc}", err=True)
        return None


@click.command("export")
@click.argument("out_dir", metavar="DIR", type=click.Path(exists=True, file_okay=False, path_type=Path))
@option(
    "--format",
    "fmt",
    env="GENQ_EXPORT_FORMAT",
    type=click.Choice(list(EXPORTS)),
    required=True,
    help="What to write.",
)
@option(
    "--out",
    "export_dir",
    env="GENQ_EXPORT_OUT",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write under this folder (default: DIR), one subfolder per dataset.",
)
@option(
    "--dataset",
    env="GENQ_EXPORT_DATASET",  # not GENQ_DATASET: that names the dataset enqueue writes
    default=None,
    help="Only this dataset (default: every folder of DIR with results).",
)
@option(
    "--parquet",
    "parquet_rows",
    is_flag=True,
    help="eagle3: write the rows as Parquet shards (tokenized_data-00000-of-0000N.parquet) instead of JSONL.",
)
@option(
    "--shard-mb",
    env="GENQ_EXPORT_SHARD_MB",
    type=click.FloatRange(min=0.01),
    default=500,
    show_default=True,
    help="Parquet: the size of a shard, in MB of Arrow data.",
)
@option(
    "--license",
    "license_id",
    env="GENQ_EXPORT_LICENSE",
    default="other",
    show_default=True,
    help="The license the dataset card (README.md) names, as the Hub spells it (e.g. apache-2.0).",
)
@option("--reasoning-content", is_flag=True, help="Keep the reasoning as the answer's reasoning_content.")
@option("--include-truncated", is_flag=True, help="Also export outputs cut by max_new_tokens.")
@option(
    "--tokenizer",
    default=None,
    help="eagle3: render conversations (--turns all) and text-only records (a chat backend's) with this "
    "tokenizer's chat template, loss on every assistant turn; encode prompts sent as plain text "
    "(enqueued without --tokenizer) as the server did.",
)
@option(
    "--trust-remote-code",
    is_flag=True,
    help="eagle3: run the tokenizer's own code (Kimi-K2's tokenization_kimi.py), the given one or the "
    "dataset's: this host's consent.",
)
def export_command(
    out_dir: Path,
    fmt: str,
    export_dir: Path | None,
    dataset: str | None,
    parquet_rows: bool,
    shard_mb: float,
    license_id: str,
    reasoning_content: bool,
    include_truncated: bool,
    tokenizer: str | None,
    trust_remote_code: bool,
) -> None:
    """Training files from DIR/<dataset>/raw_responses.jsonl, which is only read.

    eagle3: tokenized_data.jsonl (input_ids, loss_mask; Parquet with --parquet); sharegpt:
    sharegpt.jsonl; messages: messages.jsonl; openai-batch: batch_output.jsonl (the OpenAI Batch
    API's output lines, failures included); parquet: records-*.parquet (every record, each id's
    last, all its fields). Records left out are counted with the reason.
    """
    if parquet_rows and fmt != "eagle3":
        raise click.UsageError("--parquet writes eagle3 rows; --format parquet writes the records")
    shard_bytes = int(shard_mb * 2**20) if fmt == "parquet" or parquet_rows else None
    if shard_bytes is not None and importlib.util.find_spec("pyarrow") is None:
        raise click.ClickException("Parquet needs pyarrow: pip install 'genq[datasets]'")
    try:
        given = (
            ChatTemplate(tokenizer, trust_remote_code=trust_remote_code)
            if tokenizer and fmt == "eagle3"
            else None
        )
    except RemoteCodeRefused as exc:
        raise Refused(str(exc)) from exc
    except TemplateError as exc:
        raise click.ClickException(str(exc)) from exc
    present = sorted(p.parent.name for p in out_dir.glob(f"*/{RAW}"))
    names = [dataset] if dataset else present
    if not dataset:
        _say_nothing_recorded(out_dir, present)
    if not names:
        raise click.ClickException(f"{out_dir}: no <dataset>/{RAW} in it")
    empty = []  # datasets whose every record was left out: nothing to train on is a failure
    for name in names:
        raw = out_dir / name / RAW
        if not raw.is_file():
            there = f"datasets in {out_dir}: {', '.join(present)}" if present else f"no dataset in {out_dir}"
            raise click.ClickException(f"{raw}: no such file; {there} (--dataset)")
        folder = out_dir / name
        template = functools.cache(
            lambda folder=folder: given or recorded_template(folder, trust_remote_code)
        )
        target = EXPORTS[fmt] if not parquet_rows else "tokenized_data.parquet"
        result = export_dataset(
            raw,
            (export_dir or out_dir) / name / target,
            fmt,
            reasoning_content,
            include_truncated,
            template,
            shard_bytes,
        )
        shards = f" ({len(result.files)} shards: {result.files[0].name}...)" if len(result.files) > 1 else ""
        click.echo(f"{name}: wrote {result.written} to {result.files[0]}{shards}")
        config = f"{fmt}-parquet" if parquet_rows else fmt
        lengths = percentiles(result.lengths)
        text = card.render(name, folder, result.files[0].parent, config, result.written, license_id, lengths)
        click.echo(f"{name}: its dataset card: {card.write(result.files[0].parent, text)}")
        used = template() if result.rendered else None
        if used is not None:
            whose = "" if given else " (the dataset's, recorded at enqueue)"
            click.echo(f"{name}: rendered {result.rendered} records with {used.name}'s template{whose}")
        for reason, n in result.skipped.most_common():
            click.echo(f"{name}: left out {n}: {reason}", err=True)
        if not result.written and result.skipped:
            empty.append(name)
    if empty:
        raise click.ClickException(
            f"nothing exported from {', '.join(empty)}: every record was left out, for the reasons above"
        )


def _say_nothing_recorded(out_dir: Path, present: list[str]) -> None:
    """A dataset folder with files but no record to export (a checked dataset nothing of which was
    accepted, one whose every job failed): said, not skipped without a word."""
    for folder in sorted(p for p in out_dir.iterdir() if p.is_dir() and p.name not in present):
        held = [name for name in (REJECTED_SAMPLES, ERRORS) if (folder / name).is_file()]
        if held:
            click.echo(
                f"{folder.name}: nothing to export: no {RAW} (no record accepted or made); its lines are in "
                f"{', '.join(held)}",
                err=True,
            )
