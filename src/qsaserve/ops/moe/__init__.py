"""Routed-expert decode: `moe_experts_decode` runs the in-place Triton kernels (triton_moe.py) for
CUDA tensors when the fused kernels are on and the step has fewer token-choices than experts;
otherwise `qwen4exp_blocks.moe_experts_sync_free` (the reference)."""
from __future__ import annotations

import torch

from qsaserve.ops import fused

try:  # CPU-only installs keep the reference
    from qsaserve.ops.moe.triton_moe import moe_experts_decode_triton, moe_route_triton
except ImportError:
    moe_experts_decode_triton = moe_route_triton = None


def use_triton_moe(x: torch.Tensor, indices: torch.Tensor, num_experts: int, activation: str) -> bool:
    return (moe_experts_decode_triton is not None and fused.use_fused(x) and activation in ("silu", "swish")
            and indices.numel() < num_experts)


__all__ = ["moe_experts_decode_triton", "moe_route_triton", "use_triton_moe"]
