"""Hyper-connections: the residual is hc_count streams [T, hc * H]. Between two blocks a mixer
adds the previous block's output to every stream (by per-stream injection weights) and mixes the
streams down to the next block's input; the final mixer (no injection) feeds the LM head."""
from __future__ import annotations

import torch
from torch import nn

from qsaserve.models.qwen4exp.sharding import REPLICATED
from qsaserve.models.qwen4exp.weights import PackedWeight, Weight
from qsaserve.ops.hyper_connection import hc_step


def hc_expand(embeddings: torch.Tensor, hc_count: int) -> torch.Tensor:
    """Initial residual: the token embedding copied into every stream, ``[..., hc_count * H]``."""
    return embeddings.repeat(*([1] * (embeddings.dim() - 1)), hc_count)


class HyperConnection(nn.Module):
    """`Qwen4ExpTextGatedResidual`; inject=False: the final mixer, which returns no injection weights.
    A mixer with injection keeps its down and inject projections, which read the same normalized
    streams, in one parameter (`mix_down_inject`, down's rows then inject's): one GEMM a step
    (ops.hyper_connection runs the two as one where their rows lie so)."""

    def __init__(self, cfg, inject: bool = True):
        super().__init__()
        hc, lr = cfg.hc_count, cfg.hc_lowrank
        streams = hc * cfg.hidden_size
        self.hc_count, self.eps = hc, cfg.rms_norm_eps
        self.hc_norm = Weight((streams,))
        self.input_mix_weight_up = Weight((streams, lr))
        self.inject = inject
        if inject:
            self.mix_down_inject = PackedWeight(streams, [("down", lr, REPLICATED), ("inject", hc, REPLICATED)])
            self.packed_names = {"input_mix_weight_down.weight": ("mix_down_inject.weight", "down"),
                                 "block_inject_weight.weight": ("mix_down_inject.weight", "inject")}
        else:
            self.input_mix_weight_down = Weight((lr, streams))

    def forward(self, hyper: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None = None):
        """hyper += pending's block output (per-stream weights), then this mixer's block input and
        the injection weights for its block: (new hyper, block input [T, H], weights [T, hc] or None)."""
        out, inject = pending if pending is not None else (None, None)
        if self.inject:
            down, inject_weight = self.mix_down_inject.part("down"), self.mix_down_inject.part("inject")
        else:
            down, inject_weight = self.input_mix_weight_down.weight, None
        return hc_step(hyper, out, inject, self.hc_norm.weight, down, self.input_mix_weight_up.weight, inject_weight,
                       self.hc_count, self.eps)
