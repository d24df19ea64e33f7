"""The sparse MoE block: routed experts plus a sigmoid-gated shared expert, after a softmax
top-k router. The router, the shared expert's gate/up projections and its gate read the same
input: one packed parameter, one GEMM on the fused path.

With FP8 weights (layers/quantization) the routed experts are block-FP8 (quantized.Fp8RoutedExperts,
run by ops.moe with their scales) and the shared expert's gate | up and down are Fp8Linear layers;
with NVFP4 weights the same with Nvfp4RoutedExperts and Nvfp4Linear layers (quantized_nvfp4.py,
W4A16); the router and the shared-expert gate stay in the model dtype (as vLLM and SGLang keep
them), packed together."""
from __future__ import annotations

import logging

import torch
from torch import nn

from qsaserve.layers.quantization.fp8_moe import fits_blocks
from qsaserve.layers.quantization.nvfp4_moe import fits_groups
from qsaserve.models.interfaces import WarmsUpKernels
from qsaserve.models.qwen4exp.quantized import QUANTIZED_EXPERTS, Fp8RoutedExperts, Nvfp4RoutedExperts, packed, project
from qsaserve.models.qwen4exp.reference import sparse_moe_block
from qsaserve.models.qwen4exp.sharding import REPLICATED, RankLayout
from qsaserve.models.qwen4exp.state import Step
from qsaserve.models.qwen4exp.weights import ExpertLoader, PackedWeight, Weight, parameter
from qsaserve.ops import gemv
from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.fused import sigmoid_gated_add, silu_mul
from qsaserve.ops.moe import moe_experts, moe_experts_sync_free, moe_route, warm_up as warm_up_moe
from qsaserve.ops.moe.reference import activation_fn

logger = logging.getLogger("qsaserve")


class Experts(nn.Module):
    """The routed experts, fused over E: gate_up_proj [E, 2I, H] (rows :I gate, I: up), down_proj [E, H, I]."""

    def __init__(self, cfg, layout: RankLayout):
        super().__init__()
        e, h = cfg.num_experts, cfg.hidden_size
        inter = layout.expert_inter[1] - layout.expert_inter[0]
        self.gate_up_proj = parameter((e, 2 * inter, h), ExpertLoader(layout.experts_gate_up(), layout))
        self.down_proj = parameter((e, h, inter), ExpertLoader(layout.experts_down(), layout))


def make_experts(cfg, layout: RankLayout, quant, name: str) -> nn.Module:
    """Block-FP8 routed experts when `quant` quantizes module `name` (`model.layers.N.mlp.experts`)
    and their intermediate size stacks gate | up by 128-row blocks, NVFP4 experts when `quant` is
    NVFP4 and the hidden and intermediate sizes are multiples of 16, else Experts in the model
    dtype (a quantized checkpoint's experts then dequantized at load, quantized.at_load_dequantizer)."""
    if quant is not None and quant.method == "nvfp4" and quant.is_quantized(name):
        if fits_groups(cfg.hidden_size, cfg.moe_intermediate_size):
            return Nvfp4RoutedExperts(cfg, layout, name)
        logger.warning("%s: hidden_size %d / moe_intermediate_size %d not multiples of 16, so the routed experts stay "
                       "in the model dtype (NVFP4 groups of 16 columns)", name, cfg.hidden_size,
                       cfg.moe_intermediate_size)
        return Experts(cfg, layout)
    if quant is None or quant.method != "fp8" or quant.scheme != "block" or not quant.is_quantized(name):
        return Experts(cfg, layout)
    if not fits_blocks(cfg.moe_intermediate_size):
        logger.warning("%s: moe_intermediate_size %d is not a multiple of 128, so the routed experts stay in the "
                       "model dtype (block-FP8 experts stack gate and up by 128-row blocks)", name,
                       cfg.moe_intermediate_size)
        return Experts(cfg, layout)
    return Fp8RoutedExperts(cfg, layout, name)


class SharedExpert(nn.Module):
    """The shared expert's down_proj (model dtype: a Weight; FP8 / NVFP4: an Fp8PackedWeight /
    Nvfp4PackedWeight) and, when the block holds quantized weights (`own_gate_up`, or its own are
    quantized), its gate | up as `gate_up_proj`
    (otherwise packed with the router in SparseMoE.input_proj)."""

    def __init__(self, cfg, layout: RankLayout, quant=None, prefix: str = "", own_gate_up: bool = False):
        super().__init__()
        inter = layout.shared_inter[1] - layout.shared_inter[0]
        self.down_proj = packed(inter, [(None, cfg.hidden_size, layout.shared_down())], quant, prefix + "down_proj",
                                lambda: Weight((cfg.hidden_size, inter), layout.shared_down()),
                                full_in=cfg.shared_expert_intermediate_size)
        parts = [(f"shared_{p}", inter, layout.shared_gate_up()) for p in ("gate_proj", "up_proj")]
        gate_up = packed(cfg.hidden_size, parts, quant, prefix + "gate_proj", lambda: None)
        if gate_up is not None or own_gate_up or not isinstance(self.down_proj, Weight):
            self.gate_up_proj = PackedWeight(cfg.hidden_size, parts) if gate_up is None else gate_up


