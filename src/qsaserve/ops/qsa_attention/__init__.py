"""Sparse (selected-token) attention over paged K/V with mergeable base-2 LSE partials.

`sparse_attention_paged` runs the Triton kernel (triton_sparse.py) where
`ops.dispatch.use_triton` says so, the paged torch reference (reference.py) elsewhere."""
from __future__ import annotations

import torch

from qsaserve.ops import dcp_merge
from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.qsa_attention.reference import (merge_attention_partials, sparse_attention_paged_reference,
                                                  sparse_attention_reference)

try:  # CPU-only installs keep the references
    from qsaserve.ops.qsa_attention import triton_sparse
except ImportError:
    triton_sparse = None


def sparse_attention_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_positions: torch.Tensor,
    scale: float | None = None,
    seq_ids: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    run: int = 1,
    pack: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of each query row over its selected tokens, read through the block tables.

    q [T, Hq, D]; kv_cache [2, num_blocks, page, Hkv, D] (FP8 E4M3 pages with 0-d fp32 k_scale /
    v_scale); block_tables [B, max_blocks]; token_positions [T, M] (positions in the row's
    sequence, -1 = none); seq_ids [T] (row -> block table row; default row t is sequence t).
    Returns fp32 out [T, Hq, D] and base-2 lse [T, Hq]; a row with nothing selected gets out 0 and
    lse -inf. pack = D > 0: (packed [D, T, Hq / D, D + 1], None) instead, as
    `dcp_merge.pack_partials(out, lse, D)` lays it out. run: the kernel's promise that every `run`
    aligned columns hold one aligned group of `run` tokens (the QSA selection with run = r)."""
    if use_triton(q):
        return triton_sparse.sparse_attention_paged_triton(q, kv_cache, block_tables, token_positions, scale, seq_ids,
                                                           k_scale, v_scale, run=run, pack=pack)
    out, lse = sparse_attention_paged_reference(q, kv_cache, block_tables, token_positions, scale, seq_ids,
                                                k_scale, v_scale)
    return (dcp_merge.pack_partials(out, lse, pack), None) if pack else (out, lse)


def warm_up(kv_cache: torch.Tensor, num_q_heads: int, q_dtype: torch.dtype, width: int, *, k_scale=None,
            v_scale=None, run: int = 1, pack: int = 0) -> int:
    """Builds the sparse kernel's variants a step over kv_cache (num_q_heads query heads of
    q_dtype, selections `width` wide) can launch (triton_sparse.warm_up); returns the launches
    made, 0 where the reference runs."""
    if not use_triton(kv_cache):
        return 0
    return triton_sparse.warm_up(kv_cache, num_q_heads, q_dtype, width, k_scale=k_scale, v_scale=v_scale, run=run,
                                 pack=pack)


__all__ = ["merge_attention_partials", "sparse_attention_paged", "sparse_attention_paged_reference",
           "sparse_attention_reference", "warm_up"]
