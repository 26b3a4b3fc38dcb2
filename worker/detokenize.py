"""The text of an answer whose server made none: SGLang started with ``--skip-tokenizer-init``.

The output ids are decoded with the dataset's own tokenizer (the one enqueue recorded, loaded on
this host as the conversation turns' is: genq/templates.py) the way SGLang's detokenizer makes the
text of a server that runs its tokenizer (managers/detokenizer_manager.py, 0.5.23): the matched stop
token trimmed unless the job asks ``no_stop_trim`` (trim_matched_stop), then one decode with the
job's ``skip_special_tokens`` and ``spaces_between_special_tokens`` (both true by default,
sampling/sampling_params.py). So a record is the same whichever way the server was started.
"""

from __future__ import annotations

from typing import Any


def text_of(tokenizer: Any, output_ids: list[int], matched_stop: Any, sampling_params: dict[str, Any]) -> str:
    """``output_ids`` as the server's own ``text`` would have been."""
    ids = output_ids
    keep_stop = bool(sampling_params.get("no_stop_trim"))
    if type(matched_stop) is int and ids and not keep_stop:
        ids = ids[:-1]  # the stop token is the last id (SGLang: "we can always assume")
    text = tokenizer.decode(
        ids,
        skip_special_tokens=sampling_params.get("skip_special_tokens", True),
        spaces_between_special_tokens=sampling_params.get("spaces_between_special_tokens", True),
    )
    if isinstance(matched_stop, str) and (pos := text.find(matched_stop)) >= 0:
        # A stop string (not asked of a server without its tokenizer, which refuses them).
        text = text[: pos + len(matched_stop)] if keep_stop else text[:pos]
    return text
