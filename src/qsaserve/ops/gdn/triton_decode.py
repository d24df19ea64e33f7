"""One Triton kernel each for the ops of a GDN decode step, the delta rule included (references
in decode_ops.py). In torch the small ops are 8-13 kernels each per GDN layer per step, and at
batch 1 those launches, not their bytes, are the cost; the delta rule's state gather / scatter
around fla-core's kernel moves each fp32 state four times instead of twice."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gates_kernel(b_ptr, a_ptr, alog_ptr, dt_ptr, beta_ptr, g_ptr, H, stride_b, stride_a, stride_beta, stride_g,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK)
    ok = h < H
    b = tl.load(b_ptr + row * stride_b + h, mask=ok, other=0.0)
    tl.store(beta_ptr + row * stride_beta + h, tl.sigmoid(b.to(tl.float32)).to(b.dtype), mask=ok)
    x = tl.load(a_ptr + row * stride_a + h, mask=ok, other=0.0).to(tl.float32) \
        + tl.load(dt_ptr + h, mask=ok, other=0.0).to(tl.float32)
    # F.softplus (threshold 20); for very negative x, log(1 + e^x) = e^x to float32 precision.
    e = tl.exp(tl.minimum(x, 20.0))
    softplus = tl.where(x > 20.0, x, tl.where(x < -15.0, e, tl.log(1.0 + e)))
    decay = tl.exp(tl.load(alog_ptr + h, mask=ok, other=0.0).to(tl.float32))
    tl.store(g_ptr + row * stride_g + h, -decay * softplus, mask=ok)


@triton.jit
def causal_conv_step(x, w_ptr, stride_w, states_ptr, slot, keep, c, c_ok, stride_sn, stride_sc,
                     K: tl.constexpr, DIL: tl.constexpr, SPAN_POW2: tl.constexpr):
    """One token through a depthwise causal conv of K taps with dilation DIL, for the channels c
    of x: y = sum_j w[c, j] * ext[SPAN - (K-1-j)*DIL] over ext = state ++ x, where the slot's state
    holds the previous SPAN = (K-1)*DIL inputs, oldest first (zeros when not `keep`: a fresh
    sequence). The state is advanced in place (ext[1:]). Returns y in fp32, before any activation.
    Shared by the GDN conv (DIL 1) and the PLE layer's dilated conv."""
    SPAN: tl.constexpr = (K - 1) * DIL
    i = tl.arange(0, SPAN_POW2)
    st_ptrs = states_ptr + slot * stride_sn + c[:, None] * stride_sc + i[None, :]
    in_state = c_ok[:, None] & (i[None, :] < SPAN)
    st = tl.load(st_ptrs, mask=in_state & keep, other=0.0).to(tl.float32)
    y = x.to(tl.float32) * tl.load(w_ptr + c * stride_w + (K - 1), mask=c_ok, other=0.0).to(tl.float32)
    for j in tl.static_range(0, K - 1):
        tap = tl.sum(tl.where(i[None, :] == SPAN - (K - 1 - j) * DIL, st, 0.0), 1)
        y += tap * tl.load(w_ptr + c * stride_w + j, mask=c_ok, other=0.0).to(tl.float32)
    # New state: position p takes ext[p + 1], the last one x.
    nxt = tl.load(st_ptrs + 1, mask=c_ok[:, None] & (i[None, :] + 1 < SPAN) & keep, other=0.0).to(tl.float32)
    nxt = tl.where(i[None, :] == SPAN - 1, x.to(tl.float32)[:, None], nxt)
    # Other threads of this program load the entries stored below (position p + 1 of another
    # lane): every load of the old state completes before any store of the new one.
    tl.debug_barrier()
    tl.store(st_ptrs, nxt.to(states_ptr.dtype.element_ty), mask=in_state)
    return y


@triton.jit
def _conv_decode_kernel(x_ptr, w_ptr, states_ptr, slots_ptr, fresh_ptr, y_ptr, C,
                        stride_x, stride_w, stride_sn, stride_sc, stride_y,
                        W: tl.constexpr, SPAN_POW2: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    slot = tl.load(slots_ptr + row).to(tl.int64)
    keep = tl.load(fresh_ptr + row) == 0  # a fresh sequence starts from a zero state
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + c, mask=c_ok, other=0.0)
    y = causal_conv_step(x, w_ptr, stride_w, states_ptr, slot, keep, c, c_ok, stride_sn, stride_sc, W, 1, SPAN_POW2)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(y_ptr + row.to(tl.int64) * stride_y + c, y.to(y_ptr.dtype.element_ty), mask=c_ok)


