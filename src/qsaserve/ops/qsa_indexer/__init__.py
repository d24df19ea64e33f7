"""QSA token indexer: block pooling, scoring and selection.

Dispatched (`ops.dispatch.use_triton`), over pooled block keys paged beside the KV cache:
* `pool_completed_groups`: a decode step's raw index keys join their open groups; completed groups
  are pooled into block keys (triton_pool.py; its kernel needs a power-of-two ratio).
* `select_decode`: one query per sequence -> its selected token positions (score, top-k, build:
  triton_score.py), localized to this rank's shard under decode context parallelism.
* `select_prefill`: one sequence's chunk of queries -> their selections.
* `select_prefill_step`: every sequence's queries of a prefill step at once (one scoring launch,
  one top-k, one build on CUDA; the per-sequence `select_prefill` elsewhere).
`pool_chunk_groups` (prefill pooling) has no kernel. The references are in paged.py (paged caches)
and reference.py (the transformers-shaped math)."""
from __future__ import annotations

import torch

from qsaserve.ops.device import aligned16
from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.qsa_indexer import paged
from qsaserve.ops.qsa_indexer.paged import pool_chunk_groups
from qsaserve.ops.qsa_indexer.reference import (
    apply_partial_rope,
    index_scores,
    indexer_project,
    max_selected_tokens,
    pool_block_keys,
    qsa_select_reference,
    rms_norm_one_centred,
    rope_cos_sin,
    rope_inv_freq,
    select_tokens,
    select_tokens_bruteforce,
    visible_block_count,
)

try:  # CPU-only installs keep the references
    from qsaserve.ops.qsa_indexer import triton_pool, triton_score
except ImportError:
    triton_pool = triton_score = None


def pool_completed_groups(tails: torch.Tensor, slots: torch.Tensor, raw: torch.Tensor, block_key_cache: torch.Tensor,
                          block_tables: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                          k_layernorm_weight: torch.Tensor, inv_freq: torch.Tensor, ratio: int, eps: float) -> None:
    """Decode rows' raw keys raw [B, Di] at positions [B] join their open groups in tails
    [num_slots, r, Di] (row slots [B]); a `valid` [B] row completing a group pools it into its
    block key (block_key_cache [num_blocks, page // r, Di], through block_tables [B, max_blocks]).
    In place; shapes never depend on the data (CUDA-graph safe)."""
    if use_triton(raw) and not ratio & (ratio - 1):  # a mixed step passes row slices: aligned for the kernel
        triton_pool.pool_completed_groups_triton(tails, aligned16(slots), aligned16(raw), block_key_cache,
                                                 aligned16(block_tables), aligned16(positions), aligned16(valid),
                                                 k_layernorm_weight, inv_freq, ratio, eps)
        return
    paged.pool_completed_groups(tails, slots, raw, block_key_cache, block_tables, positions, valid, k_layernorm_weight,
                                inv_freq, ratio, eps)


def select_decode(index_q: torch.Tensor, block_key_cache: torch.Tensor, block_tables: torch.Tensor,
                  positions: torch.Tensor, ratio: int, budget: int, dcp=None) -> torch.Tensor:
    """One query per sequence, index_q [B, Hi, Di] at positions [B] (-1: padding row) -> token
    positions [B, budget + r - 1] (-1 padded): the top budget // r visible groups, each group's
    tokens ascending, then the open tail. dcp: a `parallel.dcp.DcpGeometry`; when enabled, the
    positions come localized to this rank's rows (`dcp.localize`).

    Ties follow `select_prefill`'s rule for the device, so a row selects the same groups whether it
    decodes alone or is one of a multi-row chunk (a verify step's rows, a decode row of a mixed
    step, a preempted sequence's recompute): on CUDA the lower group first (device tensors only,
    CUDA-graph safe); on CPU transformers' per-query 1-D torch.topk order (a host loop over rows)."""
    local = dcp is not None and dcp.enabled
    if use_triton(index_q) and index_q.is_cuda:
        return triton_score.select_decode_tokens_triton(index_q, block_key_cache, block_tables, positions, ratio,
                                                        budget, dcp=dcp if local else None)
    scores = paged.decode_index_scores(index_q, block_key_cache, block_tables, positions, ratio)
    if index_q.is_cuda:
        selected = paged.select_decode_tokens(scores, positions, ratio, budget)
    else:
        selected = select_tokens(scores, positions, ratio, budget, "torch")[0]
    return dcp.localize(selected) if local else selected


