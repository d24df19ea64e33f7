"""Plain-PyTorch sparse (selected-token) GQA attention with mergeable partial results.

Each query row attends only to the cache rows listed for it (the QSA indexer's selection, or a
shard of it under decode-context parallelism). Outputs are fp32 with a base-2 log-sum-exp so that
partials over disjoint token shards merge exactly with :func:`merge_attention_partials`.
A row with nothing selected yields ``out = 0`` and ``lse = -inf`` (never NaN).
"""

from __future__ import annotations

import math

import torch

from qsaserve.quant.fp8 import load_rows

__all__ = ["sparse_attention_reference", "sparse_attention_paged_reference", "merge_attention_partials"]

_LOG2E = 1.0 / math.log(2.0)


def sparse_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_indices: torch.Tensor,
    scale: float | None = None,
    query_block: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over its selected cache rows.

    ``q`` ``[Tq, Hq, D]``; ``k_cache`` ``[N, Hkv, D]``, ``v_cache`` ``[N, Hkv, Dv]`` (any slot
    layout: ``token_indices`` are row ids into them); ``token_indices`` ``[Tq, M]`` int, ``-1`` =
    unused. ``Hq % Hkv == 0``; query head ``h`` reads KV head ``h // (Hq // Hkv)``.
    ``scale`` defaults to ``D ** -0.5``.

    Returns ``out`` ``[Tq, Hq, Dv]`` fp32 and ``lse`` ``[Tq, Hq]`` fp32 in base 2
    (``log2 sum_j exp(s_j)`` with ``s_j = scale * q.k_j``). Queries are processed
    ``query_block`` at a time to bound the gathered K/V copy.
    """
    Tq, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    if Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    scale = D**-0.5 if scale is None else scale
    if Tq > query_block:
        parts = [
            sparse_attention_reference(q[i: i + query_block], k_cache, v_cache, token_indices[i: i + query_block],
                                       scale, query_block)
            for i in range(0, Tq, query_block)
        ]
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])
    valid = token_indices >= 0
    rows = token_indices.clamp_min(0).long()
    return _attend(q, k_cache[rows].float(), v_cache[rows].float(), valid, scale)


def sparse_attention_paged_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_positions: torch.Tensor,
    scale: float | None = None,
    seq_ids: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    query_block: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same attention read straight from the paged cache (reference of the Triton kernel).

    ``kv_cache`` ``[2, num_blocks, page, Hkv, D]`` (FP8 E4M3 pages need ``k_scale``/``v_scale``);
    ``token_positions`` ``[Tq, M]`` positions in the row's sequence (``-1`` = unused), found at
    ``block_tables[seq, p // page] * page + p % page``; ``seq_ids`` ``[Tq]`` maps rows to block
    table rows (default: row t is sequence t). Device tensors only: no host syncs. Queries are
    processed ``query_block`` at a time to bound the gathered K/V copy (a prefill chunk's rows)."""
    if q.shape[0] > query_block:
        parts = [
            sparse_attention_paged_reference(
                q[i: i + query_block], kv_cache, block_tables if seq_ids is not None else block_tables[i: i + query_block],
                token_positions[i: i + query_block], scale, None if seq_ids is None else seq_ids[i: i + query_block],
                k_scale, v_scale, query_block)
            for i in range(0, q.shape[0], query_block)
        ]
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])
    page = kv_cache.shape[2]
    tables = block_tables.long() if seq_ids is None else block_tables.long()[seq_ids.long()]
    valid = token_positions >= 0
    pos = token_positions.long().clamp_min(0)
    slots = tables.gather(1, pos // page) * page + pos % page
    flat = kv_cache.flatten(1, 2)  # [2, slots, Hkv, D]
    k = load_rows(flat[0][slots], k_scale)
    v = load_rows(flat[1][slots], v_scale)
    return _attend(q, k, v, valid, q.shape[-1] ** -0.5 if scale is None else scale)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float):
    """q [Tq, Hq, D], gathered fp32 k/v [Tq, M, Hkv, D], valid [Tq, M] -> (out, base-2 lse)."""
    Hq, Hkv = q.shape[1], k.shape[2]
    # Zero unselected rows so garbage (e.g. NaN in null slots) cannot leak via 0 * NaN.
    k = k.masked_fill(~valid[..., None, None], 0.0)
    v = v.masked_fill(~valid[..., None, None], 0.0)
    group = Hq // Hkv
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("thd,tmhd->thm", q.float(), k) * scale  # [Tq, Hq, M]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe)  # exp(-inf) = 0 for unselected slots
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("thm,tmhd->thd", p, v) / denom.clamp_min(torch.finfo(torch.float32).tiny)
    lse = (m_safe + torch.log(denom)).squeeze(-1) * _LOG2E  # log(0) = -inf when nothing selected
    return out, lse


def merge_attention_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attentions over disjoint token sets.

    ``outs`` ``[S, ..., Dv]`` and base-2 ``lses`` ``[S, ...]`` (a sequence of tensors is stacked).
    Shards with ``lse = -inf`` contribute nothing; if every shard is empty the result is
    ``out = 0``, ``lse = -inf``. Returns fp32 ``(out, lse)``.
    """
    if not isinstance(outs, torch.Tensor):
        outs = torch.stack(list(outs))
    if not isinstance(lses, torch.Tensor):
        lses = torch.stack(list(lses))
    outs, lses = outs.float(), lses.float()
    m = lses.amax(dim=0, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp2(lses - m_safe)  # 0 for empty shards
    total = w.sum(dim=0)
    # Zero the outputs of empty shards explicitly: their weight is 0 but 0 * NaN would survive.
    contrib = torch.where((w > 0)[..., None], outs, torch.zeros_like(outs)) * w[..., None]
    out = contrib.sum(dim=0) / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    lse = m_safe.squeeze(0) + torch.log2(total)
    return out, lse
