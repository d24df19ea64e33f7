"""Rotary position embedding (rotate-half layout, as in HF Llama/Qwen), with llama3 and linear scaling.

On CUDA, q and k are rotated in place by one Triton kernel (ops/fused); elsewhere by the
plain-torch reference."""
from __future__ import annotations

import math

import torch
from torch import nn

from qsaserve.ops import fused


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    # float32 throughout, as HF computes it, so positions far out round the same way.
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"rope_scaling: unsupported rope_type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, max_positions: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = rope_inv_freq(rotary_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] -> a copy with the first rotary_dim channels of every head rotated."""
        return fused.rope_reference(x, positions, self.cos, self.sin)

    def rotate_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated q [T, Hq, D] and k [T, Hk, D]. On CUDA they are rotated in place (views into the
        qkv output included) and returned; elsewhere new tensors come back."""
        return fused.rope_qk(q, k, positions, self.cos, self.sin)
