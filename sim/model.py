"""The simulator's deterministic "model": the same prompt and seed always give the same tokens.

Tests import it to compute what the server must answer, with no server running. The output is a
pure function of (input_ids, sampling_seed, the stop/length settings and any sampling setting
away from its neutral value: see NEUTRAL). json_schema, regex and ebnf are accepted but do not
constrain it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

VOCAB_SIZE = 32000
EOS_TOKEN_ID = 2
FIRST_WORD_ID = 100  # ids below this are special tokens, as control tokens are in a real vocab
DEFAULT_CONTEXT_LENGTH = 8192
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params has no max_new_tokens
DEFAULT_MIN_LEN = 16
DEFAULT_MAX_LEN = 512
MODEL_PATH = "genq/sim-model"

_WORD_TEXT = """
    the of and to in is was for on that with as by at from it an be this which or are were but not
    have had has one all their they there been more when will would who so if out up about into
    than them can only other new some could time these two may then do first any my now such like
    our over man me even most made after also did many before must through back years where much
    your way well down should because each just those people how too little state good very make
    world still own see men work long get here between both life being under never day same another
    know while last might us great old year off come since against go came right used take three
"""
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class Generation:
    """One finished generation, shaped like the fields SGLang returns for it."""

    output_ids: list[int]  # untrimmed: includes the EOS or stop token that finish_reason names
    text: str  # the completion only, with the matched stop trimmed
    finish_reason: dict[str, Any]
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Thinking:
    """A reasoning model's think markers (ids of the tokenizer the prompts were rendered with, as
    Kimi-K2.5's <think> 163606 and </think> 163607): a prompt whose last start marker is not closed
    (a generation prompt opening <think>) gets an answer that closes its thought partway, the
    end marker then the content. Both are special tokens: text shows them only with
    skip_special_tokens false."""

    start_id: int
    end_id: int

    def opened(self, input_ids: Sequence[int]) -> bool:
        """The prompt leaves a thought open: its last start marker after its last end marker."""
        for token in reversed(input_ids):
            if token == self.end_id:
                return False
            if token == self.start_id:
                return True
        return False

    def text(self, token_id: int) -> str | None:
        return {self.start_id: "<think>", self.end_id: "</think>"}.get(token_id)


@lru_cache(maxsize=65536)
def _word_id(word: str) -> int:
    digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
    return FIRST_WORD_ID + int.from_bytes(digest, "little") % (VOCAB_SIZE - FIRST_WORD_ID)


def tokenize(text: str) -> list[int]:
    """One token per whitespace-separated word; blake2b keeps ids stable across processes."""
    return [_word_id(word) for word in text.split()]


def _special_text(token_id: int) -> str:
    return "</s>" if token_id == EOS_TOKEN_ID else f"<|special_{token_id}|>"


def detokenize(ids: Iterable[int], skip_special_tokens: bool = True, thinking: Thinking | None = None) -> str:
    """Deterministic words for ids; special ids (< 100, and the think markers) are dropped unless
    asked for."""
    words = []
    for token_id in ids:
        marker = thinking.text(token_id) if thinking is not None else None
        if marker is not None:
            if not skip_special_tokens:
                words.append(marker)
        elif token_id >= FIRST_WORD_ID:
            words.append(_WORDS[token_id % len(_WORDS)])
        elif not skip_special_tokens:
            words.append(_special_text(token_id))
    return " ".join(words)


# The sampling settings that reshape a real model's distribution, at the values that leave it as
# it is. A value other than these changes the toy model's answer too, so a server that applies a
# default the client did not ask for (vLLM's generation_config) gives another answer than the
# client computes, and tests see it.
NEUTRAL = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
}


def _shaping(params: Mapping[str, Any]) -> str:
    out = []
    for key, neutral in NEUTRAL.items():
        value = params.get(key)
        if key == "top_k" and value is not None and value <= 0:
            value = None  # 0 and -1 both mean "off" (vLLM and SGLang)
        if value is not None and float(value) != neutral:
            out.append(f"{key}={float(value)!r}")
    return ",".join(out)


def _stream_seed(input_ids: Sequence[int], sampling_seed: int | None, shaping: str = "") -> int:
    """Hash the prompt (and seed) once; a Random seeded with it then yields every position cheaply."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(b"genq-sim-v1|")
    digest.update(",".join(map(str, input_ids)).encode())
    if sampling_seed is not None:
        digest.update(b"|seed=%d" % int(sampling_seed))
    if shaping:
        digest.update(b"|" + shaping.encode())
    return int.from_bytes(digest.digest(), "little")


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (str, int)):
        return [value]
    return list(value)


