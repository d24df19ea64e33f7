"""A Qwen4Exp hyper-connection step (inject the previous block's output, mix down to the next
block's input): `hc_step` runs the Triton kernels (triton_hc.py) for 2-D streams where
`ops.dispatch.use_triton` says so, the torch reference elsewhere."""
from __future__ import annotations

import torch

from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.hyper_connection.reference import hc_gated_residual, hc_inject, hc_step_reference

try:  # CPU-only installs keep the reference
    from qsaserve.ops.hyper_connection import triton_hc
except ImportError:
    triton_hc = None


def hc_step(hyper: torch.Tensor, block_out: torch.Tensor | None, inject: torch.Tensor | None,
            norm_weight: torch.Tensor, down_weight: torch.Tensor, up_weight: torch.Tensor,
            inject_weight: torch.Tensor | None, hc_count: int, eps: float):
    """hyper [T, hc * H] (+ block_out [T, H] weighted per stream by inject [T, hc]) -> (new hyper,
    mixed block input [T, H], next injection weights [T, hc] or None); see reference.py."""
    fn = triton_hc.hc_step_triton if use_triton(hyper) and hyper.dim() == 2 else hc_step_reference
    return fn(hyper, block_out, inject, norm_weight, down_weight, up_weight, inject_weight, hc_count, eps)


__all__ = ["hc_gated_residual", "hc_inject", "hc_step", "hc_step_reference"]
