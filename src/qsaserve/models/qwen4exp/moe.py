"""The sparse MoE block: routed experts plus a sigmoid-gated shared expert, after a softmax
top-k router. The router, the shared expert's gate/up projections and its gate read the same
input: one packed parameter, one GEMM on the fused path."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qsaserve.models.interfaces import WarmsUpKernels
from qsaserve.models.qwen4exp.reference import sparse_moe_block
from qsaserve.models.qwen4exp.sharding import REPLICATED, RankLayout
from qsaserve.models.qwen4exp.state import Step
from qsaserve.models.qwen4exp.weights import ExpertLoader, PackedWeight, Weight, parameter
from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.fused import sigmoid_gated_add, silu_mul
from qsaserve.ops.moe import moe_experts, moe_experts_sync_free, moe_route, warm_up as warm_up_moe


class Experts(nn.Module):
    """The routed experts, fused over E: gate_up_proj [E, 2I, H] (rows :I gate, I: up), down_proj [E, H, I]."""

    def __init__(self, cfg, layout: RankLayout):
        super().__init__()
        e, h = cfg.num_experts, cfg.hidden_size
        inter = layout.expert_inter[1] - layout.expert_inter[0]
        self.gate_up_proj = parameter((e, 2 * inter, h), ExpertLoader(layout.experts_gate_up(), layout))
        self.down_proj = parameter((e, h, inter), ExpertLoader(layout.experts_down(), layout))


class SharedExpert(nn.Module):
    def __init__(self, cfg, layout: RankLayout):
        super().__init__()
        inter = layout.shared_inter[1] - layout.shared_inter[0]
        self.down_proj = Weight((cfg.hidden_size, inter), layout.shared_down())


class SparseMoE(nn.Module, WarmsUpKernels):
    """`Qwen4ExpTextSparseMoeBlock` on this rank's expert and shared-expert intermediate slice
    (outputs summed over the TP ranks). `sparse_moe_block` is the reference and the CPU path.
    Fused path (CUDA): the packed GEMM, SiLU-mul fused, the routed experts through ops.moe's
    sync-free kernels (decode kernels or grouped GEMMs, by the step's size)."""

    # checkpoint tensors stored as row ranges of input_proj
    packed_names = {"gate.weight": ("input_proj.weight", "router"),
                    "shared_expert.gate_proj.weight": ("input_proj.weight", "shared_gate_proj"),
                    "shared_expert.up_proj.weight": ("input_proj.weight", "shared_up_proj"),
                    "shared_expert_gate.weight": ("input_proj.weight", "shared_expert_gate")}

    def __init__(self, cfg, layout: RankLayout):
        super().__init__()
        self.ctx = layout.ctx
        self.top_k, self.norm_topk_prob, self.activation = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.hidden_act
        shared = layout.shared_inter[1] - layout.shared_inter[0]
        self.input_proj = PackedWeight(cfg.hidden_size, [
            ("router", cfg.num_experts, REPLICATED), ("shared_gate_proj", shared, layout.shared_gate_up()),
            ("shared_up_proj", shared, layout.shared_gate_up()), ("shared_expert_gate", 1, REPLICATED)])
        self.experts = Experts(cfg, layout)
        self.shared_expert = SharedExpert(cfg, layout)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        if self._fused_path(x):
            out = self._fused_forward(x, step)
        else:
            out = sparse_moe_block(x, self.reference_weights(), self.top_k, self.norm_topk_prob, self.activation,
                                   sync_free=step.decode)
        return self.ctx.all_reduce(out)

    def _fused_path(self, x: torch.Tensor) -> bool:
        return use_triton(x) and x.dim() == 2 and self.activation in ("silu", "swish")

    def _fused_forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        router, gate, up, shared_gate = self.input_proj.sizes()
        logits, gate_up, shared_gate = torch.split(F.linear(x, self.input_proj.weight), [router, gate + up, shared_gate],
                                                   dim=-1)
        top_w, top_i = moe_route(logits, self.top_k, self.norm_topk_prob)
        experts = moe_experts_sync_free if step.decode else moe_experts
        routed = experts(x, top_i, top_w, self.experts.gate_up_proj, self.experts.down_proj, self.activation)
        shared = F.linear(silu_mul(gate_up), self.shared_expert.down_proj.weight)
        return sigmoid_gated_add(routed, shared, shared_gate)  # routed + sigmoid(gate) * shared

    def warm_up_kernels(self, dtype: torch.dtype, max_tokens: int) -> int:
        if not self._fused_path(self.experts.gate_up_proj[0]):
            return 0
        return warm_up_moe(self.experts.gate_up_proj, self.experts.down_proj, self.top_k, dtype, max_tokens)

    def reference_weights(self) -> dict[str, torch.Tensor]:
        """This rank's weights by checkpoint name relative to `mlp.` (sparse_moe_block's keys)."""
        p = self.input_proj.part
        return {"gate.weight": p("router"), "experts.gate_up_proj": self.experts.gate_up_proj,
                "experts.down_proj": self.experts.down_proj, "shared_expert.gate_proj.weight": p("shared_gate_proj"),
                "shared_expert.up_proj.weight": p("shared_up_proj"),
                "shared_expert.down_proj.weight": self.shared_expert.down_proj.weight,
                "shared_expert_gate.weight": p("shared_expert_gate")}
