"""SwiGLU activation on the fused gate_up projection: [T, 2I] (gate | up) -> SiLU(gate) * up.

ops.fused.silu_mul: on CUDA one Triton kernel reads both halves in place; elsewhere F.silu(gate) * up."""
from __future__ import annotations

import torch
from torch import nn

from qsaserve.ops import fused


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.silu_mul(x)
