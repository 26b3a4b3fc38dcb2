"""Stand-in tokenizers for the simulator: every layout users meet, built offline from a few
sentences (nothing downloaded, no model files committed), each with a Kimi-K2.5-style chat
template (a ``thinking`` switch, tools, tool turns). `genq sim-tokenizer LAYOUT FOLDER` makes one
(docs/recipes.md's job B); the tests make every layout:

- ``fast``: ``tokenizer.json`` (the Rust tokenizers library), template in tokenizer_config.json;
- ``tiktoken``: Kimi-K2's layout: a tiktoken rank file ``tiktoken.model`` and the tokenizer as code
  (``tokenization_kimi.py``, a PreTrainedTokenizer named by ``auto_map``), so transformers loads it
  only with ``trust_remote_code=True`` (../shared/FACTS.md, "Tokenizers shipped as code");
- ``sentencepiece``: a SentencePiece ``tokenizer.model`` (Llama-2/Mistral era, LlamaTokenizer).

``template_file`` puts the template in ``chat_template.jinja`` beside tokenizer_config.json instead
(newer transformers save it there).
"""

from __future__ import annotations

import base64
import json
import re
from collections import Counter
from pathlib import Path

import click

LAYOUTS = ("fast", "tiktoken", "sentencepiece")
# What the stand-ins learn their merges from (the dataset tests' tokenizer too), and one of tool use.
SENTENCES = [
    "You are a helpful assistant.",
    "What is the capital of France? Paris is the capital of France.",
    "Write a haiku about the sea. The sea is wide and deep and blue.",
    "Explain recursion in one sentence. A function that calls itself.",
    "hello world, how are you today? I am fine, thank you.",
]
CORPUS = [*SENTENCES, "The weather in Paris is sunny. Call get_weather with the city."]
# Kimi-K2's special tokens, in its order, right after the base ranks; <think> and </think> follow.
KIMI_SPECIAL = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>"]
KIMI_SPECIAL += ["<|im_middle|>"]
THINK = ["<think>", "</think>"]
TOOL_MARKUP = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>"]
TOOL_MARKUP += ["<|tool_call_argument_begin|>", "<|tool_call_end|>"]
# The markup of Kimi-K2.5's template, reduced: roles between <|im_*|> and <|im_middle|>, a thinking
# switch (the generation prompt opens <think>, or closes an empty one when thinking is off; history
# turns keep an empty <think></think>), tools declared in a system turn, tool calls in a section of
# their own, tool results as their own turn. Unknown roles and image parts are refused by raising.
TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{%- endif -%}"
    "{%- if m['content'] is not string and m['content'] is not none -%}"
    "{%- for part in m['content'] -%}{%- if part['type'] != 'text' -%}"
    "{{ raise_exception('text parts only') }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
    "{%- if m['role'] == 'assistant' -%}<think>{{ m.get('reasoning_content') or '' }}</think>{%- endif -%}"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- elif m['content'] is not none -%}{%- for part in m['content'] -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for call in m['tool_calls'] -%}<|tool_call_begin|>{{ call['function']['name'] }}"
    "<|tool_call_argument_begin|>{{ call['function']['arguments'] if call['function']['arguments'] "
    "is string else call['function']['arguments'] | tojson }}<|tool_call_end|>{%- endfor -%}"
    "<|tool_calls_section_end|>"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)
