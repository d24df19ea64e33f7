"""One hyper-connection step of a Qwen4Exp decoder, in plain torch (the reference, and the CPU path).

Between two blocks the residual `hyper` [T, hc * H] takes the previous block's output (each stream
s adds inject[s] * out) and is mixed down to the next block's input: a grouped 1-centred RMSNorm,
a low-rank gate per stream, and a mean over the streams; the same normed residual gives the next
injection weights. The math is `qwen4exp_blocks.hc_inject` then `hc_gated_residual`.
"""
from __future__ import annotations

import torch

from qsaserve.models.qwen4exp_blocks import hc_gated_residual, hc_inject


def hc_step_reference(hyper: torch.Tensor, block_out: torch.Tensor | None, inject: torch.Tensor | None,
                      norm_weight: torch.Tensor, down_weight: torch.Tensor, up_weight: torch.Tensor,
                      inject_weight: torch.Tensor | None, hc_count: int, eps: float):
    """-> (new hyper, mixed block input [T, H], next injection weights [T, hc] or None).
    block_out / inject None: nothing to add (the first block); inject_weight None: the final mixer."""
    if block_out is not None:
        hyper = hc_inject(hyper, block_out, inject)
    mixed, next_inject = hc_gated_residual(hyper, norm_weight, down_weight, up_weight, inject_weight, hc_count, eps)
    return hyper, mixed, next_inject
