# Requires: torch, transformers, tokenizers, safetensors (the engine venvs of ops/engines/ have them).
"""Write a tiny random-weight Hugging Face llama that the real SGLang and vLLM serve on a CPU.

    PY ops/engines/tiny_model.py OUTDIR [--seed N]

OUTDIR gets ``config.json``, ``model.safetensors``, ``generation_config.json`` and a byte-level BPE
tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with a ChatML chat template), so engines load
it like any model folder and genq's ``--tokenizer`` and ``--turns all`` run on it.

The shape is fixed by what both engines accept on the CPU: vLLM's CPU attention refuses a head
dimension of 16, so hidden 128 with 2 heads (head_dim 64). Weights are drawn wider than transformers'
default (std 0.02 makes every logit nearly equal, and greedy decoding then flips on rounding noise
between a batched and a single forward pass); with std 0.25 the top two logits stand well apart.
Everything is seeded: the same seed writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB = 1024
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOS = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = """
the of and to in is it you that he was for on are with as his they be at one have this from or had
by not word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long make thing
see him two has look more day could go come did number sound no most people my over know water than
call first who may down side been now find any new work part take get place made live where after
back little only round man year came show every good me give our under name very through just form
sentence great think say help low line differ turn cause much mean before move right boy old too
same tell does set three want air well also play small end put home read hand port large spell add
even land here must big high such follow act why ask men change went light kind off need house
picture try us again animal point mother world near build self earth father head stand own page
token model server prompt queue request response hello python llama data train worker result
"""


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic sentences of the word list, with capitals, digits and punctuation."""
    import random

    rng = random.Random(seed)
    words = WORDS.split()
    out = []
    for _ in range(lines):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        out.append(sentence.capitalize() + rng.choice([".", "?", "!", ",", f" {rng.randint(0, 999)}."]))
    return out


def write_tokenizer(folder: Path, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token="<|endoftext|>", unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    # transformers 5 writes the template to chat_template.jinja and names its own tokenizer class;
    # older readers (an engine venv's transformers may be one) know neither.
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2))


def write_weights(folder: Path, seed: int, eos_id: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.25,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=0,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=0, do_sample=False)
    model.save_pretrained(folder, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write the model into")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(args.out, args.seed)
    eos_id = json.loads((args.out / "tokenizer.json").read_text())["model"]["vocab"].get(EOS)
    if eos_id is None:  # added tokens live outside the BPE vocabulary
        eos_id = SPECIALS.index(EOS)
    write_weights(args.out, args.seed, eos_id)
    print(args.out)


if __name__ == "__main__":
    main()
