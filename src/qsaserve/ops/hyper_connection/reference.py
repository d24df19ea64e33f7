"""One hyper-connection step of a Qwen4Exp decoder, in plain torch (the reference, and the CPU path).

Between two blocks the residual `hyper` [T, hc * H] takes the previous block's output (each stream
s adds inject[s] * out) and is mixed down to the next block's input: a grouped 1-centred RMSNorm,
a low-rank gate per stream, and a mean over the streams; the same normed residual gives the next
injection weights: `hc_inject` then `hc_gated_residual` (the model's own functions, here).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qsaserve.ops.fused.reference import grouped_rms_norm_reference


def hc_step_reference(hyper: torch.Tensor, block_out: torch.Tensor | None, inject: torch.Tensor | None,
                      norm_weight: torch.Tensor, down_weight: torch.Tensor, up_weight: torch.Tensor,
                      inject_weight: torch.Tensor | None, hc_count: int, eps: float):
    """-> (new hyper, mixed block input [T, H], next injection weights [T, hc] or None).
    block_out / inject None: nothing to add (the first block); inject_weight None: the final mixer."""
    if block_out is not None:
        hyper = hc_inject(hyper, block_out, inject)
    mixed, next_inject = hc_gated_residual(hyper, norm_weight, down_weight, up_weight, inject_weight, hc_count, eps)
    return hyper, mixed, next_inject


def hc_gated_residual(
    hyper: torch.Tensor,
    hc_norm_weight: torch.Tensor,
    input_mix_weight_down: torch.Tensor,
    input_mix_weight_up: torch.Tensor,
    block_inject_weight: torch.Tensor | None,
    hc_count: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``Qwen4ExpTextGatedResidual``: collapse ``hc_count`` streams into one block input.

    ``hyper`` ``[..., hc_count * H]``. Returns the mixed input ``[..., H]`` and (unless
    ``block_inject_weight`` is None, as in the final ``hyper_connection_mixer``) the per-stream
    injection weights ``[..., hc_count]`` for :func:`hc_inject`::

        xn  = grouped_rms_norm(hyper)                       # 1-centred hc_norm, groups of H
        mix = sigmoid(up(silu(down(xn) / hc)))              # [..., hc, H]
        out = mean_over_streams(mix * xn)                   # [..., H]
        inj = 2 * sigmoid(block_inject(xn) / hc)            # [..., hc]
    """
    H = hyper.shape[-1] // hc_count
    xn = grouped_rms_norm_reference(hyper, hc_norm_weight, eps, H)
    mix = F.silu(F.linear(xn, input_mix_weight_down) / hc_count)
    mix = torch.sigmoid(F.linear(mix, input_mix_weight_up)).unflatten(-1, (hc_count, H))
    mixed = (mix * xn.unflatten(-1, (hc_count, H))).mean(dim=-2)
    if block_inject_weight is None:
        return mixed, None
    inject = 2 * torch.sigmoid(F.linear(xn, block_inject_weight) / hc_count)
    return mixed, inject


def hc_inject(hyper: torch.Tensor, block_out: torch.Tensor, injection_weights: torch.Tensor) -> torch.Tensor:
    """Residual update: stream ``s`` += ``injection_weights[..., s] * block_out`` (un-normalised ``hyper``)."""
    return hyper + (block_out.unsqueeze(-2) * injection_weights.unsqueeze(-1)).flatten(-2)
