"""Qwen4Exp's sparse MoE routing and routed experts, dispatched (`ops.dispatch.use_triton`):

* `moe_route`: the one-kernel router (softmax, top-k, renormalisation) on CUDA, else the reference.
* `moe_experts_sync_free`: the in-place decode kernels (triton_moe.py) on CUDA for SiLU experts
  when the step has fewer token-choices than experts, else the torch reference (reference.py).
* `moe_experts`, `moe_router`: references only (the routing is read back to the host)."""
from __future__ import annotations

import torch

from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.moe import reference
from qsaserve.ops.moe.reference import moe_experts, moe_router

try:  # CPU-only installs keep the reference
    from qsaserve.ops.moe import triton_moe
except ImportError:
    triton_moe = None


def moe_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, expert indices [N, k])."""
    if use_triton(logits):
        return triton_moe.moe_route_triton(logits, top_k, norm_topk_prob)
    return reference.moe_route(logits, top_k, norm_topk_prob)


def moe_experts_sync_free(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
                          down_proj: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """x [N, H], indices / weights [N, k], gate_up_proj [E, 2I, H], down_proj [E, H, I] -> [N, H]:
    the routed experts without host syncs (decode steps, CUDA graphs)."""
    num_experts = gate_up_proj.shape[0]
    if use_triton(x) and activation in ("silu", "swish") and indices.numel() < num_experts:
        return triton_moe.moe_experts_decode_triton(x, indices, weights.to(x.dtype), gate_up_proj, down_proj)
    return reference.moe_experts_sync_free(x, indices, weights, gate_up_proj, down_proj, activation)


__all__ = ["moe_experts", "moe_experts_sync_free", "moe_route", "moe_router"]
