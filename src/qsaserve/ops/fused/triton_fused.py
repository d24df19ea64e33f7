"""Triton kernels for the decoder's small per-token ops (references in reference.py).

In a decode step the GEMMs are few and large while RMSNorm, RoPE, SiLU*up and the residual adds
are chains of 5-15 tiny torch kernels each (casts, pow, mean, rsqrt, index, cat, ...); at batch 1
those launches cost more device time than the weight reads. Each op here is one launch:

* ``rms_norm`` / ``add_rms_norm``: one program per row; the residual form writes the new residual
  (x + residual, rounded to the input dtype like the torch add) and normalises that rounded sum.
* ``rope_qk_``: one program per token rotates all q and k heads in place, cos/sin read once.
* ``silu_mul``: SiLU(gate) * up straight from the fused gate_up output, no chunk copies.

Math is float32 inside; every rounding to the input dtype happens where the torch path rounds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_NORM_COLS = 32768  # one row per program, held whole in registers


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     stride_x0, stride_x1, inner, stride_r, stride_o, stride_ro, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # A row is (row // inner, row % inner): 3-D inputs such as per-head q/k views need no copy.
    x = tl.load(x_ptr + (row // inner) * stride_x0 + (row % inner) * stride_x1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    normed = rms_norm_row(x, tl.load(w_ptr + cols, mask=mask, other=0.0), n_cols, eps)
    tl.store(out_ptr + row * stride_o + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_row(x, w, n_cols, eps):
    """One row [BLOCK] (zeros past n_cols) times the norm weight w over its RMS, float32: the
    RMSNorm's arithmetic, shared by every kernel that must compute it as this module does."""
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / n_cols
    return w.to(tl.float32) * (xf * tl.rsqrt(mean_sq + eps))


