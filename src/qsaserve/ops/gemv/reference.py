"""The torch reference of triton_gemv.gemv: F.linear with fp32 accumulation, rounded once."""
from __future__ import annotations

import torch


def gemv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K], weight [N, K] -> x @ weight^T [M, N] in x's dtype (fp32 sums)."""
    return (x.float() @ weight.float().t()).to(x.dtype)
