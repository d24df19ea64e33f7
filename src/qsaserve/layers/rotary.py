"""Rotary position embedding (rotate-half layout, as in HF Llama/Qwen), with llama3 and linear scaling.

On CUDA, q and k are rotated in place by one Triton kernel (ops/fused); elsewhere by the
plain-torch reference."""
from __future__ import annotations

import torch
from torch import nn

from qsaserve.ops import fused
from qsaserve.ops.rope import rope_inv_freq


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