class SparseMoE(nn.Module, WarmsUpKernels):
    """`Qwen4ExpTextSparseMoeBlock` on this rank's expert and shared-expert intermediate slice
    (outputs summed over the TP ranks). `sparse_moe_block` is the reference and the CPU path.
    Fused path (CUDA): the packed GEMM, SiLU-mul fused, the routed experts through ops.moe's
    sync-free kernels (decode kernels or grouped GEMMs, by the step's size). With FP8 / NVFP4 layers
    (`quantized`): _quantized_forward on either device, the router | shared-expert gate GEMM in the
    model dtype, the experts with their scales, the shared expert through its quantized layers."""

    # checkpoint tensors stored as row ranges of input_proj
    packed_names = {"gate.weight": ("input_proj.weight", "router"),
                    "shared_expert.gate_proj.weight": ("input_proj.weight", "shared_gate_proj"),
                    "shared_expert.up_proj.weight": ("input_proj.weight", "shared_up_proj"),
                    "shared_expert_gate.weight": ("input_proj.weight", "shared_expert_gate")}

    def __init__(self, cfg, layout: RankLayout, quant=None, prefix: str = ""):
        """quant, prefix: FP8 / NVFP4 weights (WeightQuantConfig) and the HF name of the block (`model.layers.N.mlp.`)."""
        super().__init__()
        self.ctx = layout.ctx
        self.top_k, self.norm_topk_prob, self.activation = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.hidden_act
        self.experts = make_experts(cfg, layout, quant, prefix + "experts")
        self.shared_expert = SharedExpert(cfg, layout, quant, prefix + "shared_expert.",
                                          own_gate_up=isinstance(self.experts, QUANTIZED_EXPERTS))
        shared = layout.shared_inter[1] - layout.shared_inter[0]
        self.quantized = hasattr(self.shared_expert, "gate_up_proj") or isinstance(self.experts, QUANTIZED_EXPERTS)
        if not self.quantized:
            self.input_proj = PackedWeight(cfg.hidden_size, [
                ("router", cfg.num_experts, REPLICATED), ("shared_gate_proj", shared, layout.shared_gate_up()),
                ("shared_up_proj", shared, layout.shared_gate_up()), ("shared_expert_gate", 1, REPLICATED)])
            return
        # the router and the shared-expert gate stay in the model dtype, packed; the shared expert's
        # gate | up is its own layer (FP8 unless the checkpoint keeps it)
        self.input_proj = PackedWeight(cfg.hidden_size, [("router", cfg.num_experts, REPLICATED),
                                                         ("shared_expert_gate", 1, REPLICATED)])
        self.packed_names = {k: v for k, v in self.packed_names.items() if k.split(".")[0] != "shared_expert"}
        self.packed_names.update({f"shared_expert.{p}.weight": ("shared_expert.gate_up_proj.weight", f"shared_{p}")
                                  for p in ("gate_proj", "up_proj")})

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        if self.quantized:
            out = self._quantized_forward(x, step)
        elif self._fused_path(x):
            out = self._fused_forward(x, step)
        else:
            out = sparse_moe_block(x, self.reference_weights(), self.top_k, self.norm_topk_prob, self.activation,
                                   sync_free=step.decode)
        return self.ctx.all_reduce(out)

    def _fused_path(self, x: torch.Tensor) -> bool:
        return use_triton(x) and x.dim() == 2 and self.activation in ("silu", "swish")

    def _fused_forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        router, gate, up, shared_gate = self.input_proj.sizes()
        logits, gate_up, shared_gate = torch.split(gemv.linear(x, self.input_proj.weight), [router, gate + up, shared_gate],
                                                   dim=-1)
        top_w, top_i = moe_route(logits, self.top_k, self.norm_topk_prob)
        experts = moe_experts_sync_free if step.decode else moe_experts
        routed = experts(x, top_i, top_w, self.experts.gate_up_proj, self.experts.down_proj, self.activation)
        shared = gemv.silu_mul_linear(gate_up, self.shared_expert.down_proj.weight)
        return sigmoid_gated_add(routed, shared, shared_gate)  # routed + sigmoid(gate) * shared

    def _quantized_forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """The block with FP8 / NVFP4 layers, on either path (ops.moe, ops.fp8_gemm and ops.nvfp4_gemm
        dispatch themselves)."""
        flat = x.reshape(-1, x.shape[-1])
        logits, shared_gate = torch.split(gemv.linear(flat, self.input_proj.weight), self.input_proj.sizes(), dim=-1)
        top_w, top_i = moe_route(logits, self.top_k, self.norm_topk_prob)
        experts = moe_experts_sync_free if step.decode else moe_experts
        scales = self.experts.scales() if isinstance(self.experts, QUANTIZED_EXPERTS) else {}
        routed = experts(flat, top_i, top_w, self.experts.gate_up_proj, self.experts.down_proj, self.activation,
                         **scales)
        gate_up = project(flat, self.shared_expert.gate_up_proj)
        if self._fused_path(flat):
            act = silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = activation_fn(self.activation)(gate) * up
        shared = project(act, self.shared_expert.down_proj)
        return sigmoid_gated_add(routed, shared, shared_gate).reshape(x.shape)  # routed + sigmoid(gate) * shared

    def warm_up_kernels(self, dtype: torch.dtype, max_tokens: int) -> int:
        if not self._fused_path(self.experts.gate_up_proj[0]):
            return 0
        scales = self.experts.scales() if isinstance(self.experts, QUANTIZED_EXPERTS) else {}
        return warm_up_moe(self.experts.gate_up_proj, self.experts.down_proj, self.top_k, dtype, max_tokens, **scales)

    def reference_weights(self) -> dict[str, torch.Tensor]:
        """This rank's weights by checkpoint name relative to `mlp.` (sparse_moe_block's keys; model
        dtype weights only)."""
        p = self.input_proj.part
        return {"gate.weight": p("router"), "experts.gate_up_proj": self.experts.gate_up_proj,
                "experts.down_proj": self.experts.down_proj, "shared_expert.gate_proj.weight": p("shared_gate_proj"),
                "shared_expert.up_proj.weight": p("shared_up_proj"),
                "shared_expert.down_proj.weight": self.shared_expert.down_proj.weight,
                "shared_expert_gate.weight": p("shared_expert_gate")}
