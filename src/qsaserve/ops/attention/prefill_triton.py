"""Triton varlen causal paged prefill: query tiles of BLOCK_M rows of one sequence (the plan in
triton_paged.py lists them, heaviest first), each over its context read through the block table;
FP8 E4M3 pages are converted to the query dtype (exact), the scales folded into the scores and the
output. Under decode context parallelism the keys are this rank's shard (triton_common.ShardKeys)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.attention.configs import PrefillConfig, prefill_config
from qsaserve.ops.attention.triton_common import (LOG2E, ShardKeys, _key_position, _local_len, _M_INIT, check_scales,
                                                  dcp_args)


# ----------------------------------------------------------------------------------------------
# Prefill: grid (q_head, tile). A tile is BLOCK_M query rows of one sequence; rows are the last
# q_len tokens of the context, so row i sits at position seq_len - q_len + i. Keys before the
# tile's first row are visible to every row and take the unmasked loop.
# ----------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["dcp_rank", "stride_bt"], do_not_specialize_on_alignment=[
    "bt_ptr", "seq_lens_ptr", "key_lens_ptr", "cu_q_ptr", "tiles_ptr", "k_scale_ptr", "v_scale_ptr"])
def _prefill_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, key_lens_ptr, cu_q_ptr, tiles_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, lse_ptr, qk_scale, dcp_rank,
    stride_qt, stride_qh,
    stride_c2, stride_cb, stride_ct, stride_ch,
    stride_bt, stride_ot, stride_oh, stride_et, stride_eh,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, D_POW2: tl.constexpr, PAGE: tl.constexpr,
    IS_FP8: tl.constexpr, WRITE_LSE: tl.constexpr, DCP_SIZE: tl.constexpr, DCP_I: tl.constexpr,
):
    head = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.load(tiles_ptr + 2 * tile)
    m0 = tl.load(tiles_ptr + 2 * tile + 1)
    kvh = head // G
    seq_len = tl.load(seq_lens_ptr + seq)
    if DCP_SIZE == 1:
        key_len = seq_len
    else:
        key_len = tl.load(key_lens_ptr + seq)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    ctx = seq_len - q_len

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < q_len
    q_pos = ctx + offs_m
    d = tl.arange(0, D_POW2)
    d_ok = d < D
    q = tl.load(
        q_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=m_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if IS_FP8:
        qk = qk_scale * tl.load(k_scale_ptr)
    else:
        qk = qk_scale

    m_i = tl.full([BLOCK_M], _M_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_POW2], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = cache_ptr + kvh * stride_ch + d[None, :]
    d_mask = d_ok[None, :] | (offs_n[:, None] < 0)  # [BLOCK_N, D_POW2]

    # Key rows [0, full_end) sit before every row's position and inside the key count: no masks.
    full_end = (_local_len(ctx + m0, dcp_rank, DCP_SIZE, DCP_I) // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        pos = n0 + offs_n
        page = tl.load(bt_row + pos // PAGE).to(tl.int64)
        tok = page * stride_cb + (pos % PAGE) * stride_ct
        if D == D_POW2:
            k = tl.load(k_base + tok[:, None])
            v = tl.load(k_base + stride_c2 + tok[:, None])
        else:
            k = tl.load(k_base + tok[:, None], mask=d_mask, other=0.0)
            v = tl.load(k_base + stride_c2 + tok[:, None], mask=d_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * qk
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        m_i = m_new

    # Diagonal tiles: causal and length masks. Key rows past `hi` lie after every row of the tile.
    hi = tl.minimum(key_len, _local_len(ctx + m0 + BLOCK_M, dcp_rank, DCP_SIZE, DCP_I))
    for n0 in range(full_end, hi, BLOCK_N):
        pos = n0 + offs_n
        n_ok = pos < key_len
        page = tl.load(bt_row + pos // PAGE, mask=n_ok, other=0).to(tl.int64)
        tok = page * stride_cb + (pos % PAGE) * stride_ct
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + tok[:, None], mask=kv_mask, other=0.0)
        v = tl.load(k_base + stride_c2 + tok[:, None], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * qk
        kpos = _key_position(pos, dcp_rank, DCP_SIZE, DCP_I)
        s = tl.where(n_ok[None, :] & (kpos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if IS_FP8:
        o = o * tl.load(v_scale_ptr)
    o_ptrs = out_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + (q_start + offs_m).to(tl.int64) * stride_et + head * stride_eh, lse, mask=m_ok)


def paged_prefill(
    q, kv_cache, block_tables, seq_lens, cu_query_lens, out, scale, *, tiles, num_tiles,
    config: PrefillConfig | None = None, k_scale=None, v_scale=None, lse=None, shard: ShardKeys | None = None,
) -> torch.Tensor:
    """Causal attention for the (seq, first row) query tiles in `tiles` into `out` [T, Hq, D]
    (and the base-2 log-sum-exp into `lse` [T, Hq] fp32 when given)."""
    if num_tiles == 0:
        return out
    _, hq, d = q.shape
    hkv = kv_cache.shape[3]
    cfg = config or prefill_config(d)
    fp8 = check_scales(kv_cache, k_scale, v_scale)
    key_lens, rank, dcp_size, dcp_i = dcp_args(shard, seq_lens)
    ks, vs = (k_scale, v_scale) if fp8 else (seq_lens, seq_lens)
    lse_t, es = (lse, (lse.stride(0), lse.stride(1))) if lse is not None else (out, (0, 0))
    _prefill_kernel[(hq, num_tiles)](
        q, kv_cache, block_tables, seq_lens, key_lens, cu_query_lens, tiles, ks, vs, out, lse_t, scale * LOG2E, rank,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1), *es,
        G=hq // hkv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D=d, D_POW2=triton.next_power_of_2(d),
        PAGE=kv_cache.shape[2], IS_FP8=fp8, WRITE_LSE=lse is not None, DCP_SIZE=dcp_size, DCP_I=dcp_i,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