@triton.jit
def _conv_decode_rows_kernel(x_ptr, w_ptr, states_ptr, slots_ptr, fresh_ptr, live_ptr, y_ptr, snap_ptr, snap_rows_ptr,
                             C, stride_x, stride_w, stride_sn, stride_sc, stride_y, stride_pn, stride_pc,
                             ROWS: tl.constexpr, HAS_SNAP: tl.constexpr, W: tl.constexpr, SPAN_POW2: tl.constexpr,
                             SILU: tl.constexpr, BLOCK_C: tl.constexpr):
    """ROWS tokens of one sequence in order through its conv state (advanced by each live row,
    stored to the sequence's snapshot row after each row but the last)."""
    seq = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    keep0 = tl.load(fresh_ptr + seq) == 0  # a fresh sequence's first row starts from a zero state
    i = tl.arange(0, SPAN_POW2)
    in_state = c_ok[:, None] & (i[None, :] < W - 1)
    for j in tl.static_range(ROWS):
        row = seq * ROWS + j
        tl.debug_barrier()  # the previous row's state stores land before this row reads them
        x = tl.load(x_ptr + row * stride_x + c, mask=c_ok, other=0.0)
        y = tl.zeros((BLOCK_C,), dtype=tl.float32)
        if tl.load(live_ptr + row) != 0:
            keep = keep0
            if j > 0:  # later rows continue from the state the earlier ones stored
                keep = keep0 | True
            y = causal_conv_step(x, w_ptr, stride_w, states_ptr, slot, keep, c, c_ok, stride_sn, stride_sc, W, 1,
                                 SPAN_POW2)
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(y_ptr + row * stride_y + c, y.to(y_ptr.dtype.element_ty), mask=c_ok)
        if HAS_SNAP and j < ROWS - 1:
            tl.debug_barrier()
            r = tl.load(snap_rows_ptr + seq * (ROWS - 1) + j).to(tl.int64)
            st = tl.load(states_ptr + slot * stride_sn + c[:, None] * stride_sc + i[None, :], mask=in_state, other=0.0)
            tl.store(snap_ptr + r * stride_pn + c[:, None] * stride_pc + i[None, :], st, mask=in_state)


@triton.jit
def _delta_rule_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slots_ptr, fresh_ptr, o_ptr, scale,
                            stride_q, stride_qh, stride_k, stride_kh, stride_v, stride_vh, stride_g, stride_beta,
                            stride_sn, stride_sh, stride_sk, stride_o, stride_oh,
                            GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """One token of one value head, BLOCK_V columns of its [DK, DV] state: the state is read from
    the sequence's slot (zeros when fresh), advanced and written back in place."""
    row = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    hk = hv // GROUP  # GVA: value head hv reads key/query head hv // (Hv / Hk)
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < DK
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vv < DV
    q = tl.load(q_ptr + row * stride_q + hk * stride_qh + kk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_k + hk * stride_kh + kk, mask=k_ok, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale  # L2 norm as reference.l2norm (eps inside the root)
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    v = tl.load(v_ptr + row * stride_v + hv * stride_vh + vv, mask=v_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + hv).to(tl.float32)
    beta = tl.load(beta_ptr + row * stride_beta + hv).to(tl.float32)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    keep = tl.load(fresh_ptr + row) == 0
    s_ptrs = states_ptr + slot * stride_sn + hv * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    s_ok = k_ok[:, None] & v_ok[None, :]
    state = tl.load(s_ptrs, mask=s_ok & keep, other=0.0) * tl.exp(g)
    u = beta * (v - tl.sum(state * k[:, None], 0))  # beta * (v - S^T k)
    state = state + k[:, None] * u[None, :]
    tl.store(s_ptrs, state, mask=s_ok)
    o = tl.sum(state * q[:, None], 0)  # S^T (scale * q)
    tl.store(o_ptr + row * stride_o + hv * stride_oh + vv, o.to(o_ptr.dtype.element_ty), mask=v_ok)


@triton.jit
def _delta_rule_rows_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slots_ptr, fresh_ptr, live_ptr, o_ptr,
                            snap_ptr, snap_rows_ptr, scale, stride_q, stride_qh, stride_k, stride_kh, stride_v,
                            stride_vh, stride_g, stride_beta, stride_sn, stride_sh, stride_sk, stride_o, stride_oh,
                            stride_pn, stride_ph, stride_pk,
                            ROWS: tl.constexpr, HAS_SNAP: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr,
                            DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """ROWS tokens of one sequence and value head in order, BLOCK_V columns of its state kept in
    registers across them: read once from the slot, advanced by each live row (its state stored
    to the sequence's snapshot row after each row but the last), written back once."""
    seq = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    hk = hv // GROUP
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < DK
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vv < DV
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    keep = tl.load(fresh_ptr + seq) == 0
    s_ok = k_ok[:, None] & v_ok[None, :]
    s_ptrs = states_ptr + slot * stride_sn + hv * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    state = tl.load(s_ptrs, mask=s_ok & keep, other=0.0)
    for j in tl.static_range(ROWS):
        row = seq * ROWS + j
        q = tl.load(q_ptr + row * stride_q + hk * stride_qh + kk, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * stride_k + hk * stride_kh + kk, mask=k_ok, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        v = tl.load(v_ptr + row * stride_v + hv * stride_vh + vv, mask=v_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_g + hv).to(tl.float32)
        beta = tl.load(beta_ptr + row * stride_beta + hv).to(tl.float32)
        live = tl.load(live_ptr + row) != 0
        new = state * tl.exp(g)
        u = beta * (v - tl.sum(new * k[:, None], 0))
        new = new + k[:, None] * u[None, :]
        state = tl.where(live, new, state)
        o = tl.sum(state * q[:, None], 0)
        tl.store(o_ptr + row * stride_o + hv * stride_oh + vv, o.to(o_ptr.dtype.element_ty), mask=v_ok)
        if HAS_SNAP and j < ROWS - 1:
            r = tl.load(snap_rows_ptr + seq * (ROWS - 1) + j).to(tl.int64)
            tl.store(snap_ptr + r * stride_pn + hv * stride_ph + kk[:, None] * stride_pk + vv[None, :], state, mask=s_ok)
    tl.store(s_ptrs, state, mask=s_ok)


@triton.jit
def _gated_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, D, eps, stride_x, stride_z, stride_o,
                       SILU: tl.constexpr, ROUND_WN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (token, head) row of D values
    c = tl.arange(0, BLOCK)
    ok = c < D
    x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)).to(x.dtype).to(tl.float32)
    wn = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32) * normed
    if ROUND_WN:  # weight * normed in the model dtype, as torch rounds it
        wn = wn.to(x.dtype).to(tl.float32)
    z = tl.load(z_ptr + row * stride_z + c, mask=ok, other=0.0).to(tl.float32)
    act = z * tl.sigmoid(z) if SILU else tl.sigmoid(z)
    tl.store(out_ptr + row * stride_o + c, (wn * act).to(out_ptr.dtype.element_ty), mask=ok)


