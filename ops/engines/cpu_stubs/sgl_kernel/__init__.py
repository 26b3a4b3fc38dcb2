"""Test-only stand-in for ``sgl_kernel`` so the real SGLang 0.5.23 serves a tiny llama on a CPU.

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports CPU ops from ``sgl_kernel`` when these
modules load, all at start-up, but PyPI's ``sglang-kernel`` wheel is CUDA-only:

    sglang/srt/mem_cache/allocation.py:46             assign_req_to_token_pool_cpu (called at :746)
    sglang/kernels/ops/kvcache/cache_move.py:10       copy_all_layer_kv_cache_cpu
    sglang/kernels/ops/speculative/eagle.py:10        fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu
    sglang/kernels/ops/speculative/cache_locs.py:28   assign_draft_cache_locs_contiguous_cpu,
                                                      assign_extend_cache_locs_cpu
    sglang/kernels/ops/speculative/spec_tree.py:40    build_tree_kernel_efficient_cpu, verify_tree_greedy_cpu
    sglang/kernels/ops/speculative/multi_layer_eagle.py:25   rotate_input_ids_cpu (multi-layer EAGLE only)

Put ``ops/engines/cpu_stubs`` first on ``PYTHONPATH``. Serving a llama calls only
``assign_req_to_token_pool_cpu``, written here in plain torch. Any other ``*_cpu`` name imports as a
function that raises NotImplementedError when called; any other name raises AttributeError, as a
missing attribute does. (The ``torch.ops.sgl_kernel.*`` ops that some other models use are not
provided: SGLang logs "Ignore import error when loading sglang.srt.models.qwen3_5 ..." and goes on.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__version__ = "0.0.0+genq.cpu.stub"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Copy each request's slice of ``out_cache_loc`` into ``req_to_token[r, start:end]``.

    Same as the Triton kernel ``assign_req_to_token_pool`` in sglang/srt/mem_cache/allocation.py:
    request ``i`` owns the next ``end[i] - start[i]`` entries of ``out_cache_loc``.
    """
    del pool_len  # the row length of req_to_token; torch indexing needs no pointer arithmetic
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _unimplemented(name: str) -> Callable[..., Any]:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name} is not in genq's CPU stand-in (ops/engines/cpu_stubs)")

    op.__name__ = name
    return op


def __getattr__(name: str) -> Callable[..., Any]:
    if name.endswith("_cpu"):
        return _unimplemented(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
