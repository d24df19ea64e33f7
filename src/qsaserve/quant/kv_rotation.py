"""Hadamard rotation of attention heads around an FP8 KV cache (`kv_rotation="hadamard"`).

q.k is unchanged when both sides are multiplied by the same orthogonal matrix, and so is the
attention output once it is multiplied back. With H the normalized Sylvester-Hadamard matrix of
the head dimension (symmetric, H @ H = I), the layer stores K H and V H and attends with Q H:

    softmax((Q H)(K H)^T) (V H) H = softmax(Q K^T) V

E4M3 keeps a relative precision of 2^-4 per element, so the error of q.k is dominated by the
channels where both q and k are large. Keys have such channels (a fixed bias, RoPE's slow pairs);
H spreads every channel over all of them, so no product dominates and the same 8 bits lose less.
On SmolLM2 over held-out text (benchmarks/fp8_quality.py) this lowers the mean KL divergence to
the bfloat16-KV model by ~30% at calibrated scales; see docs/fp8.md.

V and the output need no work at run time: V H = x (H W_v)^T and (O H) W_o^T = O (W_o H)^T, so a
model folds H into V's rows of its projection and into the output projection's columns once, at
load (fold_into_rows / fold_into_columns, models/llama.py), and its attention layers rotate only
q and k, which RoPE sits between.

The rotation is part of what a scales file measured (`qsaserve calibrate --kv-rotation hadamard`
records K and V after it), so the file names it and loading checks it. In exact arithmetic it is
the identity, so it only matters for quantized pages; the layers apply it whenever it is set.
"""
from __future__ import annotations

import torch

from qsaserve.ops import fused

KV_ROTATIONS = ("none", "hadamard")


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The n x n Sylvester-Hadamard matrix divided by sqrt(n) (n a power of two): symmetric and
    orthogonal, entries +-1/sqrt(n)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix: n must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dtype=dtype, device=device)


def rotate_heads(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Each head_dim-wide slice of x's last dimension (heads flattened or not) times `rotation`
    [D, D] float32; same shape and dtype as x. The product is taken in float32: 1/sqrt(D) is not
    a bfloat16 number at D = 128, and H @ H would then be 0.9998 I, a small temperature change on
    every score and a scale on every output."""
    d = rotation.shape[0]
    return (x.unflatten(-1, (-1, d)).float() @ rotation).flatten(-2).to(x.dtype)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, rotation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rotate_heads of q [T, Hq, D] and k [T, Hk, D]. On CUDA one fused kernel rotates both in place
    (views into the qkv output included; ops/fused); elsewhere new tensors come back."""
    if fused.use_fused(q) and q.shape[-1] >= 16:
        return fused.triton_fused.head_rotate_qk_(q, k, rotation)
    return rotate_heads(q, rotation), rotate_heads(k, rotation)


def fold_into_rows(weight: torch.Tensor, rotation: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """In place: a projection's output rows, head_dim-wide head blocks ([H*D, K] weight, [H*D]
    bias), now give (x W^T + b) rotated per head. Taken in float32, rounded once."""
    d = rotation.shape[0]
    w = weight.unflatten(0, (-1, d))  # [H, D, K]
    weight.copy_((rotation @ w.float()).flatten(0, 1))  # H symmetric: (x W_h^T) H = x (H W_h)^T
    if bias is not None:
        bias.copy_(rotate_heads(bias.float(), rotation))


def fold_into_columns(weight: torch.Tensor, rotation: torch.Tensor) -> None:
    """In place: a projection reading head_dim-wide head blocks ([N, H*D] weight) now takes them
    rotated per head: (O H) W'^T = O W^T. Taken in float32, rounded once."""
    weight.copy_(rotate_heads(weight.float(), rotation))
