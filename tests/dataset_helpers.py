"""Helpers of the dataset tests: a small chat tokenizer built offline, and one pipeline run.

The tokenizer is trained with the `tokenizers` library on a few sentences (byte-level BPE, so any
text encodes) in about a second, wrapped in PreTrainedTokenizerFast and saved, so tests load it
with AutoTokenizer like a real model's, without downloading one.
"""

from __future__ import annotations

from pathlib import Path

from genq.sim.tokenizers import SENTENCES
from tests.helpers import Procs, log_of, read_jsonl

SPECIAL = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
THINK = ["<think>", "</think>"]  # added tokens, not special (as in Qwen3 and DeepSeek-R1)
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}"
    "{% endif %}"
)
CORPUS = SENTENCES  # the stand-in tokenizers' sentences (genq/sim/tokenizers.py)


def build_tokenizer(path: Path) -> Path:
    """Save the tokenizer in ``path`` and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AddedToken, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=TEMPLATE,
    )
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    fast.save_pretrained(path)
    return path


def run_pipeline(procs: Procs, url: str, out: Path, dataset: str, *enqueue_args: str) -> list[dict]:
    """enqueue, a worker and a collector, both in burst mode; returns the dataset's records."""
    res = procs.run("enqueue", *enqueue_args, "--dataset", dataset)
    assert res.returncode == 0, res.stderr
    worker = procs.start("worker", "--server", url, "--burst", "--concurrency", "32")
    assert worker.wait(60) == 0, log_of(worker)
    res = procs.run("collect", "--out", out, "--burst", timeout=60)
    assert res.returncode == 0, res.stderr
    return read_jsonl(out / dataset / "raw_responses.jsonl")
