"""Plain-torch references of the decoder's small per-token ops, which the Triton kernels in
triton_fused.py fuse. They are also the CPU path of the layers, so the arithmetic (and the order of
its casts) is exactly the one the CPU tests compare against transformers:

* RMSNorm: ``(weight.float() * (x.float() * rsqrt(mean(x.float()^2) + eps))).to(x.dtype)``;
  the residual form adds first, in the input dtype, and that rounded sum is the next residual.
* RoPE, rotate-half layout (HF Llama/Qwen): the first ``rotary_dim`` channels of each head split
  in two halves x1, x2 -> (x1*cos - x2*sin, x2*cos + x1*sin) in float32, cast back once.
* SiLU(gate) * up on the fused gate_up output ``[T, 2I]`` (gate first), each op in the input
  dtype as ``F.silu(gate) * up`` rounds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, math in float32, result in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def grouped_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int) -> torch.Tensor:
    """Qwen4Exp's 1-centred RMSNorm with one RMS per `group_size` features (the weight spans the
    full width): fp32 `norm(x) * (1 + weight)`, cast back to x's dtype."""
    xf = x.float().unflatten(-1, (-1, group_size))
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (out * (1.0 + weight.float())).to(x.dtype)


def rms_norm_one_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen4Exp RMSNorm: fp32 ``x * rsqrt(mean(x^2) + eps) * (1 + weight)``, cast back to ``x.dtype``."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


def one_centred_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                                   group_size: int | None = None) -> torch.Tensor:
    """`rms_norm_one_centred`, or with group_size `grouped_rms_norm_reference` (as
    ``Qwen4ExpTextRMSNorm(dim, group_size=hidden_size)``)."""
    if group_size is None:
        return rms_norm_one_centred(x, weight, eps)
    return grouped_rms_norm_reference(x, weight, eps, group_size)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the block output joins the residual stream, which
    is normalised for the next block and kept as the next residual."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def rope_reference(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> a rotated copy. cos/sin: float32 tables [max_positions, rotary_dim / 2];
    channels past rotary_dim are kept as they are."""
    rotary_dim = 2 * cos.shape[-1]
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return torch.cat((rotated, rest), dim=-1) if rest.numel() else rotated


def rope_qk_reference_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hk, D] in place (the contract of the fused kernel); returns them."""
    q.copy_(rope_reference(q, positions, cos, sin))
    k.copy_(rope_reference(k, positions, cos, sin))
    return q, k


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> SiLU(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def norm_rope_heads_reference(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              eps: float) -> torch.Tensor:
    """Qwen4Exp's per-head q/k path: 1-centred RMSNorm (rms_norm_one_centred) then partial
    rotate-half RoPE (qsa_indexer.reference.apply_partial_rope) with cos/sin [T, rot] in x's dtype."""
    from qsaserve.ops.qsa_indexer.reference import apply_partial_rope  # imported here: that module imports this one

    return apply_partial_rope(rms_norm_one_centred(x, weight, eps), cos[:, None], sin[:, None])


def sigmoid_gated_add_reference(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + sigmoid(gate) * y, gate [N, 1] (one per row): the MoE block's routed + gated shared expert."""
    return x + torch.sigmoid(gate) * y
