"""Plain-PyTorch Gated DeltaNet (GDN) reference math, stateful and chunk-friendly.

Argument conventions follow fla-core (``fla.ops.gated_delta_rule``) so the engine can swap
``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` in on GPU:

* ``q, k``: ``[B, T, H, K]``; ``v``: ``[B, T, HV, V]`` with ``HV % H == 0`` (GVA: value head
  ``j`` reads key/query head ``j // (HV // H)``, i.e. ``repeat_interleave`` of q/k).
* ``g``: ``[B, T, HV]`` log-space decay (state is multiplied by ``exp(g)``), ``beta``: ``[B, T, HV]``.
* ``initial_state`` / final state: ``[N, HV, K, V]`` (key-major), always fp32 here.
* ``cu_seqlens``: ``[N+1]`` varlen offsets; then ``B`` must be 1 and ``N`` sequences are packed.

Recurrence per value head (state ``S`` is ``[K, V]``)::

    S   <- exp(g_t) * S
    u_t  = beta_t * (v_t - S^T k_t)
    S   <- S + k_t u_t^T
    o_t  = S^T (scale * q_t)

Also the depthwise causal conv1d (kernel 4 in Qwen4Exp) that feeds q/k/v, with explicit state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "l2norm",
    "gdn_recurrent_reference",
    "gdn_chunk_reference",
    "causal_conv1d_reference",
    "causal_conv1d_update_reference",
]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla / transformers L2 norm: ``x * rsqrt(sum(x^2) + eps)`` (eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """Validate shapes, move to fp32, expand GVA heads, normalise and scale q."""
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    HV = v.shape[2]
    if v.shape[:2] != (B, T) or HV % H != 0:
        raise ValueError(f"v must be [B, T, HV, V] with HV % H == 0, got {tuple(v.shape)} for H={H}")
    if g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(f"g and beta must be [B, T, HV]={B, T, HV}, got {tuple(g.shape)}, {tuple(beta.shape)}")
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        # Normalise before the GVA expansion: identical result, fewer rows.
        q, k = l2norm(q), l2norm(k)
    if HV != H:
        q = q.repeat_interleave(HV // H, dim=2)
        k = k.repeat_interleave(HV // H, dim=2)
    scale = K**-0.5 if scale is None else scale
    return q * scale, k, v, g, beta


def _segments(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every sequence; varlen packs them along T of row 0."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    if B != 1:
        raise ValueError(f"batch size must be 1 when cu_seqlens is given, got {B}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != T or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds} does not partition T={T}")
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _initial_states(initial_state, n, HV, K, V, device):
    if initial_state is None:
        return torch.zeros(n, HV, K, V, dtype=torch.float32, device=device)
    if initial_state.shape != (n, HV, K, V):
        raise ValueError(f"initial_state must be {(n, HV, K, V)}, got {tuple(initial_state.shape)}")
    return initial_state.float()


def gdn_recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token gated delta rule (mirrors ``fused_recurrent_gated_delta_rule``).

    Returns ``o`` ``[B, T, HV, V]`` in ``q.dtype`` and the fp32 final state ``[N, HV, K, V]``
    (or ``None`` unless ``output_final_state``). Works for any T, including decode (T=1).
    """
    B, T = q.shape[:2]
    K, V = q.shape[-1], v.shape[-1]
    HV = v.shape[2]
    qs, ks, vs, gs, bs = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    segs = _segments(B, T, cu_seqlens)
    states = _initial_states(initial_state, len(segs), HV, K, V, q.device)
    out = torch.zeros(B, T, HV, V, dtype=torch.float32, device=q.device)
    finals = []
    for n, (b, start, end) in enumerate(segs):
        S = states[n].clone()  # [HV, K, V]
        for t in range(start, end):
            S = S * gs[b, t].exp()[:, None, None]
            pred = torch.einsum("hkv,hk->hv", S, ks[b, t])
            u = bs[b, t][:, None] * (vs[b, t] - pred)
            S = S + ks[b, t][:, :, None] * u[:, None, :]
            out[b, t] = torch.einsum("hkv,hk->hv", S, qs[b, t])
        finals.append(S)
    final = torch.stack(finals) if output_final_state else None
    return out.to(q.dtype), final