def gdn_gates_triton(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    if b.stride(-1) != 1 or a.stride(-1) != 1:
        b, a = b.contiguous(), a.contiguous()
    a_log, dt_bias = a_log.contiguous(), dt_bias.contiguous()
    t, h = b.shape
    beta = torch.empty_like(b)
    g = torch.empty((t, h), dtype=torch.float32, device=b.device)
    if t:
        _gates_kernel[(t,)](b, a, a_log, dt_bias, beta, g, h, b.stride(0), a.stride(0), beta.stride(0), g.stride(0),
                            BLOCK=triton.next_power_of_2(h), num_warps=1)
    return beta, g


def conv1d_decode_triton_(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                          fresh: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    if activation not in ("silu", "swish", None):
        raise ValueError(f"unsupported activation {activation!r}")
    b, c = x.shape
    w = weight.reshape(weight.shape[0], -1)
    width = w.shape[1]
    if states.shape[-1] != width - 1 or states.stride(-1) != 1 or w.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("conv1d_decode: states [N, C, W-1] and weight [C, W] with unit last strides")
    y = torch.empty_like(x)
    if b:
        block_c = 128
        _conv_decode_kernel[(b, triton.cdiv(c, block_c))](
            x, w, states, slots, fresh, y, c, x.stride(0), w.stride(0), states.stride(0), states.stride(1), y.stride(0),
            W=width, SPAN_POW2=triton.next_power_of_2(width - 1), SILU=activation is not None, BLOCK_C=block_c,
            num_warps=4)
    return y


def conv1d_decode_rows_triton_(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                               fresh: torch.Tensor, live: torch.Tensor, activation: str = "silu",
                               snapshots: torch.Tensor | None = None,
                               snapshot_rows: torch.Tensor | None = None) -> torch.Tensor:
    """decode_ops.conv1d_decode_rows_reference_ in one launch."""
    if activation not in ("silu", "swish", None):
        raise ValueError(f"unsupported activation {activation!r}")
    b, n, c = x.shape
    w = weight.reshape(weight.shape[0], -1)
    width = w.shape[1]
    if states.shape[-1] != width - 1 or states.stride(-1) != 1 or w.stride(-1) != 1 or live.shape != (b, n):
        raise ValueError("conv1d_decode_rows: x [B, n, C], live [B, n], states [N, C, W-1] and weight [C, W] "
                         "with unit last strides")
    x2 = x.reshape(b * n, c).contiguous()
    live = live.reshape(-1).to(torch.int8).contiguous()
    has_snap = snapshots is not None and n > 1
    snap = snapshots if has_snap else states
    rows = snapshot_rows.contiguous() if has_snap else slots
    y = torch.empty_like(x2)
    if b:
        block_c = 128
        _conv_decode_rows_kernel[(b, triton.cdiv(c, block_c))](
            x2, w, states, slots.contiguous(), fresh.contiguous(), live, y, snap, rows, c, x2.stride(0), w.stride(0),
            states.stride(0), states.stride(1), y.stride(0), snap.stride(0), snap.stride(1), ROWS=n,
            HAS_SNAP=has_snap, W=width, SPAN_POW2=triton.next_power_of_2(width - 1), SILU=activation is not None,
            BLOCK_C=block_c, num_warps=4)
    return y.view(b, n, c)


def delta_rule_decode_triton_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                              fresh: torch.Tensor) -> torch.Tensor:
    """decode_ops.delta_rule_decode_reference_ in one launch, the state updated in its slot."""
    b, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if (k.shape != q.shape or hv % hk or states.shape[1:] != (hv, dk, dv) or states.dtype != torch.float32
            or g.shape != (b, hv) or beta.shape != (b, hv)):
        raise ValueError("delta_rule_decode: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv], fp32 states [N, Hv, Dk, Dv]")
    if (q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or states.stride(-1) != 1
            or g.stride(-1) != 1 or beta.stride(-1) != 1):
        raise ValueError("delta_rule_decode: unit last strides")
    slots, fresh = slots.contiguous(), fresh.contiguous()
    o = torch.empty((b, hv, dv), dtype=q.dtype, device=q.device)
    if b:
        block_v = min(32, triton.next_power_of_2(dv))
        _delta_rule_step_kernel[(b, hv, triton.cdiv(dv, block_v))](
            q, k, v, g, beta, states, slots, fresh, o, dk**-0.5, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), g.stride(0), beta.stride(0), states.stride(0), states.stride(1), states.stride(2),
            o.stride(0), o.stride(1), GROUP=hv // hk, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk),
            BLOCK_V=block_v, num_warps=4)
    return o


