"""Plain-torch references of block-FP8 routed experts (DeepSeek / Qwen block-FP8 checkpoints):
E4M3 weights with one float32 `weight_scale_inv` per 128 x 128 block, activations quantized at
run time to E4M3 per token and group of 128 channels. What the grouped GEMMs' FP8 form
(triton_grouped.py, FP8=True) is tested against, and the CPU path."""
from __future__ import annotations

import torch

from qsaserve.ops.moe.reference import moe_experts_dequantized

GROUP = 128  # the checkpoint's weight_block_size and the activations' group
E4M3_MAX = 448.0
SCALE_EPS = 1e-10  # an all-zero group gets a tiny scale, not 0/0

__all__ = ["GROUP", "dequantize_blocks", "fake_quantize_groups", "moe_experts_block_fp8", "quantize_blocks",
           "quantize_groups"]


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (E4M3 [..., K], float32 scales [..., ceil(K / 128)]): each group of 128
    channels (the last one possibly shorter) scaled so that its largest magnitude is 448."""
    k = x.shape[-1]
    groups = -(-k // GROUP)
    xf = torch.nn.functional.pad(x.float(), (0, groups * GROUP - k)).unflatten(-1, (groups, GROUP))
    scale = xf.abs().amax(-1).clamp(min=SCALE_EPS) / E4M3_MAX
    q = (xf / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., :k], scale


def fake_quantize_groups(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> float32 [..., K]: quantize_groups then dequantize (what an FP8 GEMM sees)."""
    q, scale = quantize_groups(x)
    return q.float() * scale.repeat_interleave(GROUP, -1)[..., : x.shape[-1]]


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (E4M3 [..., N, K], float32 weight_scale_inv [..., ceil(N/128), ceil(K/128)]):
    each 128 x 128 block scaled so that its largest magnitude is 448, as block-FP8 checkpoints
    store weights (dequantize_blocks inverts it up to E4M3 rounding)."""
    n, k = w.shape[-2:]
    gn, gk = -(-n // GROUP), -(-k // GROUP)
    padded = torch.nn.functional.pad(w.float(), (0, gk * GROUP - k, 0, gn * GROUP - n))
    blocks = padded.unflatten(-1, (gk, GROUP)).unflatten(-3, (gn, GROUP))  # [..., gn, 128, gk, 128]
    scale = blocks.abs().amax((-3, -1)).clamp(min=SCALE_EPS) / E4M3_MAX
    q = (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).flatten(-4, -3).flatten(-2)
    return q[..., :n, :k].to(torch.float8_e4m3fn), scale


def dequantize_blocks(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 w [..., N, K] with scale [..., ceil(N / 128), ceil(K / 128)] -> float32 [..., N, K]."""
    n, k = w.shape[-2:]
    if scale.shape[-2:] != (-(-n // GROUP), -(-k // GROUP)):
        raise ValueError(f"scale: expected [..., {-(-n // GROUP)}, {-(-k // GROUP)}] for weights [..., {n}, {k}], "
                         f"got {list(scale.shape)}")
    full = scale.float().repeat_interleave(GROUP, -2).repeat_interleave(GROUP, -1)[..., :n, :k]
    return w.float() * full


def moe_experts_block_fp8(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
                          down_proj: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                          activation: str = "silu", sync_free: bool = False) -> torch.Tensor:
    """`reference.moe_experts` on block-FP8 experts: gate_up_proj [E, 2I, H] and down_proj
    [E, H, I] in E4M3, w13_scale [E, ceil(2I/128), ceil(H/128)], w2_scale [E, ceil(H/128), ceil(I/128)].

    Each GEMM dequantizes its weights, fake-quantizes its input per token-group of 128 and runs in
    float32; the GEMM outputs, the activation, the product and the weighted rows are rounded to
    x's dtype, and the k rows summed in float32. sync_free: loop over all E experts with
    zero weights for the tokens that did not choose them (no host read of the routing)."""
    return moe_experts_dequantized(
        x, indices, weights, gate_up_proj.shape[0],
        lambda e: (dequantize_blocks(gate_up_proj[e], w13_scale[e]), dequantize_blocks(down_proj[e], w2_scale[e])),
        activation, sync_free, round_input=fake_quantize_groups)
