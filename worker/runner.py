"""One taken job, run to its ending: a prompt, or a conversation turn by turn (decision 14).

The daemon (worker/daemon.py) decides when a job starts and what happens to it on a stop; the
runner decides what the job sends and what its ending is. Each send goes through
:class:`~worker.attempts.Attempts` (what a failed send costs), each record is built by
worker/record.py, and each ending is handed to the group commit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from genq import conversation, datasets, logprobs
from genq.backends import Answer, Backend, ServerInfo
from genq.backends.base import AttemptError, Cost
from genq.keys import Keys
from genq.pieces import Progress
from genq.schema import KIND_RECORD, JobSpec, now_iso
from genq.templates import ChatTemplate, TemplateError
from genq.worker import metrics, pieces
from genq.worker.attempts import Attempts, Tries
from genq.worker.commits import GroupCommit
from genq.worker.config import WorkerConfig
from genq.worker.record import build_record
from genq.worker.rq_worker import Bookkeeper, Finished, Taken

log = logging.getLogger("genq.worker")


class JobRunner:
    """Runs one job at a time per call, many calls at once: sends its prompt (or each of its
    conversation's turns) until it has a record or an error, and hands that over. ``finish``
    marks a job as having its ending, so the daemon frees its slot and never requeues it."""

    def __init__(
        self,
        config: WorkerConfig,
        keys: Keys,
        books: Bookkeeper,
        redis: Callable[..., Awaitable[Any]],
        attempts: Attempts,
        commits: GroupCommit,
        backend: Callable[[], Backend],
        finish: Callable[[Taken], None],
    ):
        self.config = config
        self.keys = keys
        self.books = books
        self.redis = redis
        self.attempts = attempts
        self.commits = commits
        self._backend = backend
        self.finish = finish
        self._templates: dict[bytes, ChatTemplate] = {}  # chat templates by what names them
        self._named: set[tuple[str, bytes]] = set()  # (dataset, template) checked against its settings
        self._template_lock = asyncio.Lock()
        # dataset -> its tokenizer on this host, for answers without text; None: it has none here.
        self._decoders: dict[str, ChatTemplate | None] = {}
        self._said: set[tuple[str, str]] = set()  # (dataset, why) its records carry no text, said
        self._announced: dict[str, ServerInfo | None] = {}  # dataset -> the probe's facts said to Redis

    async def run(self, t: Taken) -> None:
        """Send until the job ends: a record, or an error for errors.jsonl."""
        backend = self._backend()
        await self._announce(t.spec.dataset, backend)
        if t.spec.logprobs is not None and not backend.logprobs:
            why = f"the job asks for logprobs, which the {backend.name} backend cannot return"
            await self.attempts.fail(t, AttemptError("bad_request", why, cost=Cost.FATAL), 0)
            return
        if t.spec.turns == "all":
            await self._run_conversation(t)
            return
        if t.spec.continue_to is not None:
            await self._run_pieces(t)
            return
        tries = Tries(started=time.monotonic())
        answer = await self.attempts.answer(t, t.spec, tries)
        if answer is not None:
            answer = await self._with_text(t.spec, answer)
            record = self._record(t.spec, answer, tries)
            await self._succeed(t, record, self._frame(t, answer, record))

    async def _run_conversation(self, t: Taken) -> None:
        """Every user turn in order, each sent with the model's own earlier answers (decision 14).
        Finished turns are kept in Redis, so a job whose worker died goes on from its first
        unfinished turn; each turn has the whole attempt budget."""
        spec, job_id = t.spec, t.job.id
        messages = spec.messages or []
        n = conversation.user_turns(messages)
        done: list[dict[str, Any]] = await self.redis(self.books.turns_done, job_id)
        answers = [conversation.answer_message(d["content"], d["reasoning"]) for d in done]
        template = None
        if self._backend().sends == "ids":
            try:
                template = await self._template(spec)
            except TemplateError as exc:
                await self.attempts.fail(t, AttemptError("tokenizer", str(exc), cost=Cost.FATAL), 0)
                return
        started = time.monotonic()
        record: dict[str, Any] = {}
        for k in range(len(done), n):
            prompt = conversation.turn_prompt(messages, answers, k)
            ids = None
            if template is not None:
                ids = (await asyncio.to_thread(template.render, [prompt], [spec.tools]))[0]
                why = ids if isinstance(ids, str) else None
                if k == 0 and why is None and spec.input_ids is not None and ids != spec.input_ids:
                    why = "the worker's chat template renders the first turn differently from enqueue's"
                if why is not None:
                    await self.attempts.fail(t, AttemptError("bad_request", why, cost=Cost.FATAL), 0, (k, n))
                    return
            turn = dataclasses.replace(spec, input_ids=ids, messages=prompt, text=None, turns=None)
            tries = Tries(started=time.monotonic())
            answer = await self.attempts.answer(t, turn, tries, (k, n))
            if answer is None:
                return
            answer = await self._with_text(turn, answer)  # the next turn's prompt holds this answer
            record = self._record(turn, answer, tries)
            done.append({key: record.get(key) for key in conversation.TURN_FIELDS})
            answers.append(conversation.answer_message(record["content"], record["reasoning"]))
            if k < n - 1:
                await self.redis(self.books.save_turns, job_id, done)
        record.update(conversation.totals(done), latency_s=round(time.monotonic() - started, 4), turns=done)
        await self._succeed(t, record)

    async def _run_pieces(self, t: Taken) -> None:
        """An output continued piece by piece up to ``continue_to`` (worker/pieces.py), resumed
        from the last piece Redis kept; each piece has the whole attempt budget."""
        spec, job_id = t.spec, t.job.id
        if spec.input_ids is None:
            why = "--continue-to needs the prompt as token ids, and this job has none"
            await self.attempts.fail(t, AttemptError("bad_request", why, cost=Cost.FATAL), 0)
            return
        progress = await self._progress(t)
        if spec.extends is not None and progress.pieces == 0:
            why = (
                f"the output this extension goes on from is not in {self.keys.pieces} (lost, or not a "
                "worker's): genq retry --truncated re-opens the record again"
            )
            await self.attempts.fail(t, AttemptError("bad_request", why, cost=Cost.FATAL), 0)
            return
        info = self._backend().info
        started, answer, context_full = time.monotonic(), None, False
        while (piece := pieces.next_piece(spec, progress, info)) is not None:
            tries = Tries(started=time.monotonic())
            answer = await self.attempts.answer(t, piece, tries)
            if answer is None:
                return
            progress.add(answer, tries.attempt, spec.id)
            if not pieces.goes_on(spec, progress, answer, piece.max_new_tokens):
                short = len(progress.output_ids) < spec.continue_to
                context_full = answer.finish_reason == "length" and short
                break
            # Never end a piece inside a character: the engine's next text may lose it.
            tail = len(answer.output_ids or []) - 1
            progress.give_back(min(tail, await self._backend().open_character(progress.output_ids)))
            await self.redis(self.books.save_pieces, job_id, progress.to_json())
        else:
            context_full = True
        if answer is None:  # resumed with no room left for a piece: the checkpoint is the output
            answer = Answer(None, None, "length", None, 0, 0, None)
        whole = await self._with_text(spec, progress.joined(answer))
        record = build_record(
            spec,
            whole,
            attempts=sum(progress.attempts),
            latency_s=time.monotonic() - started,
            server=self.config.server,
            worker=self.books.name,
            backend=self._backend().name,
        )
        record.update(pieces.record_fields(spec, progress, context_full))
        if progress.logprobs_error is not None:
            record["logprobs"] = logprobs.without_frame(None, progress.logprobs_error)
        await self._succeed(t, record, self._frame(t, whole, record))

    async def _progress(self, t: Taken) -> Progress:
        """The output so far from an earlier worker (or this one), or a fresh start when there is
        none or what Redis holds is not a worker's checkpoint (said in one line)."""
        raw = await self.redis(self.books.pieces_done, t.job.id)
        if raw is None:
            return Progress()
        try:
            return Progress.from_json(raw, t.spec)
        except ValueError as exc:
            log.error(
                "job %s (%s): its checkpoint in %s is not a worker's (%s): starting the output over",
                t.job.id,
                t.spec.dataset,
                self.keys.pieces,
                exc,
                extra=self.books.log_context(t),
            )
            return Progress()

    async def _announce(self, dataset: str, backend: Backend) -> None:
        """The dataset's provenance: what answers its jobs, said once per dataset and per server
        identity (a probe again, of a server restarted perhaps with another model, is said again).
        One dict lookup per job otherwise."""
        if dataset in self._announced and self._announced[dataset] is backend.info:
            return
        self._announced[dataset] = backend.info
        summary = backend.info.summary() if backend.info is not None else {"backend": backend.name}
        said = {**summary, "worker": self.books.name, "at": now_iso()}
        await self.redis(self.books.announce, dataset, said)

    async def _template(self, spec: JobSpec) -> ChatTemplate:
        """The dataset's chat template, loaded once per worker (transformers, offline), and only
        the one its settings recorded (genq/templates.py)."""
        return await self._load_template(spec.dataset, spec.template or {})

    async def _load_template(self, dataset: str, named: dict[str, Any]) -> ChatTemplate:
        """Checked against each dataset's settings once; loaded once per template, however many
        datasets share it (ten datasets of one tokenizer: one load)."""
        key = orjson.dumps(named, option=orjson.OPT_SORT_KEYS)
        if (dataset, key) not in self._named:
            ChatTemplate.check_spec(named, await self._prompting(dataset))
            self._named.add((dataset, key))
        async with self._template_lock:  # one load at a time: transformers' import is not thread-safe
            if key not in self._templates:
                self._templates[key] = await asyncio.to_thread(
                    ChatTemplate.load_spec, named, self.config.trust_remote_code
                )
        return self._templates[key]

    async def _prompting(self, dataset: str) -> dict[str, Any]:
        recorded = await self.redis(datasets.load, self.books.connection, self.keys, dataset)
        return recorded.prompting if recorded else {}

    async def _with_text(self, spec: JobSpec, answer: Answer) -> Answer:
        """``answer`` with the text its server did not make (--skip-tokenizer-init), decoded with the
        dataset's tokenizer where this host has it, as the engine would have (Backend.decode); as
        it came, text null, where it has not (said once per dataset: never an error)."""
        if answer.detokenized or answer.output_ids is None:
            return answer
        decoder = await self._decoder(spec.dataset)
        if decoder is None:
            return answer
        try:
            decode = self._backend().decode
            text = await asyncio.to_thread(decode, decoder.tokenizer, answer, spec)
        except Exception as exc:  # a tokenizer's code can raise anything; the record goes without text
            self._no_text(spec.dataset, f"its tokenizer could not decode ({type(exc).__name__}: {exc})")
            return answer
        return dataclasses.replace(answer, text=text, detokenized=True)

    async def _decoder(self, dataset: str) -> ChatTemplate | None:
        """The tokenizer the dataset was enqueued with (``--tokenizer``), checked and loaded as its
        chat template is for conversation turns; None, said once, where this host has none."""
        if dataset in self._decoders:
            return self._decoders[dataset]
        prompting = await self._prompting(dataset)
        decoder = None
        if not prompting.get("tokenizer"):
            self._no_text(dataset, "it was enqueued without --tokenizer: genq has none to decode with")
        else:
            named = {
                "tokenizer": prompting["tokenizer"],
                "kwargs": prompting.get("chat_template_kwargs") or {},
                "fingerprint": prompting.get("chat_template"),
            }
            try:
                decoder = await self._load_template(dataset, named)
            except TemplateError as exc:
                self._no_text(dataset, str(exc))
        self._decoders[dataset] = decoder
        return decoder

    def _no_text(self, dataset: str, why: str) -> None:
        """Said once per dataset and reason."""
        if (dataset, why) in self._said:
            return
        self._said.add((dataset, why))
        log.warning(
            "dataset %s: %s answers without text (it skips its tokenizer) and %s: records carry "
            "output_ids and no text",
            dataset,
            self.config.server,
            why,
            extra=self.books.log_context(),
        )

    def _record(self, spec: JobSpec, answer: Answer, tries: Tries) -> dict[str, Any]:
        return build_record(
            spec,
            answer,
            attempts=tries.attempt,
            latency_s=time.monotonic() - tries.started,
            server=self.config.server,
            worker=self.books.name,
            backend=self._backend().name,
        )

    def _frame(self, t: Taken, answer: Answer, record: dict[str, Any]) -> bytes | None:
        """The answer's logprobs frame, checked before it is sent (genq/logprobs.py). One that
        cannot be made costs the frame, not the answer: the record goes without it and says why."""
        if answer.logprobs is None:
            return None
        try:
            return logprobs.pack(t.spec.id, answer.logprobs)
        except logprobs.Invalid as exc:
            record["logprobs"] = logprobs.without_frame(record.get("logprobs"), str(exc))
            log.error(
                "job %s (%s): its logprobs cannot be stored (%s): the record goes without them",
                t.job.id,
                t.spec.dataset,
                exc,
                extra=self.books.log_context(t),
            )
            return None

    async def _succeed(self, t: Taken, record: dict[str, Any], frame: bytes | None = None) -> None:
        self.finish(t)
        await self.commits.finish(Finished(t, KIND_RECORD, record, frame))
        metrics.finished(t.spec.dataset, record)
