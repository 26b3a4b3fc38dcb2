"""Which SGLang release the simulator imitates, and the API differences between releases.

Read in the wheels 0.4.6, 0.5.1, 0.5.5, 0.5.15, 0.5.20, 0.5.22 and 0.5.23 (``sglang/srt/``);
``sim-server --sglang-version`` picks one so clients can be tested against old servers too.
"""

from __future__ import annotations

from dataclasses import dataclass

KNOWN = ("0.4.6", "0.5.1", "0.5.5", "0.5.15", "0.5.20", "0.5.22", "0.5.23")


def parse(version: str) -> tuple[int, ...]:
    try:
        parts = tuple(int(p) for p in version.split("."))
    except ValueError:
        parts = ()
    if len(parts) != 3:
        raise ValueError(f"SGLang version must look like 0.5.23, got {version!r}")
    return parts


@dataclass(frozen=True)
class Quirks:
    """What differs between releases, as flags the handlers test."""

    version: str

    @property
    def _v(self) -> tuple[int, ...]:
        return parse(self.version)

    @property
    def output_ids(self) -> bool:
        """``output_ids`` in /generate answers (text mode) from 0.5.1 (tokenizer_manager.py)."""
        return self._v >= (0, 5, 1)

    @property
    def output_ids_lead_with_prompt(self) -> bool:
        """0.5.1's detokenizer passed its window: up to 5 prompt tokens lead output_ids."""
        return self._v[:2] == (0, 5) and self._v < (0, 5, 5)

    @property
    def new_info_routes(self) -> bool:
        """/server_info and /model_info exist from 0.5.15; /get_* before (and after, deprecated)."""
        return self._v >= (0, 5, 15)

    @property
    def abort_route(self) -> bool:
        """/abort_request exists from 0.5.1 (404 in 0.4.6)."""
        return self._v >= (0, 5, 1)

    @property
    def seed_field(self) -> bool:
        """SamplingParams has sampling_seed from 0.5.5; before, it is an unexpected keyword (500)."""
        return self._v >= (0, 5, 5)

    @property
    def schema_gate(self) -> bool:
        """0.5.22 checks sampling_params against a schema: unknown key -> 400 {"error": "unknown
        field ..."}; before, SamplingParams(**kwargs) raised a TypeError -> plain-text 500."""
        return self._v >= (0, 5, 22)

    @property
    def duplicate_rid_check(self) -> bool:
        """400 "Duplicate request ID detected" from 0.5.15; before, the old request was overwritten."""
        return self._v >= (0, 5, 15)

    @property
    def total_check_strict(self) -> bool:
        """prompt + max_new_tokens > context is refused from 0.5.15 (>= before)."""
        return self._v >= (0, 5, 15)

    @property
    def error_aborts(self) -> bool:
        """A scheduler abort with a 5xx status is an HTTP error from 0.5.1 (a 200 in 0.4.6)."""
        return self._v >= (0, 5, 1)

    @property
    def nan_check(self) -> bool:
        """A sampled id outside the vocabulary ends as matched "NaN happened" from 0.5.1."""
        return self._v >= (0, 5, 1)
