"""Kernel warm-up shared by the quantized linear layers: their GEMM kernels specialize on the row
count class of the activations, so each layer shape is run once per class at startup and no step
builds a kernel inside a timed or graph-captured region."""
from __future__ import annotations

import torch
from torch import nn

# Row counts whose kernel variants a step may build: the decode kernels' token blocks (16, 32, 64:
# the FP8 W8A8 and NVFP4 W4A16 transposed GEMMs) with and without Triton's divisible-by-16
# specialization, 1, and the prefill GEMM on both sides of 64; 2 and 4 for the decode GEMVs' 2- and
# 4-row variants (3 rows take the 4-row one).
WARM_UP_ROWS = (1, 2, 4, 16, 17, 32, 33, 64, 65, 128)


@torch.no_grad()
def warm_up_row_counts(layer: nn.Module, dtype: torch.dtype) -> int:
    """Runs a quantized linear layer (`in_features`, `weight`) once at each of WARM_UP_ROWS, so that
    every kernel variant a step may take is built; returns the launches made."""
    x = torch.zeros(max(WARM_UP_ROWS), layer.in_features, dtype=dtype, device=layer.weight.device)
    for rows in WARM_UP_ROWS:
        layer(x[:rows])
    return len(WARM_UP_ROWS)


__all__ = ["WARM_UP_ROWS", "warm_up_row_counts"]