def _trimmed_text(
    output_ids: list[int],
    matched: int | str | None,
    params: Mapping[str, Any],
    text_so_far: str | None,
    thinking: Thinking | None,
) -> str:
    """SGLang's trim: a matched stop token or string leaves the text unless no_stop_trim is set."""
    skip_special = bool(params.get("skip_special_tokens", True))
    no_stop_trim = bool(params.get("no_stop_trim", False))
    if isinstance(matched, str):
        text = text_so_far if text_so_far is not None else detokenize(output_ids, skip_special, thinking)
        if not no_stop_trim:
            pos = text.find(matched)
            text = text[:pos] if pos != -1 else text
        return text
    if isinstance(matched, int) and not no_stop_trim:
        return detokenize(output_ids[:-1], skip_special, thinking)
    return detokenize(output_ids, skip_special, thinking)


class _Autoregressive:
    """Each token a function of every id before it (prompt and output alike), as a real model's
    greedy decode is: a prompt extended by the first k output tokens continues into the same
    remaining tokens, so an output made in pieces equals the one-shot output exactly. Lengths are
    geometric (EOS with probability 1 / the middle of [min_len, max_len] at each token): where the
    prompt ends is not known to a model that sees only ids."""

    def __init__(self, input_ids: Sequence[int], seed: int, eos_every: int) -> None:
        self.state = seed.to_bytes(16, "little")
        self.eos_every = eos_every
        for token in input_ids:
            self.push(token)

    def push(self, token: int) -> None:
        self.state = hashlib.blake2b(self.state + token.to_bytes(8, "little"), digest_size=16).digest()

    def eos(self) -> bool:
        return int.from_bytes(self.state[8:], "little") % self.eos_every == 0

    def closes_thought(self) -> bool:
        """A third of the way to the expected end, on average: the thought closes here."""
        return int.from_bytes(self.state[4:12], "little") % max(1, self.eos_every // 3) == 0

    def randrange(self, low: int, high: int) -> int:
        return low + int.from_bytes(self.state[:8], "little") % (high - low)


def generate(
    input_ids: Sequence[int],
    sampling_params: Mapping[str, Any] | None = None,
    *,
    min_len: int = DEFAULT_MIN_LEN,
    max_len: int = DEFAULT_MAX_LEN,
    autoregressive: bool = False,
    thinking: Thinking | None = None,
) -> Generation:
    """Generate the deterministic answer to input_ids.

    The "natural" length (EOS included) is drawn in [min_len, max_len] from the prompt and
    sampling_seed. Within max_new_tokens the output ends with EOS_TOKEN_ID (kept in output_ids, as
    SGLang does) and finish_reason is {"type": "stop", "matched": 2}; otherwise it is cut at
    max_new_tokens with {"type": "length", "length": n}. stop_token_ids, stop strings, ignore_eos,
    min_new_tokens, no_stop_trim and skip_special_tokens act as in SGLang. A max_new_tokens of None
    means the SGLang default (128); the server resolves it against the context before calling.
    Token i depends only on (prompt, seed, i), so a shorter limit yields a prefix of a longer one.
    ``autoregressive``: token i depends on every id before it (:class:`_Autoregressive`); greedy
    (temperature 0) ignores the seed there, as a real engine's argmax does. ``thinking``: a
    prompt that leaves a thought open gets it closed partway (:class:`Thinking`), at a third of
    the natural length (autoregressive: where the state says, so pieces still equal one shot).
    """
    params = sampling_params or {}
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    limit = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    limit = DEFAULT_MAX_NEW_TOKENS if limit is None else int(limit)
    min_new = int(params.get("min_new_tokens") or 0)
    ignore_eos = bool(params.get("ignore_eos", False))
    stop_ids = {int(t) for t in _as_list(params.get("stop_token_ids")) if t is not None}
    stop_strs = [s for s in _as_list(params.get("stop")) if s]

    rng: random.Random | _Autoregressive
    if autoregressive:
        greedy = params.get("temperature") is not None and float(params["temperature"]) == 0.0
        seed = None if greedy else params.get("sampling_seed")
        rng = _Autoregressive(input_ids, _stream_seed((), seed, _shaping(params)), (min_len + max_len) // 2)
        eos_pos = -1
    else:
        rng = random.Random(_stream_seed(input_ids, params.get("sampling_seed"), _shaping(params)))
        eos_pos = max(rng.randint(min_len, max_len) - 1, min_new)
    thinking_open = thinking is not None and thinking.opened(input_ids)
    close_at = max(1, eos_pos // 3)
    output_ids: list[int] = []
    text = "" if stop_strs else None  # built only when stop strings must be matched
    max_stop_len = max(map(len, stop_strs), default=0)
    matched: int | str | None = None
    for pos in range(limit):
        ends = rng.eos() and pos >= min_new if isinstance(rng, _Autoregressive) else pos == eos_pos
        if ends and not ignore_eos:
            output_ids.append(EOS_TOKEN_ID)
            matched = EOS_TOKEN_ID
            break
        token = rng.randrange(FIRST_WORD_ID, VOCAB_SIZE)
        if thinking_open and (rng.closes_thought() if isinstance(rng, _Autoregressive) else pos == close_at):
            token, thinking_open = thinking.end_id, False  # type: ignore[union-attr]
        output_ids.append(token)
        if isinstance(rng, _Autoregressive):
            rng.push(token)
        if text is not None:
            piece = detokenize([token], bool(params.get("skip_special_tokens", True)), thinking)
            if piece:
                text = f"{text} {piece}" if text else piece
        if pos < min_new:
            continue
        if token in stop_ids:
            matched = token
            break
        if text is not None:
            tail = text[-(len(piece) + max_stop_len + 1) :]
            hit = next((s for s in stop_strs if s in tail), None)
            if hit is not None:
                matched = hit
                break
    if matched is None:
        finish_reason: dict[str, Any] = {"type": "length", "length": limit}
    else:
        finish_reason = {"type": "stop", "matched": matched}
    final_text = _trimmed_text(
        output_ids, matched, params, text if isinstance(matched, str) else None, thinking
    )
    return Generation(output_ids, final_text, finish_reason, len(output_ids))


# Chat rendering of the simulated chat APIs: each turn is its role's special id, the content's
# words, and an end id; the prompt ends with the assistant's role id (the generation prompt).
ROLE_IDS = {"system": 10, "user": 11, "assistant": 12, "tool": 13}
END_OF_TURN_ID = 14


def render_chat(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The prompt ids of a conversation, as the simulated server's chat template renders it."""
    ids: list[int] = []
    for message in messages:
        ids.append(ROLE_IDS.get(str(message.get("role")), ROLE_IDS["user"]))
        ids.extend(tokenize(str(message.get("content") or "")))
        ids.append(END_OF_TURN_ID)
    ids.append(ROLE_IDS["assistant"])
    return ids


def wild(token: list, top: list[list[tuple[int, float]]]) -> None:
    """What a server can send beside ordinary logprobs (the fault wild_logprobs): the first token's
    own is null, the first top value of the first token 1e6 and the last one of the last -1e6."""
    if token:
        token[0] = None
    if top and top[0]:
        top[0][0] = (top[0][0][0], 1e6)
        top[-1][-1] = (top[-1][-1][0], -1e6)


def logprobs(
    output_ids: Sequence[int], k: int, offset: int = 0
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Made-up but deterministic log-probabilities of an answer: each token's own, and the top ``k``
    (id, logprob) pairs at its position, best first, the sampled token among them. ``offset``: the
    position of the first output token (the autoregressive model's input length), so an output
    continued from its first tokens has the logprobs one request would have given."""
    token: list[float] = []
    top: list[list[tuple[int, float]]] = []
    for pos, chosen in enumerate(output_ids, start=offset):
        rng = random.Random(chosen * 1_000_003 + pos)
        mine = -rng.random() * 2
        ids: list[int] = []
        while len(ids) < k - 1:  # distinct alternatives, the sampled token not among them
            other = rng.randrange(FIRST_WORD_ID, VOCAB_SIZE)
            if other != chosen and other not in ids:
                ids.append(other)
        others = [(i, mine - rng.random() * 3) for i in ids]
        token.append(mine)
        top.append(sorted([(chosen, mine), *others], key=lambda pair: -pair[1])[:k] if k else [])
    return token, top