def select_prefill(index_q: torch.Tensor, block_key_cache: torch.Tensor, block_table: torch.Tensor,
                   positions: torch.Tensor, ratio: int, budget: int, num_groups: int) -> torch.Tensor:
    """One sequence's chunk of queries, index_q [Tq, Hi, Di] at ascending positions [Tq], over its
    num_groups complete (pooled) groups through its block_table [max_blocks] -> token positions
    [Tq, budget + r - 1] (-1 padded), in row blocks that bound the temporaries."""
    # Ties: transformers' per-query torch.topk order on CPU, the deterministic lowest index on CUDA.
    tie_break = "lowest_index" if index_q.is_cuda else "torch"
    kernel = use_triton(index_q)
    # One fused select (packed-key scoring, top-k, build) per row block; the "torch" tie order
    # (interpreter runs on CPU) keeps the scoring kernel plus the reference's per-query top-k.
    fused = kernel and tie_break == "lowest_index"
    return paged.select_prefill_tokens(
        index_q, block_key_cache, block_table, positions, ratio, budget, num_groups, tie_break,
        score_fn=triton_score.prefill_index_scores_triton if kernel and not fused else None,
        select_fn=triton_score.select_prefill_rows_triton if fused else None)


def select_prefill_step(index_q: torch.Tensor, block_key_cache: torch.Tensor, block_tables: torch.Tensor,
                        positions: torch.Tensor, ratio: int, budget: int, spans: list[tuple[int, int]],
                        seq_lens: list[int], cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The queries of every sequence of a step, index_q [T, Hi, Di] at positions [T] (sequence s:
    rows spans[s] ascending, seq_lens[s] tokens once the step is written, block_tables[s], device
    boundaries cu_seqlens [S + 1]), all its complete groups pooled -> token positions
    [T, budget + r - 1] (-1 padded), each row as `select_prefill` selects it for its sequence."""
    if use_triton(index_q) and index_q.is_cuda:  # the lowest-index rule: the batched kernels
        return triton_score.select_prefill_step_triton(index_q, block_key_cache, block_tables, positions, cu_seqlens,
                                                       spans, seq_lens, ratio, budget)
    out = torch.empty((index_q.shape[0], budget + ratio - 1), dtype=torch.long, device=index_q.device)
    for s, (a, b) in enumerate(spans):  # transformers' tie order on CPU is per query: sequence by sequence
        out[a:b] = select_prefill(index_q[a:b], block_key_cache, block_tables[s], positions[a:b], ratio, budget,
                                  seq_lens[s] // ratio)
    return out


def warm_up(block_key_cache: torch.Tensor, num_heads: int, ratio: int, budget: int, max_groups: int) -> int:
    """Builds the selection kernels' variants for steps of up to max_groups groups per sequence
    (triton_score.warm_up); returns the launches made, 0 where the references run."""
    if not use_triton(block_key_cache):
        return 0
    return triton_score.warm_up(block_key_cache, num_heads, ratio, budget, max_groups)


__all__ = [
    "apply_partial_rope",
    "index_scores",
    "indexer_project",
    "max_selected_tokens",
    "pool_block_keys",
    "pool_chunk_groups",
    "pool_completed_groups",
    "qsa_select_reference",
    "rms_norm_one_centred",
    "rope_cos_sin",
    "rope_inv_freq",
    "select_decode",
    "select_prefill",
    "select_prefill_step",
    "select_tokens",
    "select_tokens_bruteforce",
    "visible_block_count",
    "warm_up",
]
