# Requires: gguf, numpy; for --hf-tokenizer also tokenizers + transformers (jinja2 for its chat template).
"""Write a tiny random-weight llama GGUF for testing llama.cpp's ``llama-server``.

The model is architecturally a real llama (2 layers, hidden 64, 4 query heads,
2 KV heads, SwiGLU FFN, RMSNorm, RoPE) with f32 weights drawn from a fixed seed,
and a SentencePiece-style ("llama"/SPM) vocabulary of 2048 pieces:

    0 <unk>, 1 <s> (BOS), 2 </s> (EOS), 3..258 the byte tokens <0x00>..<0xFF>,
    259.. ordinary pieces ("▁" marks a space) with strictly decreasing scores.

The ordinary pieces are built deterministically (independent of the seed) with
one property: every multi-character piece splits into two vocabulary pieces in
exactly one way. llama.cpp's SPM tokenizer merges the adjacent pair whose
concatenation has the highest score (ties: leftmost); a Hugging Face BPE model
merges the pair with the lowest merge rank (ties: leftmost). With a unique split
per piece and ranks ordered like the scores, the two pick the same merge at
every step, so the exported Hugging Face tokenizer (``--hf-tokenizer``) gives the
same ids as llama-server's ``/tokenize``.

Usage::

    python ops/llamacpp/tiny_model.py OUT.gguf [--seed N] [--hf-tokenizer DIR]

or ``from tiny_model import write_model; write_model("model.gguf", seed=0)``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

# --- model shape -------------------------------------------------------------
N_VOCAB = 2048
N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 2  # GQA like most current llamas, so the server's KV paths get exercised
N_FF = 128
N_CTX_TRAIN = 2048
RMS_EPS = 1e-5
ROPE_BASE = 10000.0

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
N_BYTE = 256
FIRST_PIECE_ID = 3 + N_BYTE  # 259, as in the original llama vocabulary
SPACE = "\u2581"  # "▁", SentencePiece's visible space

# A ChatML-free, llama-2-free template: simple enough that HF (jinja2) and
# llama.cpp (its own jinja engine) render it identically.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# Words the ordinary pieces are grown from, most frequent first (the order sets
# which merges are learnt first, i.e. which pieces get the higher scores).
_WORDS = """
the of and to a in is it you that he was for on are with as i his they be at one have
this from or had by not word but what some we can out other were all there when up use
your how said an each she which do their time if will way about many then them write
would like so these her long make thing see him two has look more day could go come did
number sound no most people my over know water than call first who may down side been
now find any new work part take get place made live where after back little only round
man year came show every good me give our under name very through just form sentence
great think say help low line differ turn cause much mean before move right boy old too
same tell does set three want air well also play small end put home read hand port large
spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn
plant cover food sun four between state keep eye never last let thought city tree cross
farm hard start might story saw far sea draw left late run while press close night real
life few north open seem together next white children begin got walk example ease paper
group always music those both mark often letter until mile river car feet care second
book carry took science eat room friend began idea fish mountain stop once base hear
horse cut sure watch color face wood main enough plain girl usual young ready above ever
red list though feel talk bird soon body dog family direct pose leave song measure door
product black short numeral class wind question happen complete ship area half rock order
fire south problem piece told knew pass since top whole king space heard best hour better
true during hundred five remember step early hold west ground interest reach fast verb
sing listen six table travel less morning ten simple several vowel toward war lay against
pattern slow center love person money serve appear road map rain rule govern pull cold
notice voice unit power town fine certain fly fall lead cry dark machine note wait plan
figure star box noun field rest correct able pound done beauty drive stood contain front
teach week final gave green quick develop ocean warm free minute strong special mind
behind clear tail produce fact street inch multiply nothing course stay wheel full force
blue object decide surface deep moon island foot system busy test record boat common gold
possible plane instead dry wonder laugh thousand ago ran check game shape equate hot miss
brought heat snow tire bring yes distant fill east paint language among token model server
prompt queue request response hello world python llama banana
"""
# Bound pieces (no leading "▁") so that words split into stem + ending.
_SUFFIXES = "ing ed er est ly tion s es ment ness able"
_CAPITALISED = "the i a he she it we they you this that what when where why how hello world"
# A few non-ASCII characters get pieces of their own; all others fall back to bytes.
_EXTRA_CHARS = "\u00e9\u00fc\u00df\u2014\u2019\u2026\u4e2d\u6587"


def _spm_segment(text: str, index: dict[str, int]) -> list[str]:
    """Segment *text* like llama.cpp's SPM tokenizer (best-scoring merge first).

    Scores fall with the id, so "best score" is "lowest id"; ties go leftmost.
    Only used to grow the vocabulary, on single words, so O(n^2) is fine.
    """
    syms = list(text)
    while True:
        best: tuple[int, int] | None = None  # (id of merged piece, position)
        for i in range(len(syms) - 1):
            tid = index.get(syms[i] + syms[i + 1])
            if tid is not None and (best is None or tid < best[0]):
                best = (tid, i)
        if best is None:
            return syms
        i = best[1]
        syms[i : i + 2] = [syms[i] + syms[i + 1]]


def build_vocab(
    n_vocab_total: int = N_VOCAB,
) -> tuple[list[str], list[float], list[int], list[tuple[str, str]]]:
    """Return (tokens, scores, token_types, merges) of the tiny SPM vocabulary: N_VOCAB pieces,
    then control pieces up to ``n_vocab_total``.

    ``merges`` holds, in id order, the single split of every multi-character
    ordinary piece; it is exactly the merge list a HF BPE model needs.
    """
    import gguf  # local import: keeps `build_vocab` usable for the HF export's reader too

    n_vocab = N_VOCAB

    tokens: list[str] = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(N_BYTE)]
    types: list[int] = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * N_BYTE

    index: dict[str, int] = {t: i for i, t in enumerate(tokens)}
    split_of: dict[str, tuple[str, str]] = {}
    # proper prefixes/suffixes of multi-char pieces -> those pieces, to find
    # existing pieces that a new piece would give a second split.
    by_prefix: dict[str, list[str]] = {}
    by_suffix: dict[str, list[str]] = {}

    def add(piece: str, split: tuple[str, str] | None) -> None:
        index[piece] = len(tokens)
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        if split is not None:
            split_of[piece] = split
            for k in range(1, len(piece)):
                by_prefix.setdefault(piece[:k], []).append(piece)
                by_suffix.setdefault(piece[k:], []).append(piece)

    def n_splits(piece: str) -> int:
        return sum(1 for k in range(1, len(piece)) if piece[:k] in index and piece[k:] in index)

    def keeps_splits_unique(new: str) -> bool:
        # Adding `new` must not give an existing piece p a second split p = new + rest / rest + new.
        if any(p[len(new) :] in index for p in by_prefix.get(new, ())):
            return False
        return all(p[: len(p) - len(new)] not in index for p in by_suffix.get(new, ()))

    singles = [SPACE] + [chr(c) for c in range(0x21, 0x7F)] + list(_EXTRA_CHARS)
    for ch in singles:
        add(ch, None)

    words = _WORDS.split()
    units = [SPACE + w for w in words]
    units += [SPACE + w.capitalize() for w in _CAPITALISED.split()]
    units += _SUFFIXES.split()
    units += words  # the same words glued to what precedes them (no space)

    # Grow pieces BPE-style, one unit at a time, merging its leftmost admissible pair.
    for unit in units:
        while len(tokens) < n_vocab:
            seg = _spm_segment(unit, index)
            if len(seg) == 1:
                break
            for a, b in zip(seg, seg[1:], strict=False):
                cand = a + b
                if cand not in index and n_splits(cand) == 1 and keeps_splits_unique(cand):
                    add(cand, (a, b))
                    break
            else:
                break  # no admissible merge left for this unit
        if len(tokens) >= n_vocab:
            break

    # Pad with deterministic two-letter pieces if the word list ran out.
    letters = "abcdefghijklmnopqrstuvwxyz"
    pad = (x + y for x in letters for y in letters)
    while len(tokens) < n_vocab:
        cand = next(pad)
        if cand not in index and n_splits(cand) == 1 and keeps_splits_unique(cand):
            add(cand, (cand[0], cand[1]))

    # A real model's vocabulary size (--n-vocab, for benchmarks: the server's sampling costs grow
    # with it): reserved control pieces past the ordinary ones, as real vocabularies hold them.
    while len(tokens) < n_vocab_total:
        index[f"<unused{len(tokens)}>"] = len(tokens)
        tokens.append(f"<unused{len(tokens)}>")
        types.append(gguf.TokenType.CONTROL)

    # SPM scores: 0 for special/byte tokens, then strictly decreasing with the id.
    scores = [0.0] * FIRST_PIECE_ID + [-float(i) for i in range(len(tokens) - FIRST_PIECE_ID)]
    merges = [split_of[t] for t in tokens[FIRST_PIECE_ID:] if t in split_of]
    return tokens, scores, [int(t) for t in types], merges


def _weights(seed: int, n_vocab: int = N_VOCAB) -> dict[str, np.ndarray]:
    """Random f32 tensors named as llama.cpp's llama loader expects (shape = rows, cols)."""
    rng = np.random.default_rng(seed)
    head_dim = N_EMBD // N_HEAD

    def normal(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    ones = np.ones(N_EMBD, dtype=np.float32)
    t: dict[str, np.ndarray] = {
        "token_embd.weight": normal(n_vocab, N_EMBD, std=1.0),
        "output_norm.weight": ones.copy(),
        # A larger output scale makes the next-token distribution peaked, so greedy
        # decoding is not decided by float noise between near-equal logits.
        "output.weight": normal(n_vocab, N_EMBD, std=0.5),
    }
    for i in range(N_LAYER):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = ones.copy()
        t[p + "attn_q.weight"] = normal(N_HEAD * head_dim, N_EMBD)
        t[p + "attn_k.weight"] = normal(N_HEAD_KV * head_dim, N_EMBD)
        t[p + "attn_v.weight"] = normal(N_HEAD_KV * head_dim, N_EMBD)
        t[p + "attn_output.weight"] = normal(N_EMBD, N_HEAD * head_dim)
        t[p + "ffn_norm.weight"] = ones.copy()
        t[p + "ffn_gate.weight"] = normal(N_FF, N_EMBD)
        t[p + "ffn_up.weight"] = normal(N_FF, N_EMBD)
        t[p + "ffn_down.weight"] = normal(N_EMBD, N_FF)
    return t


def write_model(path: str | Path, seed: int = 0, n_vocab: int = N_VOCAB) -> Path:
    """Write the tiny llama GGUF to *path* and return it."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, scores, types, _ = build_vocab(n_vocab)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"genq-tiny-llama-seed{seed}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)

    w.add_tokenizer_model("llama")  # SPM
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(UNK_ID)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_chat_template(CHAT_TEMPLATE)

    for name, arr in _weights(seed, n_vocab).items():
        w.add_tensor(name, arr)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_hf_tokenizer(out_dir: str | Path) -> Path:
    """Save a Hugging Face fast tokenizer with the GGUF's vocabulary to *out_dir*.

    Mirrors transformers' legacy LlamaConverter: prepend "▁" and turn spaces into
    "▁" (per text segment between special tokens, like llama.cpp's add_space_prefix),
    BPE with byte fallback, BOS added by the post-processor.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    tokens, _, _, merges = build_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    # Specials are matched in the raw text, like /tokenize's default parse_special=true.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", BOS_ID)]
    )

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=N_CTX_TRAIN,
    )
    hf.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    hf.save_pretrained(str(out))
    # transformers 5 records its class as "TokenizersBackend", which 4.x cannot load, and
    # keeps the template only in chat_template.jinja, which older 4.x do not read. The
    # 4.x name (still an alias in 5.x) and an inline template load in both.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="path of the .gguf file to write")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    ap.add_argument("--hf-tokenizer", metavar="DIR", help="also save a matching HF tokenizer to DIR")
    ap.add_argument(
        "--n-vocab",
        type=int,
        default=N_VOCAB,
        help=f"vocabulary size, unused control pieces past the first {N_VOCAB} (benchmarks: a real model's)",
    )
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.n_vocab < N_VOCAB:
        ap.error(f"--n-vocab must be at least {N_VOCAB}")
    print(write_model(args.out, seed=args.seed, n_vocab=args.n_vocab))
    if args.hf_tokenizer:
        print(write_hf_tokenizer(args.hf_tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
