"""RoPE inverse frequencies: the one derivation behind every rotary table, with the Llama-family
scaling rules (layers/rotary.py builds its cos/sin tables from it; Qwen4Exp's partial rotary,
ops/qsa_indexer/reference.rope_inv_freq, calls it with the rotated width)."""
from __future__ import annotations

import math

import torch


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """[rotary_dim / 2] float32 inverse frequencies base^(-2i / rotary_dim), then the checkpoint's
    rope_scaling (None, "default", "linear" or "llama3")."""
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


__all__ = ["rope_inv_freq"]
