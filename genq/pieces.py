"""The output so far of a job continued in pieces (``--continue-to``): the checkpoint Redis keeps
in the ``pieces`` hash between pieces, written by workers (worker/pieces.py) and by
``genq retry --truncated`` (producer/extend.py), which starts one from a finished record. Read back,
it is untrusted: :meth:`Progress.from_json` checks it against the job.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from genq import logprobs
from genq.backends import Answer
from genq.schema import JobSpec, dumps, loads


def cannot_continue(server_renders: bool, turns: str | None) -> str | None:
    """Why the outputs of prompts made this way cannot go on a piece at a time (the prompt and the
    output so far sent again as token ids), or None. Written once for `genq enqueue --continue-to`
    and `genq retry --truncated --continue-to` (producer/extend.py)."""
    if server_renders:
        return (
            "its prompts are messages a chat server renders (the openai-chat backend sends messages), and "
            "--continue-to sends the prompt and the output so far as token ids: give --tokenizer and a "
            "token backend (sglang, vllm or llamacpp)"
        )
    if turns == "all":
        return "a conversation (--turns all) is not continued: --continue-to continues one answer"
    return None


@dataclass
class Progress:
    """The output so far of one job: what Redis keeps between pieces."""

    output_ids: list[int] = field(default_factory=list)
    texts: list[str | None] = field(default_factory=list)  # each piece's text
    attempts: list[int] = field(default_factory=list)  # sends charged to each piece
    prompt_tokens: int | None = None  # the first piece's: the prompt itself
    cached_tokens: int | None = None
    # --logprobs: the frame of the output so far (genq/logprobs.py, base64), or why there is none
    logprobs: str | None = None
    logprobs_error: str | None = None
    given_back: int = 0  # ids a piece ended inside a character with, generated again (give_back)

    @property
    def pieces(self) -> int:
        return len(self.attempts)

    def to_json(self) -> bytes:
        return dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: bytes, spec: JobSpec) -> Progress:
        """A checkpoint read from Redis is untrusted: ValueError names what is not what a worker
        writes for ``spec`` (ids that are not token ids, more of them than ``continue_to``)."""
        data = loads(raw)
        if not isinstance(data, dict) or set(data) != {f.name for f in dataclasses.fields(cls)}:
            raise ValueError("not an object with the fields a worker writes")
        ids, texts, attempts = data["output_ids"], data["texts"], data["attempts"]
        if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
            raise ValueError("'output_ids' is not a list of token ids")
        if len(ids) >= (spec.continue_to or 0):
            raise ValueError(f"{len(ids)} output ids for a continue_to of {spec.continue_to}")
        if not isinstance(attempts, list) or not all(type(a) is int and a >= 0 for a in attempts):
            raise ValueError("'attempts' is not a list of counts")
        if not isinstance(texts, list) or len(texts) != len(attempts):
            raise ValueError("'texts' is not one per piece")
        if not all(t is None or isinstance(t, str) for t in texts):
            raise ValueError("'texts' holds something that is not a text")
        if type(data["given_back"]) is not int or data["given_back"] < 0:
            raise ValueError("'given_back' is not a count")
        for name in ("prompt_tokens", "cached_tokens"):
            if data[name] is not None and (type(data[name]) is not int or data[name] < 0):
                raise ValueError(f"{name!r} is not a count")
        if data["logprobs_error"] is not None and not isinstance(data["logprobs_error"], str):
            raise ValueError("'logprobs_error' is not a text")
        if data["logprobs"] is not None:
            try:
                frame = base64.b64decode(data["logprobs"], validate=True)
            except (TypeError, ValueError):
                raise ValueError("'logprobs' is not base64") from None
            why = logprobs.check(frame, spec.id, len(ids))
            if why is not None:
                raise ValueError(f"'logprobs' is not the frame of its output: {why}")
        return cls(**data)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Progress:
        """The checkpoint of a finished record's output, to continue it (``genq retry
        --truncated``): its pieces as they were counted, its text as the first piece's."""
        attempts = record.get("piece_attempts") or [record["attempts"]]
        texts: list[str | None] = [record.get("text")] + [""] * (len(attempts) - 1)
        return cls(
            list(record["output_ids"]),
            texts,
            list(attempts),
            record.get("prompt_tokens"),
            record.get("cached_tokens"),
        )

    def add(self, answer: Answer, attempts: int, record_id: str) -> None:
        self._add_logprobs(answer, record_id)
        self.output_ids += answer.output_ids or []
        self.texts.append(answer.text)
        self.attempts.append(attempts)
        if self.prompt_tokens is None:
            self.prompt_tokens, self.cached_tokens = answer.prompt_tokens, answer.cached_tokens

    def _add_logprobs(self, answer: Answer, record_id: str) -> None:
        """Join the piece's log-probabilities to the output's, packed as the frame it will be: a
        piece whose logprobs cannot make one costs the frame, not the output (as for one request)."""
        if answer.logprobs is None or self.logprobs_error is not None:
            return
        so_far = [logprobs.unpack(base64.b64decode(self.logprobs))] if self.logprobs else []
        if self.pieces and not so_far:
            self.logprobs_error = "a piece before this one came without logprobs"
            return
        try:
            frame = logprobs.pack(record_id, logprobs.join([*so_far, answer.logprobs]))
        except logprobs.Invalid as exc:
            self.logprobs, self.logprobs_error = None, str(exc)
            return
        self.logprobs = base64.b64encode(frame).decode()

    def give_back(self, n: int) -> None:
        """Drop the last ``n`` output ids of the last piece (and their logprobs): the next piece
        generates them again. Its text is kept: the engine held their bytes back from it."""
        if n <= 0:
            return
        self.output_ids = self.output_ids[:-n]
        self.given_back += n
        if self.logprobs is not None:
            frame = base64.b64decode(self.logprobs)
            lp = logprobs.unpack(frame)
            cut = logprobs.LogProbs(lp.token[:-n], lp.top_ids[:-n], lp.top[:-n], lp.flags)
            self.logprobs = base64.b64encode(logprobs.pack(logprobs.record_id(frame), cut)).decode()

    def joined(self, last: Answer) -> Answer:
        """The whole output as one answer, as if one request had made it."""
        texts = [t for t in self.texts if t is not None]
        whole = len(texts) == len(self.texts)  # else a server made no text for some (worker/detokenize.py)
        return dataclasses.replace(
            last,
            output_ids=list(self.output_ids),
            text="".join(texts) if whole else None,
            detokenized=whole,
            prompt_tokens=self.prompt_tokens if self.prompt_tokens is not None else last.prompt_tokens,
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens,
            finish_length=None,
            reasoning=None,
            content=None,
            logprobs=logprobs.unpack(base64.b64decode(self.logprobs)) if self.logprobs else None,
        )
