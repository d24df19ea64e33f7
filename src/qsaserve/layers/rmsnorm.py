"""RMSNorm, computed in float32 like the reference models, optionally fused with the residual add.

ops.fused: on CUDA one Triton kernel does the add and the norm; elsewhere the plain-torch
reference runs, with the same order of casts as before the fusion."""
from __future__ import annotations

import torch
from torch import nn

from qsaserve.ops import fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`: (norm(x + residual), x + residual), the sum being the next residual."""
        if residual is None:
            return fused.rms_norm(x, self.weight, self.eps)
        return fused.add_rms_norm(x, residual, self.weight, self.eps)
