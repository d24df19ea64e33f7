"""Fused per-token ops of the decoder layers: RMSNorm (with the residual add), RoPE on q and k,
SiLU*up, Qwen4Exp's 1-centred (grouped) RMSNorm, its per-head norm + RoPE and the MoE block's
gated add.

Each function runs its Triton kernel (triton_fused.py) where `ops.dispatch.use_triton` says so
(CUDA tensors, kernels on) and its plain-torch reference (reference.py) elsewhere: the CPU path,
which is the exact arithmetic the CPU tests compare to transformers."""
from __future__ import annotations

import torch

from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.fused.reference import (add_rms_norm_reference, grouped_rms_norm_reference,
                                          norm_rope_heads_reference, one_centred_rms_norm_reference,
                                          rms_norm_one_centred, rms_norm_reference, rope_qk_reference_,
                                          rope_reference, sigmoid_gated_add_reference, silu_mul_reference)

try:  # CPU-only installs keep the references
    from qsaserve.ops.fused import triton_fused
except ImportError:
    triton_fused = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, D] or [N, H, D] -> weight * norm(x) over the last dim, in x's dtype."""
    if use_triton(x):
        return triton_fused.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [N, D] -> (rms_norm(x + residual), x + residual): the sum is the next residual."""
    if use_triton(x):
        return triton_fused.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), or (norm(x), x) when residual is None (a model's first
    block): the normed input and the next residual."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    return add_rms_norm(x, residual, weight, eps)


def rope_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] at positions [T], cos/sin fp32 tables [max_positions, rot / 2]
    -> rotated (q, k). The kernel rotates in place (views into the qkv output included) and returns
    q and k; the reference returns new tensors: use the result."""
    if use_triton(q):
        return triton_fused.rope_qk_(q, k, positions, cos, sin)
    return rope_reference(q, positions, cos, sin), rope_reference(k, positions, cos, sin)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate | up) -> SiLU(gate) * up [T, I]."""
    if use_triton(x):
        return triton_fused.silu_mul(x)
    return silu_mul_reference(x)


def one_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                         group_size: int | None = None) -> torch.Tensor:
    """Qwen4Exp's RMSNorm: fp32 norm(x) * (1 + weight), in x's dtype. x [..., width]; with
    group_size, one RMS per group_size features (weight over the full width). The kernel covers the
    grouped form of a unit-stride x."""
    if group_size is not None and use_triton(x) and x.stride(-1) == 1:
        return triton_fused.grouped_rms_norm(x, weight, eps, group_size)
    return one_centred_rms_norm_reference(x, weight, eps, group_size)


def norm_rope_heads(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """x [T, H, D] -> per head 1-centred RMSNorm, then partial rotate-half RoPE on the first
    cos.shape[-1] dims (cos/sin [T, rot] in x's dtype): Qwen4Exp's q, k and index-q path."""
    if use_triton(x):
        return triton_fused.norm_rope_heads(x, weight, cos, sin, eps)
    return norm_rope_heads_reference(x, weight, cos, sin, eps)


def sigmoid_gated_add(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, y [N, H], gate [N, 1] -> x + sigmoid(gate) * y (routed + gated shared expert)."""
    if use_triton(x):
        return triton_fused.sigmoid_gated_add(x, y, gate)
    return sigmoid_gated_add_reference(x, y, gate)


__all__ = ["add_rms_norm", "norm_rope_heads", "one_centred_rms_norm", "rms_norm", "rms_norm_residual", "rope_qk", "sigmoid_gated_add",
           "silu_mul", "triton_fused", "add_rms_norm_reference", "grouped_rms_norm_reference",
           "norm_rope_heads_reference", "one_centred_rms_norm_reference", "rms_norm_one_centred",
           "rms_norm_reference", "rope_qk_reference_", "rope_reference", "sigmoid_gated_add_reference",
           "silu_mul_reference"]
