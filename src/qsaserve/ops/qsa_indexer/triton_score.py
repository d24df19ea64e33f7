"""Triton QSA indexer scoring for decode: one query per sequence against its pooled block keys.

score[b, g] = sum_h relu(q[b, h] . key[b, g]) / sqrt(Di) for the groups g < (pos_b + 1) // r that
the query sees, -inf for every other column. Block keys are read in place through the block
table (block key cache [num_blocks, block_size // r, Di]), never gathered into a copy. The grid
covers every group the block table can address, so its size comes from tensor shapes only (a
CUDA graph can capture it); tiles past a sequence's visible groups just store -inf.

The plain-torch reference is `paged.decode_index_scores`; selection is `paged.select_decode_tokens`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _score_kernel(
    q_ptr, keys_ptr, bt_ptr, pos_ptr, out_ptr, inv_sqrt_d,
    stride_qb, stride_qh, stride_kb, stride_kr, stride_bt, stride_ob,
    N,
    RATIO: tl.constexpr, GPP: tl.constexpr, H: tl.constexpr, H_POW2: tl.constexpr,
    D: tl.constexpr, D_POW2: tl.constexpr, BLOCK_G: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    g = tile * BLOCK_G + tl.arange(0, BLOCK_G)
    in_range = g < N
    visible_groups = (tl.load(pos_ptr + b).to(tl.int32) + 1) // RATIO  # 0 for padding rows (pos -1)
    visible = g < visible_groups
    out_row = out_ptr + b.to(tl.int64) * stride_ob
    if tile * BLOCK_G >= visible_groups:  # nothing visible in this tile
        tl.store(out_row + g, tl.full([BLOCK_G], float("-inf"), tl.float32), mask=in_range)
        return
    h = tl.arange(0, H_POW2)
    d = tl.arange(0, D_POW2)
    d_ok = d < D
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + d[None, :],
                mask=(h[:, None] < H) & d_ok[None, :], other=0.0)
    page = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + g // GPP, mask=visible, other=0).to(tl.int64)
    key_ptrs = keys_ptr + page[:, None] * stride_kb + (g % GPP)[:, None] * stride_kr + d[None, :]
    keys = tl.load(key_ptrs, mask=visible[:, None] & d_ok[None, :], other=0.0)
    if IEEE:
        dots = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [H_POW2, BLOCK_G] fp32
    else:
        dots = tl.dot(q, tl.trans(keys))
    score = tl.sum(tl.maximum(dots, 0.0), axis=0) * inv_sqrt_d + 0.0  # padded heads add relu(0) = 0
    tl.store(out_row + g, tl.where(visible, score, float("-inf")), mask=in_range)


def decode_index_scores_triton(
    index_q: torch.Tensor, block_key_cache: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
    ratio: int, block_g: int = 64,
) -> torch.Tensor:
    """index_q [B, Hi, Di] at `positions` [B] (-1: padding row, sees nothing) -> scores [B, N] fp32,
    N = block_tables.shape[1] * (block_size // r). Same contract as `paged.decode_index_scores`."""
    b, h, d = index_q.shape
    if block_key_cache.shape[-1] != d:
        raise ValueError(f"block_key_cache: key width {block_key_cache.shape[-1]} != index head dim {d}")
    if index_q.dtype != block_key_cache.dtype:
        raise ValueError(f"index_q: dtype {index_q.dtype} differs from the block key cache's {block_key_cache.dtype}")
    gpp = block_key_cache.shape[1]
    n = block_tables.shape[1] * gpp
    out = torch.empty((b, n), dtype=torch.float32, device=index_q.device)
    if b == 0 or n == 0:
        return out
    if index_q.stride(-1) != 1:
        index_q = index_q.contiguous()
    assert block_key_cache.stride(-1) == 1
    _score_kernel[(b, triton.cdiv(n, block_g))](
        index_q, block_key_cache, block_tables, positions, out, d ** -0.5,
        index_q.stride(0), index_q.stride(1), block_key_cache.stride(0), block_key_cache.stride(1),
        block_tables.stride(0), out.stride(0), n,
        RATIO=ratio, GPP=gpp, H=h, H_POW2=max(16, triton.next_power_of_2(h)), D=d,
        D_POW2=max(16, triton.next_power_of_2(d)), BLOCK_G=block_g, IEEE=index_q.dtype == torch.float32,
        num_warps=4,
    )
    return out
