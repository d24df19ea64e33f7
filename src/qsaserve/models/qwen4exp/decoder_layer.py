"""One Qwen4Exp decoder layer: [PLE] -> mixer -> GDN or QSA -> inject -> mixer -> MoE -> inject.

Each block's output is added to the residual streams by the next mixer (one hyper-connection
step: inject, then mix the next block's input), so a layer hands its MoE output on as `pending`
(output, injection weights) rather than adding it itself."""
from __future__ import annotations

import torch
from torch import nn

from qsaserve.layers.attention import AttentionMetadata
from qsaserve.models.qwen4exp.config import GDN
from qsaserve.models.qwen4exp.gated_deltanet import GatedDeltaNet
from qsaserve.models.qwen4exp.hyper_connection import HyperConnection
from qsaserve.models.qwen4exp.moe import SparseMoE
from qsaserve.models.qwen4exp.ple import PLE
from qsaserve.models.qwen4exp.qsa_attention import QSAAttention
from qsaserve.models.qwen4exp.sharding import RankLayout
from qsaserve.models.qwen4exp.state import SlotState, Step
from qsaserve.ops.hyper_connection import hc_inject

Pending = tuple[torch.Tensor, torch.Tensor] | None  # (block output, injection weights) not yet added


class Qwen4ExpDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, layout: RankLayout, quant=None):
        super().__init__()
        self.is_gdn = cfg.layer_types[layer_idx] == GDN
        self.ple = PLE(cfg, layer_idx) if layer_idx + 1 in cfg.ple_layer_ids else None
        self.attn_hyper_connection = HyperConnection(cfg)
        if self.is_gdn:
            self.linear_attn = GatedDeltaNet(cfg, layout, quant, f"model.layers.{layer_idx}.linear_attn.")
        else:
            self.self_attn = QSAAttention(cfg, layout, quant, f"model.layers.{layer_idx}.self_attn.")
        self.mlp_hyper_connection = HyperConnection(cfg)
        self.mlp = SparseMoE(cfg, layout, quant, f"model.layers.{layer_idx}.mlp.")

    @property
    def mixer(self) -> GatedDeltaNet | QSAAttention:
        """The token mixer: GDN or QSA attention."""
        return self.linear_attn if self.is_gdn else self.self_attn

    def stateful_blocks(self) -> list[nn.Module]:
        """Blocks with per-slot state, in the layer's order."""
        return ([self.ple] if self.ple is not None else []) + [self.mixer]

    def states(self) -> list[SlotState]:
        return [b.state for b in self.stateful_blocks() if b.state is not None]

    def forward(self, hyper: torch.Tensor, pending: Pending, input_ids: torch.Tensor, step: Step,
                meta: AttentionMetadata, out_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, Pending] | None:
        """out_rows [R] (a QSA layer: the MTP head's catch-up rows): the token mixer writes its
        cache and state for every row, the rest of the layer runs for these rows only; R = 0:
        None, the cache and state alone."""
        if self.ple is not None:
            if pending is not None:
                hyper, pending = hc_inject(hyper, *pending), None
            hyper = hyper + self.ple(hyper, input_ids, step)
        hyper, mixed, inject = self.attn_hyper_connection(hyper, pending)
        if out_rows is None:
            out = self.linear_attn(mixed, step) if self.is_gdn else self.self_attn(mixed, step, meta)
        elif self.is_gdn:
            raise ValueError("out_rows: a GDN layer computes every row's output (its state is the output's recurrence)")
        else:
            out = self.self_attn(mixed, step, meta, out_rows)
            if out is None:
                return None
            hyper, inject = hyper[out_rows], inject[out_rows] if inject is not None else None
        hyper, mixed, inject = self.mlp_hyper_connection(hyper, (out, inject))
        return hyper, (self.mlp(mixed, step), inject)