# Kimi-K2's pattern (tokenization_kimi.py pat_str), its CJK class left out.
PAT_STR = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# The tokenizer as code, as Kimi ships it: a PreTrainedTokenizer over tiktoken, named by auto_map.
KIMI_CODE = '''"""A TikToken tokenizer shaped as Kimi-K2's tokenization_kimi.py (by genq sim-tokenizer)."""

from typing import Any

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer


def bytes_to_unicode():
    """GPT-2's printable stand-in for each byte (as tokenization_kimi.py spells its tokens)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
    bs += list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]
    pat_str = PAT_STR

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None, pad_token=None,
                 added_tokens_decoder=None, **kwargs: Any):
        ranks = load_tiktoken_bpe(vocab_file)
        self.special = {str(t.content if hasattr(t, "content") else t["content"]): int(i)
                        for i, t in (added_tokens_decoder or {}).items()}
        self.model = tiktoken.Encoding(name="kimi-test", pat_str=self.pat_str, mergeable_ranks=ranks,
                                       special_tokens=self.special)
        self.n_words = len(ranks) + len(self.special)
        b2u = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in b2u.items()}
        self.decoder = {rank: "".join(b2u[b] for b in token) for token, rank in ranks.items()}
        self.encoder = {v: k for k, v in self.decoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.n_words

    def get_vocab(self):
        return {**self.encoder, **self.special}

    def _tokenize(self, text, **kwargs):
        return [self.decoder[t] for t in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.special.get(token))

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        text = "".join(tokens)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


def build(layout: str, folder: Path, template_file: bool = False) -> Path:
    """A tokenizer of ``layout`` saved in ``folder`` (made), loadable offline by AutoTokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    {"fast": _fast, "tiktoken": _tiktoken, "sentencepiece": _sentencepiece}[layout](folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    if template_file:
        (folder / "chat_template.jinja").write_text(TEMPLATE)
    else:
        config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    return folder


def _fast(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AddedToken, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=KIMI_SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token="<|im_end|>")
    fast.add_tokens([AddedToken(t, special=True, normalized=False) for t in TOOL_MARKUP])
    fast.add_tokens([AddedToken(THINK[0], special=False, normalized=False)])
    fast.add_tokens([AddedToken(THINK[1], special=True, normalized=False)])  # special in Kimi-K2.5
    fast.save_pretrained(folder)


def _ranks(merges: int = 200) -> dict[bytes, int]:
    """A byte-level BPE learned from CORPUS: every byte, then each merge in the order learned (a
    token's rank is its merge's priority, as tiktoken reads it)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in w.encode()] for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", " ".join(CORPUS))]
    for _ in range(merges):
        pairs = Counter(pair for w in words for pair in zip(w, w[1:], strict=False))
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks[a + b] = len(ranks)
        merged = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged.append(out)
        words = merged
    return ranks


def _tiktoken(folder: Path) -> None:
    ranks = _ranks()
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in ranks.items()]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    code = KIMI_CODE.replace("pat_str = PAT_STR", f"pat_str = {PAT_STR!r}")
    (folder / "tokenization_kimi.py").write_text(code)
    specials = KIMI_SPECIAL + TOOL_MARKUP + THINK
    added = {
        str(len(ranks) + i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token != THINK[0],
        }
        for i, token in enumerate(specials)
    }
    config = {
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": None,
        "unk_token": None,
        "added_tokens_decoder": added,
        "model_max_length": 4096,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _sentencepiece(folder: Path) -> None:
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        user_defined_symbols=KIMI_SPECIAL[2:] + TOOL_MARKUP + THINK,
        minloglevel=2,
    )
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
        "model_max_length": 4096,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


@click.command("sim-tokenizer")
@click.argument("layout", type=click.Choice(LAYOUTS))
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
def sim_tokenizer(layout: str, folder: Path) -> None:
    """Make a stand-in tokenizer in FOLDER, offline in a second: tiktoken is Kimi-K2.5's layout (its
    tokenizer as code, so loading it needs --trust-remote-code), fast a tokenizer.json,
    sentencepiece a tokenizer.model; each with a Kimi-K2.5-style chat template (<think> opened by
    the generation prompt, </think> a special token). For trying genq with the simulator; on a
    cluster, give the model's own tokenizer."""
    click.echo(build(layout, folder, template_file=True))
    ids = think_ids(folder)
    if ids is not None:
        pair = f"{ids[0]},{ids[1]}"
        click.echo(
            f"<think> is id {ids[0]}, </think> id {ids[1]}: the simulator closes its thoughts with them "
            f"given --think-ids {pair} (GENQ_SIM_THINK_IDS={pair} for genq run --simulate)"
        )


def think_ids(folder: Path) -> tuple[int, int] | None:
    """The ids of <think> and </think> in a stand-in saved in ``folder``, from its own files (the
    sentencepiece layout's are inside its model: None)."""
    found: dict[str, int] = {}
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for index, token in (config.get("added_tokens_decoder") or {}).items():
        found[token["content"]] = int(index)
    if (folder / "tokenizer.json").is_file():
        for token in json.loads((folder / "tokenizer.json").read_text()).get("added_tokens", []):
            found[token["content"]] = int(token["id"])
    return (found[THINK[0]], found[THINK[1]]) if all(t in found for t in THINK) else None
