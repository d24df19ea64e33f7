"""Plain-torch paged attention over one rank's token shard, for decode context parallelism.

Like `reference.paged_attention_reference`, but the pages hold only the tokens this rank owns, so
the causal mask compares global positions (`key_positions`, from parallel/dcp.py) and the result
is a mergeable partial: fp32 output plus base-2 log-sum-exp, out = 0 and lse = -inf for a query
that sees none of this rank's tokens.
"""
from __future__ import annotations

import math

import torch

from qsaserve.ops.fp8 import load_rows

_LOG2E = 1.0 / math.log(2.0)


def paged_attention_partial(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    local_lens: list[int],
    key_positions: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] (sequences concatenated; their queries are the last query_lens[i] of
    seq_lens[i] global positions); kv_cache [2, N, B, Hkv, D] this rank's pages, local row j of
    a sequence at page block_tables[i, j // B]; local_lens[i] rows held for sequence i;
    key_positions [>= max(local_lens)] global position of local row j.
    k_scale / v_scale: the layer's scales when the pages are FP8 E4M3.
    Returns out [T, Hq, D] fp32 and lse [T, Hq] fp32 (base 2)."""
    dev = q.device
    t, hq, d = q.shape
    l_max = max(local_lens)
    if l_max == 0:
        return q.new_zeros((t, hq, d), dtype=torch.float32), q.new_full((t, hq), float("-inf"), dtype=torch.float32)
    num_seqs, n_max = len(query_lens), max(query_lens)
    block_size = kv_cache.shape[2]
    q_lens = torch.tensor(query_lens, device=dev)
    s_lens = torch.tensor(seq_lens, device=dev)
    tables = block_tables[:, : -(-l_max // block_size)].long()
    valid = torch.arange(l_max, device=dev)[None, :] < torch.tensor(local_lens, device=dev)[:, None]  # [B, L]
    # Zero rows past each shard's length, not just mask them: stale pages may hold NaN.
    k = torch.where(valid[:, :, None, None], load_rows(kv_cache[0][tables].flatten(1, 2)[:, :l_max], k_scale), 0.0)
    v = torch.where(valid[:, :, None, None], load_rows(kv_cache[1][tables].flatten(1, 2)[:, :l_max], v_scale), 0.0)
    group = hq // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)

    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=dev), q_lens)
    row_of_token = torch.arange(t, device=dev) - (torch.cumsum(q_lens, 0) - q_lens)[seq_of_token]
    q_pad = q.new_zeros((num_seqs, n_max, hq, d), dtype=torch.float32)
    q_pad[seq_of_token, row_of_token] = q.float()
    q_pos = (s_lens - q_lens)[:, None] + torch.arange(n_max, device=dev)[None, :]  # [B, n]
    mask = valid[:, None, :] & (key_positions[:l_max][None, None, :] <= q_pos[:, :, None])  # [B, n, L]

    s = torch.einsum("bnhd,blhd->bhnl", q_pad, k) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhnl,blhd->bhnd", p, v) / denom.clamp_min(torch.finfo(torch.float32).tiny)
    lse = (m + torch.log(denom)).squeeze(-1) * _LOG2E  # -inf where no key is visible
    return out.transpose(1, 2)[seq_of_token, row_of_token], lse.transpose(1, 2)[seq_of_token, row_of_token]
