"""SwiGLU activation on the fused gate_up projection: [T, 2I] (gate | up) -> SiLU(gate) * up.

On CUDA one Triton kernel reads both halves in place (ops/fused); elsewhere F.silu(gate) * up."""
from __future__ import annotations

import torch
from torch import nn

from qsaserve.ops import fused


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.use_fused(x):
            return fused.triton_fused.silu_mul(x)
        return fused.silu_mul_reference(x)
