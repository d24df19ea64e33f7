"""Applying per-head transforms (the FP8 KV head rotations that quant/kv_rotation.py builds): each
head's D-wide slice times a [D, D] matrix, shared or one per KV head. At run time to q and k
(`rotate_qk`: one fused Triton kernel on CUDA, ops/fused; the float32 references below elsewhere);
once at load into a projection's weights (`fold_into_rows`, `fold_into_columns`)."""
from __future__ import annotations

import torch

from qsaserve.ops import fused
from qsaserve.ops.dispatch import use_triton


def rotate_heads(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Each head_dim-wide slice of x's last dimension (heads flattened or not) times `rotation`
    [D, D] float32; same shape and dtype as x. The product is taken in float32: 1/sqrt(D) is not
    a bfloat16 number at D = 128, and H @ H would then be 0.9998 I, a small temperature change on
    every score and a scale on every output."""
    d = rotation.shape[0]
    return (x.unflatten(-1, (-1, d)).float() @ rotation).flatten(-2).to(x.dtype)


def transform_heads(x: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with head h times matrices[h // (H / Hm)] ([Hm, D, D] float32: one matrix per KV
    head, which a group of query heads shares; [D, D]: one for all). Float32 products, one rounding
    to x's dtype, like rotate_heads."""
    if matrices.dim() == 2:
        return rotate_heads(x, matrices)
    if x.shape[1] % matrices.shape[0]:
        raise ValueError(f"transform_heads: {x.shape[1]} heads do not group over {matrices.shape[0]} matrices "
                         f"{tuple(matrices.shape)}")
    group = x.shape[1] // matrices.shape[0]
    return torch.einsum("thd,hde->the", x.float(), matrices.repeat_interleave(group, 0)).to(x.dtype)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, q_matrix: torch.Tensor, k_matrix: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """transform_heads of q [T, Hq, D] by q_matrix and of k [T, Hk, D] by k_matrix (both [D, D], or
    [Hk, D, D] per KV head). On CUDA one fused kernel transforms both in place (views into the qkv
    output included; ops/fused); elsewhere new tensors come back."""
    if use_triton(q) and q.shape[-1] >= 16:
        if q_matrix.dim() == 2 and q_matrix is k_matrix:
            return fused.triton_fused.head_rotate_qk_(q, k, q_matrix)
        return fused.triton_fused.head_transform_qk_(q, k, q_matrix, k_matrix)
    return transform_heads(q, q_matrix), transform_heads(k, k_matrix)


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


__all__ = ["fold_into_columns", "fold_into_rows", "rotate_heads", "rotate_qk", "transform_heads"]
