"""Hyper-connections: the residual is hc_count streams [T, hc * H]. Between two blocks a mixer
adds the previous block's output to every stream (by per-stream injection weights) and mixes the
streams down to the next block's input; the final mixer (no injection) feeds the LM head."""
from __future__ import annotations

import torch
from torch import nn

from qsaserve.models.qwen4exp.weights import Weight
from qsaserve.ops.hyper_connection import hc_step


def hc_expand(embeddings: torch.Tensor, hc_count: int) -> torch.Tensor:
    """Initial residual: the token embedding copied into every stream, ``[..., hc_count * H]``."""
    return embeddings.repeat(*([1] * (embeddings.dim() - 1)), hc_count)


class HyperConnection(nn.Module):
    """`Qwen4ExpTextGatedResidual`; inject=False: the final mixer, which returns no injection weights."""

    def __init__(self, cfg, inject: bool = True):
        super().__init__()
        hc, lr = cfg.hc_count, cfg.hc_lowrank
        streams = hc * cfg.hidden_size
        self.hc_count, self.eps = hc, cfg.rms_norm_eps
        self.hc_norm = Weight((streams,))
        self.input_mix_weight_down = Weight((lr, streams))
        self.input_mix_weight_up = Weight((streams, lr))
        self.block_inject_weight = Weight((hc, streams)) if inject else None

    def forward(self, hyper: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None = None):
        """hyper += pending's block output (per-stream weights), then this mixer's block input and
        the injection weights for its block: (new hyper, block input [T, H], weights [T, hc] or None)."""
        out, inject = pending if pending is not None else (None, None)
        inject_weight = self.block_inject_weight.weight if self.block_inject_weight is not None else None
        return hc_step(hyper, out, inject, self.hc_norm.weight, self.input_mix_weight_down.weight,
                       self.input_mix_weight_up.weight, inject_weight, self.hc_count, self.eps)
