"""Plain-torch references of NVFP4 routed experts (ModelOpt's layout, ops/nvfp4_gemm/reference.py,
per expert), run as W4A16: what the grouped GEMMs' NVFP4 form (triton_grouped.py) is tested
against, and the CPU path.

An expert matrix [N, K] is `packed` uint8 [N, K/2] (two E2M1 codes a byte, the even column in
the low nibble), `scale` E4M3 [N, K/16] and `row_scale` float32 [N] (the checkpoint tensor's
`weight_scale_2`, repeated over its rows: gate and up of one expert keep their own):
W[n, k] = e2m1(code[n, k]) * scale[n, k // 16] * row_scale[n]. Stacked over E experts:
gate_up_proj [E, 2I, H/2] with w13_scale [E, 2I, H/16] and w13_row_scale [E, 2I]; down_proj
[E, H, I/2] with w2_scale [E, H, I/16] and w2_row_scale [E, H]. The activations stay in their
dtype (bf16): no activation quantization."""
from __future__ import annotations

import torch

from qsaserve.ops.moe.reference import moe_experts_dequantized
from qsaserve.ops.nvfp4_gemm.reference import GROUP, dequantize_nvfp4, quantize_nvfp4

__all__ = ["GROUP", "dequantize_experts", "moe_experts_nvfp4", "quantize_experts"]


def quantize_experts(w: torch.Tensor, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [E, N, K] float -> (packed uint8 [E, N, K/2], scale E4M3 [E, N, K/16], row_scale float32
    [E, N]), each expert's `parts` equal row ranges (2: gate and up) quantized as their own
    checkpoint tensors (ModelOpt's recipe, ops.nvfp4_gemm.quantize_nvfp4: one global scale each)."""
    packed, scale, rows = [], [], []
    for expert in w:
        for part in expert.chunk(parts):
            p, s, g = quantize_nvfp4(part)
            packed.append(p)
            scale.append(s)
            rows.append(g.expand(part.shape[0]))
    e, n = w.shape[:2]
    return (torch.cat(packed).view(e, n, -1), torch.cat(scale).view(e, n, -1),
            torch.cat(rows).view(e, n).contiguous())


def dequantize_experts(packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """[E, N, K/2], [E, N, K/16], [E, N] -> float32 [E, N, K] (or one expert's [N, ...] -> [N, K])."""
    if packed.dim() == 2:
        return dequantize_nvfp4(packed, scale, row_scale)
    return torch.stack([dequantize_nvfp4(p, s, r) for p, s, r in zip(packed, scale, row_scale)])


def moe_experts_nvfp4(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
                      down_proj: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                      w13_row_scale: torch.Tensor, w2_row_scale: torch.Tensor, activation: str = "silu",
                      sync_free: bool = False) -> torch.Tensor:
    """`reference.moe_experts` on NVFP4 experts (layout above): each chosen expert's weights
    dequantized to float32, then the reference MoE (reference.moe_experts_dequantized: float32
    GEMMs on the unquantized activations, each GEMM's output, the activation, the product and the
    weighted rows rounded to x's dtype). sync_free: every expert, zero-weighted where not chosen
    (no host read of the routing)."""
    return moe_experts_dequantized(
        x, indices, weights, gate_up_proj.shape[0],
        lambda e: (dequantize_nvfp4(gate_up_proj[e], w13_scale[e], w13_row_scale[e]),
                   dequantize_nvfp4(down_proj[e], w2_scale[e], w2_row_scale[e])),
        activation, sync_free)
