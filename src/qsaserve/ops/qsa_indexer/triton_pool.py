"""`paged.pool_completed_groups` (its reference) as one Triton launch: each decode row appends its
raw index key to its sequence's open group (the state slot's tail), and a row whose token completes
the group pools it into the group's block key: mean over the r raw keys, 1-centred RMSNorm,
partial RoPE at the group's first position, written where the block table puts that group. In torch
that is ~30 small kernels per QSA layer per decode step. Each intermediate is rounded to the
model dtype where the torch path rounds it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.fused.triton_fused import rotate_half_apply, rotate_half_partner


@triton.jit(do_not_specialize=["stride_bt"])
def _pool_kernel(tails_ptr, slots_ptr, raw_ptr, keys_ptr, bt_ptr, pos_ptr, valid_ptr, w_ptr, inv_freq_ptr, eps,
                 stride_tn, stride_tr, stride_raw, stride_bt, ROT, GPP,
                 R: tl.constexpr, D: tl.constexpr, D_POW2: tl.constexpr):
    b = tl.program_id(0)
    d = tl.arange(0, D_POW2)
    d_ok = d < D
    pos = tl.load(pos_ptr + b).to(tl.int64)
    p = tl.maximum(pos, 0)
    col = p % R
    slot = tl.load(slots_ptr + b).to(tl.int64)
    tail = tails_ptr + slot * stride_tn
    dt = tails_ptr.dtype.element_ty
    x = tl.load(raw_ptr + b.to(tl.int64) * stride_raw + d, mask=d_ok, other=0.0).to(dt)
    tl.store(tail + col * stride_tr + d, x, mask=d_ok)
    # The open group's r keys: this token's from registers, the others from the slot.
    rr = tl.arange(0, R)
    group_raw = tl.load(tail + rr[:, None] * stride_tr + d[None, :], mask=(rr[:, None] != col) & d_ok[None, :],
                        other=0.0)
    group_raw = tl.where(rr[:, None] == col, x[None, :], group_raw).to(tl.float32)
    mean = (tl.sum(group_raw, 0) / R).to(dt).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(mean * mean, 0) / D + eps)
    pooled = (mean * inv_rms * (1.0 + w)).to(dt).to(tl.float32)
    # Partial rotate-half RoPE at the group's first position (cos/sin as rope_cos_sin: fp32, then dt).
    g = tl.maximum((p + 1) // R - 1, 0)
    partner, rot = rotate_half_partner(d, ROT)
    j = tl.where(d < ROT // 2, d, d - ROT // 2)
    freq = (g * R).to(tl.float32) * tl.load(inv_freq_ptr + j, mask=rot, other=0.0)
    c = tl.cos(freq).to(dt).to(tl.float32)
    s = tl.sin(freq).to(dt).to(tl.float32)
    # The partner's pooled value: recompute it (same row RMS) rather than shuffle registers.
    xp = tl.load(tail + rr[:, None] * stride_tr + partner[None, :], mask=(rr[:, None] != col) & rot[None, :],
                 other=0.0)
    xs = tl.load(raw_ptr + b.to(tl.int64) * stride_raw + partner, mask=rot, other=0.0).to(dt)
    xp = tl.where(rr[:, None] == col, xs[None, :], xp).to(tl.float32)
    mp = (tl.sum(xp, 0) / R).to(dt).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    pp = (mp * inv_rms * (1.0 + wp)).to(dt).to(tl.float32)
    key = rotate_half_apply(pooled, pp, c, s, d, ROT, dt)
    done = (tl.load(valid_ptr + b) != 0) & ((pos + 1) % R == 0)
    page = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + g // GPP, mask=done, other=0).to(tl.int64)
    tl.store(keys_ptr + (page * GPP + g % GPP) * D + d, key.to(keys_ptr.dtype.element_ty), mask=done & d_ok)


def pool_completed_groups_triton(tails, slots, raw, block_key_cache, block_tables, positions, valid,
                                 k_layernorm_weight, inv_freq, ratio: int, eps: float) -> None:
    """Same contract as paged.pool_completed_groups (in place on tails and block_key_cache)."""
    b = raw.shape[0]
    di = raw.shape[-1]
    if ratio & (ratio - 1):
        raise ValueError(f"ratio: the Triton pooling needs a power of two, got {ratio}")
    if (raw.stride(-1) != 1 or tails.stride(-1) != 1 or not block_key_cache.is_contiguous()
            or block_tables.stride(-1) != 1):
        raise ValueError("pool_completed_groups: unit last strides and a contiguous block key cache")
    rot = 2 * inv_freq.shape[0]
    if rot > di or block_key_cache.shape[-1] != di or tails.shape[-1] != di:
        raise ValueError(f"pool_completed_groups: rotary width {rot}, block keys {block_key_cache.shape[-1]} and "
                         f"tails {tails.shape[-1]} must fit the index key width {di}")
    slots, positions, valid = slots.contiguous(), positions.contiguous(), valid.contiguous()
    if b == 0:
        return
    inv = inv_freq.to(device=raw.device, dtype=torch.float32).contiguous()
    _pool_kernel[(b,)](tails, slots, raw, block_key_cache, block_tables, positions, valid, k_layernorm_weight, inv,
                       eps, tails.stride(0), tails.stride(1), raw.stride(0), block_tables.stride(0),
                       2 * inv.shape[0], block_key_cache.shape[1],
                       R=ratio, D=di, D_POW2=triton.next_power_of_2(di), num_warps=4 if di >= 256 else 2)
