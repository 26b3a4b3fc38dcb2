"""Long outputs in pieces (``--continue-to N``): one output, many requests, a crash costs one piece.

Each request asks for at most the dataset's ``max_new_tokens`` (a piece). A piece that ends on
``length`` while the output is shorter than ``continue_to`` is followed by the next: prompt + the
output so far as token ids, with the budget left. With greedy decoding that continues into the
same tokens as one long request would (up to the engine's numerics): the prompt is ids, so nothing
is re-tokenized. After each piece the output so far is kept in Redis (``pieces``, with the job,
freed when its record is handed over; the format is genq/pieces.py), so a worker or server death
resumes from the last piece on any worker.

- Budget: a piece never passes the server's context (prompt + output + piece below it); an output
  that fills the context ends there (``context_full`` on the record).
- Seeds: piece 0 sends the job's own ``sampling_seed``; piece k > 0 sends :func:`piece_seed`, so a
  retried piece is reproducible. With temperature > 0 a pieced output is a valid sample, not the
  one a single request with the same seed would give.
- The record is one record: joined ``output_ids`` and text, the reasoning split over the whole
  output (worker/record.py runs on the joined answer), ``finish_reason`` of the last piece, and
  ``pieces`` with ``piece_attempts``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from genq.backends import Answer, ServerInfo
from genq.pieces import Progress
from genq.schema import JobSpec

SEED_RANGE = 2**31  # every engine takes a seed below this


def piece_seed(seed: int, k: int) -> int:
    """The seed of piece ``k`` > 0 of a sample seeded ``seed``: fixed by both, unlike any other
    sample's own seed in practice (a hash, not seed + k, which is sample k's seed)."""
    digest = hashlib.blake2b(f"genq-piece|{seed}|{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_RANGE


def next_piece(spec: JobSpec, progress: Progress, info: ServerInfo | None) -> JobSpec | None:
    """The request for the next piece, or None: the server has no room for another token. SGLang's
    scheduler lowers max_new_tokens to context - 2 - input (init_req_max_new_tokens, in
    python/sglang/srt/managers/scheduler.py) and takes only inputs shorter than its
    ``max_req_input_len``; vLLM and llama.cpp allow a token more."""
    assert spec.input_ids is not None and spec.continue_to is not None
    done = len(progress.output_ids)
    sent = len(spec.input_ids) + done
    budget = min(spec.max_new_tokens, spec.continue_to - done)
    context = info.prompt_limit() if info is not None else None
    if context is not None:
        budget = min(budget, context - 2 - sent)
    if progress.pieces and info is not None and info.max_input_len is not None and sent >= info.max_input_len:
        return None
    if budget < 1:
        return None
    if progress.pieces == 0:
        return spec
    params: dict[str, Any] = {**spec.sampling_params, "max_new_tokens": budget}
    if isinstance(params.get("sampling_seed"), int):
        params["sampling_seed"] = piece_seed(params["sampling_seed"], progress.pieces)
    return dataclasses.replace(spec, input_ids=spec.input_ids + progress.output_ids, sampling_params=params)


def goes_on(spec: JobSpec, progress: Progress, answer: Answer, asked: int) -> bool:
    """Another piece follows: this one used its whole budget (a ``length`` finish the server did
    not cut short) and the output is below ``continue_to``."""
    whole = answer.finish_reason == "length" and len(answer.output_ids or []) == asked
    return whole and len(progress.output_ids) < (spec.continue_to or 0)


def record_fields(spec: JobSpec, progress: Progress, context_full: bool) -> dict[str, Any]:
    """What a pieced record adds to the record's own fields."""
    extra: dict[str, Any] = {
        "continue_to": spec.continue_to,
        "pieces": progress.pieces,
        "piece_attempts": list(progress.attempts),
    }
    if context_full:
        extra["context_full"] = True
    if progress.given_back:  # decoded twice at the server: GPU work spent on whole characters
        extra["regenerated_tokens"] = progress.given_back
    if spec.extends is not None:  # it supersedes the record it goes on from (genq/schema.py extends)
        extra["extends"] = spec.extends
    return extra