def delta_rule_decode_rows_triton_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                                   live: torch.Tensor, snapshots: torch.Tensor | None = None,
                                   snapshot_rows: torch.Tensor | None = None) -> torch.Tensor:
    """decode_ops.delta_rule_decode_rows_reference_ in one launch."""
    b, n, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if (k.shape != q.shape or hv % hk or states.shape[1:] != (hv, dk, dv) or states.dtype != torch.float32
            or g.shape != (b, n, hv) or beta.shape != (b, n, hv) or live.shape != (b, n)):
        raise ValueError("delta_rule_decode_rows: q, k [B, n, Hk, Dk], v [B, n, Hv, Dv], g, beta [B, n, Hv], "
                         "live [B, n], fp32 states [N, Hv, Dk, Dv]")
    q, k, v = (t.reshape(b * n, *t.shape[2:]).contiguous() for t in (q, k, v))
    g, beta = g.reshape(b * n, hv).contiguous(), beta.reshape(b * n, hv).contiguous()
    live = live.reshape(-1).to(torch.int8).contiguous()
    has_snap = snapshots is not None and n > 1
    snap = snapshots if has_snap else states
    rows = snapshot_rows.contiguous() if has_snap else slots
    o = torch.empty((b * n, hv, dv), dtype=q.dtype, device=q.device)
    if b:
        block_v = min(32, triton.next_power_of_2(dv))
        _delta_rule_rows_kernel[(b, hv, triton.cdiv(dv, block_v))](
            q, k, v, g, beta, states, slots.contiguous(), fresh.contiguous(), live, o, snap, rows, dk**-0.5,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
            states.stride(0), states.stride(1), states.stride(2), o.stride(0), o.stride(1),
            snap.stride(0), snap.stride(1), snap.stride(2), ROWS=n, HAS_SNAP=has_snap, GROUP=hv // hk, DK=dk, DV=dv,
            BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, num_warps=4)
    return o.view(b, n, hv, dv)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                          activation: str = "silu") -> torch.Tensor:
    if activation not in ("silu", "swish", "sigmoid"):
        raise ValueError(f"unsupported activation {activation!r}")
    d = x.shape[-1]
    x2, z2 = x.reshape(-1, d), gate.reshape(-1, d)
    if x2.stride(-1) != 1 or z2.stride(-1) != 1:
        x2, z2 = x2.contiguous(), z2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        round_wn = torch.promote_types(weight.dtype, x.dtype) == x.dtype and x.dtype != torch.float32
        _gated_norm_kernel[(x2.shape[0],)](x2, z2, weight, out, d, eps, x2.stride(0), z2.stride(0), out.stride(0),
                                           SILU=activation != "sigmoid", ROUND_WN=round_wn,
                                           BLOCK=triton.next_power_of_2(d), num_warps=4 if d >= 256 else 2)
    return out.view(x.shape)