def _chunk_scan(q, k, v, g, beta, S, chunk_size):
    """One sequence, fp32, head-major ``[HV, T, *]``; returns (o [HV, T, V], final S)."""
    HV, T, _ = q.shape
    out = torch.empty(HV, T, v.shape[-1], dtype=torch.float32, device=q.device)
    for c0 in range(0, T, chunk_size):
        c1 = min(c0 + chunk_size, T)
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1]
        gamma = g[:, c0:c1].cumsum(-1)  # log decay from chunk start through t (inclusive)
        L = c1 - c0
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        # decay[t, s] = exp(gamma_t - gamma_s) for s <= t, 0 above the diagonal (mask before exp).
        decay = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        # Unrolled within the chunk the written values u satisfy
        #   u_t + beta_t * sum_{s<t} decay[t,s] (k_t.k_s) u_s = beta_t (v_t - exp(gamma_t) S0^T k_t),
        # a unit lower-triangular system.
        A = (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        eye = torch.eye(L, dtype=torch.float32, device=q.device)
        rhs = bc[:, :, None] * (vc - gamma.exp()[:, :, None] * (kc @ S))
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        # o_t = exp(gamma_t) S0^T q_t + sum_{s<=t} decay[t,s] (q_t.k_s) u_s
        attn = (qc @ kc.transpose(-1, -2)) * decay
        out[:, c0:c1] = gamma.exp()[:, :, None] * (qc @ S) + attn @ u
        # S_end = exp(gamma_L) S0 + sum_s exp(gamma_L - gamma_s) k_s u_s^T
        tail = (gamma[:, -1:] - gamma).exp()
        S = gamma[:, -1].exp()[:, None, None] * S + (kc * tail[:, :, None]).transpose(-1, -2) @ u
    return out, S


def gdn_chunk_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked (WY / UT-transform) gated delta rule (mirrors ``chunk_gated_delta_rule``).

    Same inputs/outputs as :func:`gdn_recurrent_reference`; the sequence is processed in blocks of
    ``chunk_size`` with a triangular solve per block. The last block may be short (no padding).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    B, T = q.shape[:2]
    K, V = q.shape[-1], v.shape[-1]
    HV = v.shape[2]
    qs, ks, vs, gs, bs = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    segs = _segments(B, T, cu_seqlens)
    states = _initial_states(initial_state, len(segs), HV, K, V, q.device)
    out = torch.zeros(B, T, HV, V, dtype=torch.float32, device=q.device)
    finals = []
    for n, (b, start, end) in enumerate(segs):
        sl = slice(start, end)
        o, S = _chunk_scan(
            qs[b, sl].transpose(0, 1),
            ks[b, sl].transpose(0, 1),
            vs[b, sl].transpose(0, 1),
            gs[b, sl].transpose(0, 1),
            bs[b, sl].transpose(0, 1),
            states[n].clone(),
            chunk_size,
        )
        out[b, sl] = o.transpose(0, 1)
        finals.append(S)
    final = torch.stack(finals) if output_final_state else None
    return out.to(q.dtype), final


def conv1d_arguments(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
                     activation: str | None, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks every causal conv1d makes of its arguments (the Triton kernel's host side too):
    x [B, C, T], weight [C, W] or [C, 1, W], conv_state [num_seqs, C, S >= W-1] or None ->
    (weight [C, W], conv_state; zeros [num_seqs, C, W-1] in x.dtype for None)."""
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    C, W = weight.shape
    if x.shape[1] != C:
        raise ValueError(f"x has {x.shape[1]} channels, weight has {C}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    if conv_state is None:
        conv_state = torch.zeros(num_seqs, C, W - 1, dtype=x.dtype, device=x.device)
    if conv_state.shape[:2] != (num_seqs, C) or conv_state.shape[-1] < W - 1:
        raise ValueError(f"conv_state must be [{num_seqs}, {C}, >= {W - 1}], got {tuple(conv_state.shape)}")
    return weight, conv_state


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d over a chunk that continues from ``conv_state``.

    Layout follows Dao's ``causal_conv1d``: ``x`` ``[B, C, T]``, ``weight`` ``[C, W]`` (or the
    ``nn.Conv1d`` ``[C, 1, W]``), ``conv_state`` ``[N, C, S]`` holding the previous ``S >= W-1``
    inputs, oldest first (``None``: zeros, ``S = W-1``; transformers keeps ``S = W``, which the
    conv cannot see past). With ``cu_seqlens`` ``B`` must be 1 and sequences are packed along T.

    ``y[t] = act(bias + sum_j weight[:, j] * x_ext[t + j])`` over the state-extended input.
    Returns ``y`` ``[B, C, T]`` in ``x.dtype`` and the new state (the last ``S`` inputs of
    state ++ chunk) in the state's dtype. Computed in fp32.
    """
    B, _, T = x.shape
    segs = _segments(B, T, cu_seqlens)
    weight, conv_state = conv1d_arguments(x, weight, conv_state, activation, len(segs))
    C, W = weight.shape
    S = conv_state.shape[-1]
    w = weight.float()[:, None, :]
    y = torch.empty(B, C, T, dtype=torch.float32, device=x.device)
    new_states = []
    for n, (b, start, end) in enumerate(segs):
        ext = torch.cat([conv_state[n].float(), x[b, :, start:end].float()], dim=-1)  # [C, S + L]
        # Only the last W-1 state columns can reach the chunk.
        out = F.conv1d(ext[None, :, S - (W - 1):], w, bias=None if bias is None else bias.float(), groups=C)[0]
        y[b, :, start:end] = out
        new_states.append(ext[:, -S:])
    if activation is not None:
        y = F.silu(y)
    return y.to(x.dtype), torch.stack(new_states).to(conv_state.dtype)


def causal_conv1d_update_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode-step conv: ``x`` ``[B, C]`` (one token) or ``[B, C, T]`` (a few, e.g. spec tokens).

    Argument order mirrors ``causal_conv1d_update``; returns ``(y, new_state)`` instead of
    updating in place (y has the shape of ``x``).
    """
    squeeze = x.dim() == 2
    x3 = x[:, :, None] if squeeze else x
    y, new_state = causal_conv1d_reference(x3, weight, bias, conv_state, activation)
    return (y[:, :, 0] if squeeze else y), new_state