def norm_launch_config(n_cols: int) -> tuple[int, int]:
    if n_cols > _MAX_NORM_COLS:
        raise ValueError(f"x: last dim {n_cols} is too wide for the fused RMSNorm (at most {_MAX_NORM_COLS})")
    block = triton.next_power_of_2(n_cols)
    return block, min(16, max(1, block // 256))


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.stride(-1) != 1:
        raise ValueError("x: the last dimension must be contiguous")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous [{x.shape[-1]}] vector, got {tuple(weight.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x ([N, D] or [N, H, D], any row strides) -> a new contiguous tensor."""
    _check_weight(x, weight)
    if x.dim() == 2:
        s0, s1, inner = x.stride(0), 0, 1
    elif x.dim() == 3:
        s0, s1, inner = x.stride(0), x.stride(1), x.shape[1]
    else:
        x = x.reshape(-1, x.shape[-1])
        s0, s1, inner = x.stride(0), 0, 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_cols = x.shape[-1]
    rows = x.numel() // n_cols
    if rows == 0:
        return out
    block, warps = norm_launch_config(n_cols)
    _rms_norm_kernel[(rows,)](x, x, weight, out, out, s0, s1, inner, 0, n_cols, 0, n_cols, eps,
                              HAS_RESIDUAL=False, BLOCK=block, num_warps=warps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one launch; x, residual: [N, D], same dtype."""
    _check_weight(x, weight)
    if x.dim() != 2 or residual.shape != x.shape:
        raise ValueError(f"residual: expected shape {tuple(x.shape)} of a 2-D x, got {tuple(residual.shape)}")
    if residual.dtype != x.dtype or residual.stride(-1) != 1:
        raise ValueError(f"residual: must be {x.dtype} with a contiguous last dim, got {residual.dtype}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
    rows, n_cols = x.shape
    if rows == 0:
        return out, new_residual
    block, warps = norm_launch_config(n_cols)
    _rms_norm_kernel[(rows,)](x, residual, weight, out, new_residual, x.stride(0), 0, 1, residual.stride(0),
                              n_cols, n_cols, n_cols, eps, HAS_RESIDUAL=True, BLOCK=block, num_warps=warps)
    return out, new_residual


@triton.jit
def _rotate_heads(base, stride_h, cos, sin, d, d_ok,
                  N_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    for h0 in range(0, N_HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h < N_HEADS)[:, None] & d_ok[None, :]
        p1 = base + h[:, None] * stride_h + d[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(p1, (x1 * cos - x2 * sin).to(base.dtype.element_ty), mask=mask)
        tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rope_qk_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
                    HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, d, d_ok, HQ, HALF, BLOCK_H)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, d, d_ok, HK, HALF, BLOCK_H)


def rope_qk_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hk, D] (views into the qkv output are fine) in place at
    `positions` [T]; cos/sin: [max_positions, rotary_dim / 2] tables. Returns q, k."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q, k: expected [T, Hq, D] and [T, Hk, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or k.dtype != q.dtype:
        raise ValueError("q, k: same dtype and a contiguous head_dim required")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions: expected shape ({q.shape[0]},), got {tuple(positions.shape)}")
    half = cos.shape[-1]
    if sin.shape != cos.shape or cos.stride(-1) != 1 or sin.stride(-1) != 1 or 2 * half > q.shape[2]:
        raise ValueError(f"cos, sin: expected equal [P, <= {q.shape[2] // 2}] tables, "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if q.shape[0] == 0:
        return q, k
    block_d = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(q.shape[1], k.shape[1])), max(1, 4096 // block_d))
    _rope_qk_kernel[(q.shape[0],)](
        q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        HQ=q.shape[1], HK=k.shape[1], HALF=half, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )
    return q, k


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # SiLU rounds to the input dtype before the product, as F.silu(gate) * up does.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up, any row stride) -> SiLU(gate) * up, a new [T, I] tensor."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x: expected [T, 2I] with a contiguous last dim, got {tuple(x.shape)}")
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), inter,
                                                        BLOCK=block, num_warps=4)
    return out


@triton.jit
def rotate_half_partner(d, ROT):
    """Partial rotate-half RoPE over the first ROT of the lanes d: each lane's partner lane
    (d + ROT/2 in the first half, d - ROT/2 in the second) and whether the lane rotates."""
    half = ROT // 2
    return tl.where(d < half, d + half, d - half), d < ROT


@triton.jit
def rotate_half_apply(x, x_partner, c, s, d, ROT, dt):
    """x * cos + rotate_half(x) * sin on fp32 lanes (x_partner: the partner lane's value), each
    product rounded to dt as the torch path rounds it; lanes past ROT keep x. Returns dt."""
    xp = tl.where(d < ROT // 2, -x_partner, x_partner)
    rotated = ((x * c).to(dt).to(tl.float32) + (xp * s).to(dt).to(tl.float32)).to(dt)
    return tl.where(d < ROT, rotated, x.to(dt))


@triton.jit
def _norm_rope_heads_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, H, D, ROT, eps,
                            stride_xt, stride_xh, stride_c, stride_ot, stride_oh, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    ok = d < D
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    n = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / D + eps) * (1.0 + w)).to(x.dtype)  # 1-centred RMSNorm
    partner, rot = rotate_half_partner(d, ROT)
    xp = tl.load(x_ptr + t * stride_xt + h * stride_xh + partner, mask=rot, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    # The partner's normed value: same row RMS, its own weight.
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
    npart = (xp * inv * (1.0 + wp)).to(x.dtype).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_c + d, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_c + d, mask=rot, other=0.0).to(tl.float32)
    out = rotate_half_apply(n.to(tl.float32), npart, c, s, d, ROT, x.dtype)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out, mask=ok)


def norm_rope_heads(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """x [T, H, D] (any token/head strides, unit last stride) -> 1-centred RMSNorm per head, then
    rotate-half RoPE on the first cos.shape[-1] dims (cos/sin [T, rot] in x's dtype), each op
    rounded to x's dtype as the torch path rounds it. A new contiguous [T, H, D] tensor."""
    t, h, d = x.shape
    rot = cos.shape[-1]
    if (x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0)
            or rot > d or rot % 2):
        raise ValueError("norm_rope_heads: unit last strides, cos and sin alike, an even rotary width <= head_dim")
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        _norm_rope_heads_kernel[(t, h)](x, weight, cos, sin, out, h, d, rot, eps, x.stride(0), x.stride(1),
                                        cos.stride(0), out.stride(0), out.stride(1),
                                        BLOCK=triton.next_power_of_2(d), num_warps=2 if d <= 256 else 4)
    return out


@triton.jit
def inject_norm_kernel(hyper_ptr, out_ptr, inj_ptr, w_ptr, new_ptr, xn_ptr, H, eps, stride_h, stride_o, stride_i,
                        stride_n, stride_x, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)  # one stream of the row
    c = tl.arange(0, BLOCK)
    ok = c < H
    x = tl.load(hyper_ptr + row * stride_h + s * H + c, mask=ok, other=0.0)
    if HAS_OUT:
        o = tl.load(out_ptr + row * stride_o + c, mask=ok, other=0.0)
        g = tl.load(inj_ptr + row * stride_i + s)
        prod = (o.to(tl.float32) * g.to(tl.float32)).to(x.dtype)
        x = (x.to(tl.float32) + prod.to(tl.float32)).to(x.dtype)
        tl.store(new_ptr + row * stride_n + s * H + c, x, mask=ok)
    xf = x.to(tl.float32)
    y = xf * tl.rsqrt(tl.sum(xf * xf, 0) / H + eps)
    w = tl.load(w_ptr + s * H + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(xn_ptr + row * stride_x + s * H + c, (y * (1.0 + w)).to(x.dtype), mask=ok)


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int) -> torch.Tensor:
    """Qwen4Exp's 1-centred RMSNorm with one RMS per `group_size` features (weight over the full
    width): `reference.grouped_rms_norm_reference`. x [..., width], unit last stride."""
    width = x.shape[-1]
    if width % group_size or x.stride(-1) != 1 or group_size > _MAX_NORM_COLS:
        raise ValueError("grouped_rms_norm: width a multiple of group_size (<= 32768), with a unit last stride")
    weight = weight.contiguous()
    x2 = x.reshape(-1, width)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(group_size)
        inject_norm_kernel[(x2.shape[0], width // group_size)](
            x2, x2, x2, weight, x2, out, group_size, eps, x2.stride(0), 0, 0, 0, out.stride(0),
            HAS_OUT=False, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out.view(x.shape)


@triton.jit
def _sigmoid_gated_add_kernel(x_ptr, y_ptr, g_ptr, out_ptr, n_cols, stride_x, stride_y, stride_g, stride_o,
                              BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    dt = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * stride_g).to(tl.float32)
    gate = tl.sigmoid(g).to(dt).to(tl.float32)  # each op rounded to the dtype, as torch does
    y = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x + (gate * y).to(dt).to(tl.float32)).to(dt), mask=ok)


def sigmoid_gated_add(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + sigmoid(gate) * y for x, y [N, H] and gate [N, 1] (any row strides, unit last stride):
    three torch launches in one. A new [N, H] tensor."""
    n, h = x.shape
    if y.shape != (n, h) or gate.shape != (n, 1) or x.stride(-1) != 1 or y.stride(-1) != 1:
        raise ValueError(f"sigmoid_gated_add: x, y [N, H] with unit last strides and gate [N, 1]; got "
                         f"{tuple(x.shape)}, {tuple(y.shape)}, {tuple(gate.shape)}")
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    if n:
        block = min(1024, triton.next_power_of_2(h))
        _sigmoid_gated_add_kernel[(n, triton.cdiv(h, block))](x, y, gate, out, h, x.stride(0), y.stride(0),
                                                               gate.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rotate_head_block(x_ptr, r, t, hb, stride_t, stride_h, n_heads, D: tl.constexpr, BLOCK_H: tl.constexpr):
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    ptrs = x_ptr + t * stride_t + h[:, None] * stride_h + d[None, :]
    ok = (h < n_heads)[:, None]
    x = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    y = tl.dot(x, r, input_precision="ieee")  # float32 FMAs: TF32 would cost ~1e-3 per score
    tl.store(ptrs, y.to(x_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _head_rotate_qk_kernel(q_ptr, k_ptr, r_ptr, stride_qt, stride_qh, stride_kt, stride_kh, HQ, HK,
                           D: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    d = tl.arange(0, D)
    r = tl.load(r_ptr + d[:, None] * D + d[None, :])
    if tl.program_id(2) == 0:
        if hb * BLOCK_H < HQ:
            _rotate_head_block(q_ptr, r, t, hb, stride_qt, stride_qh, HQ, D, BLOCK_H)
    else:
        if hb * BLOCK_H < HK:
            _rotate_head_block(k_ptr, r, t, hb, stride_kt, stride_kh, HK, D, BLOCK_H)


def head_rotate_qk_(q: torch.Tensor, k: torch.Tensor, rotation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hk, D] (views into the qkv output are fine) times `rotation` [D, D]
    float32 per head, in place, in one launch: products and sums in float32, one rounding to the
    input dtype (what ops/head_transform.rotate_heads computes). D: a power of two >= 16. Returns q, k."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q, k: expected [T, Hq, D] and [T, Hk, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or k.dtype != q.dtype:
        raise ValueError("q, k: same dtype and a contiguous head_dim required")
    d = q.shape[2]
    if rotation.shape != (d, d) or rotation.dtype != torch.float32 or d < 16 or d & (d - 1):
        raise ValueError(f"rotation: expected a float32 [{d}, {d}] matrix with head_dim a power of two >= 16, "
                         f"got {rotation.dtype} {tuple(rotation.shape)}")
    if q.shape[0] == 0:
        return q, k
    block_h = 16  # tl.dot's smallest M; heads past H are masked
    grid = (q.shape[0], triton.cdiv(max(q.shape[1], k.shape[1]), block_h), 2)
    _head_rotate_qk_kernel[grid](q, k, rotation.contiguous(), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                 q.shape[1], k.shape[1], D=d, BLOCK_H=block_h, num_warps=4 if d <= 64 else 8)
    return q, k


@triton.jit
def _transform_head_tokens(x_ptr, m_ptr, t0, h, n_tokens, stride_t, stride_h, D: tl.constexpr, BLOCK_T: tl.constexpr):
    t = t0 + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D)
    m = tl.load(m_ptr + d[:, None] * D + d[None, :])
    ptrs = x_ptr + t[:, None].to(tl.int64) * stride_t + h * stride_h + d[None, :]
    ok = (t < n_tokens)[:, None]
    x = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    y = tl.dot(x, m, input_precision="ieee")  # float32 FMAs, as in _rotate_head_block
    tl.store(ptrs, y.to(x_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _head_transform_qk_kernel(q_ptr, k_ptr, qm_ptr, km_ptr, n_tokens, stride_qt, stride_qh, stride_kt, stride_kh,
                              stride_qm, stride_km, HQ, GROUP, D: tl.constexpr, BLOCK_T: tl.constexpr):
    t0 = tl.program_id(0) * BLOCK_T
    h = tl.program_id(1)
    if h < HQ:  # query head h: its KV head's matrix
        _transform_head_tokens(q_ptr, qm_ptr + (h // GROUP) * stride_qm, t0, h, n_tokens, stride_qt, stride_qh, D, BLOCK_T)
    else:
        hk = h - HQ
        _transform_head_tokens(k_ptr, km_ptr + hk * stride_km, t0, hk, n_tokens, stride_kt, stride_kh, D, BLOCK_T)


def head_transform_qk_(q: torch.Tensor, k: torch.Tensor, q_matrices: torch.Tensor, k_matrices: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Like head_rotate_qk_ with a matrix per KV head: q [T, Hq, D] head h times q_matrices[h // (Hq /
    Hk)], k [T, Hk, D] head h times k_matrices[h] ([Hk, D, D] float32, or [D, D] for all heads), in
    place, in one launch, float32 products, one rounding (ops/head_transform.transform_heads). One
    program per (16 tokens, head): each loads its head's matrix once."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q, k: expected [T, Hq, D] and [T, Hk, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or k.dtype != q.dtype:
        raise ValueError("q, k: same dtype and a contiguous head_dim required")
    d, hq, hk = q.shape[2], q.shape[1], k.shape[1]
    if d < 16 or d & (d - 1) or hq % hk:
        raise ValueError(f"head_transform_qk_: head_dim a power of two >= 16 and Hq a multiple of Hk, got D={d}, "
                         f"Hq={hq}, Hk={hk}")
    mats = []
    for name, m in (("q_matrices", q_matrices), ("k_matrices", k_matrices)):
        if m.dtype != torch.float32 or m.shape not in ((d, d), (hk, d, d)):
            raise ValueError(f"{name}: expected float32 [{hk}, {d}, {d}] or [{d}, {d}], got {m.dtype} {tuple(m.shape)}")
        m = m.contiguous()
        mats.append((m, 0 if m.dim() == 2 else d * d))
    (qm, stride_qm), (km, stride_km) = mats
    if q.shape[0] == 0:
        return q, k
    block_t = 16  # tl.dot's smallest M; tokens past T are masked
    grid = (triton.cdiv(q.shape[0], block_t), hq + hk)
    _head_transform_qk_kernel[grid](q, k, qm, km, q.shape[0], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                    stride_qm, stride_km, hq, hq // hk, D=d, BLOCK_T=block_t,
                                    num_warps=4 if d <= 64 else 8)
    return q, k
