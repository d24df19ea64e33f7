"""Torch references of the NVFP4-weight linear op (ModelOpt's layout), the contract of
triton_gemm.py: dequantize, then one float32 matmul rounded once to the output dtype (W4A16: the
activations are not quantized; Hopper has no FP4 tensor cores).

A weight is `packed` uint8 [N, K/2] (two E2M1 codes a byte, the even column in the low nibble),
`scale` E4M3 [N, K/16] (one per 16 columns) and `row_scale` float32 [N] (ModelOpt's per-tensor
`weight_scale_2`, repeated over the rows of each tensor a fused projection packs):
W[n, k] = e2m1(code[n, k]) * scale[n, k // 16] * row_scale[n]."""
from __future__ import annotations

import torch

GROUP = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; bit 3 is the sign
E2M1_MAX = 6.0
E4M3_MAX = 448.0


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> float32 [N, K] E2M1 values."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    return table[codes.long()]


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """-> float32 [N, K]."""
    values = unpack_e2m1(packed)
    return values * scale.float().repeat_interleave(GROUP, 1)[:, : values.shape[1]] * row_scale.float()[:, None]


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float (K a multiple of 16) -> (packed uint8 [N, K/2], scale E4M3 [N, K/16], global
    float32 scalar): ModelOpt's recipe, global = amax / (6 * 448), each group's scale its amax / 6
    in units of the global, values rounded to the nearest E2M1 (ties away from zero)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"quantize_nvfp4: K must be a multiple of {GROUP}, got {k}")
    w = w.float()
    glob = (w.abs().amax() / (E2M1_MAX * E4M3_MAX)).clamp_min(1e-12)
    groups = w.view(n, k // GROUP, GROUP)
    scale = (groups.abs().amax(-1) / E2M1_MAX / glob).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    unit = (scale.float() * glob).clamp_min(1e-12)[..., None]
    x = (groups / unit).clamp(-E2M1_MAX, E2M1_MAX)
    grid = torch.tensor(E2M1_VALUES, device=w.device)
    code = (x.abs()[..., None] - grid).abs().argmin(-1) | ((x < 0).to(torch.long) << 3)
    code = code.view(n, k).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), scale, glob.reshape(())


def nvfp4_w4a16_gemm_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                               row_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> x @ W^T [M, N] in x's dtype."""
    return (x.float() @ dequantize_nvfp4(packed, scale, row_scale).t()).to(x.dtype)
