"""Qwen4Exp with FP8 weights (layers/quantization): the projections of the token mixers (QSA's packed
q | k | v | index_qk and o_proj, GDN's packed in_proj and out_proj) and of the shared expert (gate |
up, down) as Fp8Linear layers with the PackedWeight / Weight interface and weight loaders, the
routed experts as block-FP8 Fp8Experts (Fp8RoutedExperts: the ExpertLoader interface), and the FP8
tensors of every other layer (router, shared-expert gate, PLE projections, the MTP head, experts
whose intermediate size does not stack by 128-row blocks) dequantized to the model dtype as they load.
NVFP4 has the same pieces in quantized_nvfp4.py; packed(), project(), the scale targets and
at_load_dequantizer() here pick either."""
from __future__ import annotations

import logging

import torch
from torch import nn

from qsaserve.layers.quantization import Fp8Linear, WeightQuantConfig
from qsaserve.layers.quantization.fp8_moe import Fp8Experts
from qsaserve.layers.quantization.nvfp4_moe import Nvfp4Experts
from qsaserve.models.qwen4exp import quantized_nvfp4
from qsaserve.models.qwen4exp.quantized_nvfp4 import Nvfp4PackedWeight, Nvfp4RoutedExperts, nvfp4_packed
from qsaserve.models.qwen4exp.quantized_loaders import PackedPartLoader, QuantizedExpertLoader
from qsaserve.ops import gemv
from qsaserve.ops.fp8_gemm import FP8, dequantize_weight

logger = logging.getLogger("qsaserve")

SCALE_SUFFIXES = ("_scale_inv", "_scale")  # <name>.weight_scale_inv (block) / <name>.weight_scale (tensor, channel)


class _Fp8Loader(PackedPartLoader):
    """weight_loader of an Fp8PackedWeight's weight or weight_scale."""

    def view(self, param: torch.Tensor, shard_id=None) -> torch.Tensor:
        m = self.module
        i = m.ids.index(shard_id)
        a, rows = m.offsets[i], m.parts[i]
        if self.kind == "scale":
            return param[a // m.block_n:(a + rows) // m.block_n]
        return param[a:a + rows]

    def full_extent(self, loaded: torch.Tensor, rule) -> int:
        # a weight knows its full size; a block scale does not, so its last range may end anywhere
        return loaded.shape[rule.dim] if self.kind == "weight" else max(b for _, b in rule.ranges)


class Fp8PackedWeight(Fp8Linear):
    """PackedWeight (and, with one part of shard id None, Weight) with FP8 weights: `weight`
    [sum of rows, in_features] E4M3, `weight_scale`, sizes(), part(shard id) (dequantized rows, for
    code that takes a weight tensor) and linear_part."""

    def __init__(self, in_features: int, parts: list[tuple[object, int, object]], quant: WeightQuantConfig, name: str):
        super().__init__(in_features, [rows for _, rows, _ in parts], False, quant, name)
        self.ids = [pid for pid, _, _ in parts]
        self.rules = [rule for _, _, rule in parts]
        self.dtype = torch.get_default_dtype()  # the model dtype (models are built under it)
        self.weight.weight_loader = _Fp8Loader(self, "weight")
        self.weight_scale.weight_loader = _Fp8Loader(self, "scale")

    def sizes(self) -> list[int]:
        return list(self.parts)

    def part(self, shard_id) -> torch.Tensor:
        return self.dequantized(self.ids.index(shard_id), self.dtype)


class Fp8RoutedExperts(Fp8Experts):
    """Experts (moe.py) with block-FP8 weights: gate_up_proj / down_proj E4M3 beside their
    `_scale_inv` block scales, this rank keeping layout.expert_inter of every expert."""

    def __init__(self, cfg, layout, name: str):
        super().__init__(cfg.num_experts, cfg.hidden_size, layout.expert_inter, cfg.moe_intermediate_size, name)
        for fused, rule in (("gate_up_proj", layout.experts_gate_up()), ("down_proj", layout.experts_down())):
            getattr(self, fused).weight_loader = QuantizedExpertLoader(self, "weight", fused, rule)
            getattr(self, fused + "_scale_inv").weight_loader = QuantizedExpertLoader(self, "scale", fused, rule)


QUANTIZED_PACKED = (Fp8PackedWeight, Nvfp4PackedWeight)  # PackedWeight / Weight with quantized weights
QUANTIZED_EXPERTS = (Fp8RoutedExperts, Nvfp4RoutedExperts)


def packed(in_features: int, parts: list, quant: WeightQuantConfig | None, name: str, plain,
           full_in: int | None = None):
    """Fp8PackedWeight / Nvfp4PackedWeight when `quant` quantizes module `name` (the HF name of the
    first part), else plain(). full_in: the checkpoint tensor's input size when a rank holds a
    column range of it (row-parallel layers; NVFP4 keeps a tensor it cannot hold in the model dtype)."""
    if quant is None or not quant.is_quantized(name):
        return plain()
    if quant.method == "nvfp4":
        return nvfp4_packed(in_features, parts, name, plain, full_in)
    return Fp8PackedWeight(in_features, parts, quant, name)


def project(x: torch.Tensor, module: nn.Module, part=None) -> torch.Tensor:
    """x @ W^T of a Weight / PackedWeight (or one part of it), quantized or not."""
    if isinstance(module, QUANTIZED_PACKED):
        return module(x) if part is None else module.linear_part(x, module.ids.index(part))
    return gemv.linear(x, module.weight if part is None else module.part(part))


def add_scale_targets(model: nn.Module, targets: dict) -> None:
    """targets (checkpoint name -> (parameter, shard id)) gain each quantized weight's scale names
    (FP8: weight_scale_inv / weight_scale; NVFP4: weight_scale, weight_scale_2)."""
    scales = {}
    for m in model.modules():
        if isinstance(m, Fp8PackedWeight):
            scales[id(m.weight)] = {suffix: m.weight_scale for suffix in SCALE_SUFFIXES}
        elif isinstance(m, Nvfp4PackedWeight):
            scales[id(m.weight)] = {suffix: getattr(m, p) for suffix, p in quantized_nvfp4.SCALE_SUFFIXES.items()}
    for name, (param, shard_id) in list(targets.items()):
        if id(param) in scales and name.endswith(".weight"):
            for suffix, scale in scales[id(param)].items():
                targets[name + suffix] = (scale, shard_id)


_QUANTIZED_LOADERS = (PackedPartLoader, QuantizedExpertLoader)


def is_quantized_target(targets: dict, name: str) -> bool:
    """Whether checkpoint tensor `name` goes to a quantized layer (its weight or a scale)."""
    return name in targets and isinstance(getattr(targets[name][0], "weight_loader", None), _QUANTIZED_LOADERS)


def missing_quantized_parts(model: nn.Module) -> list[str]:
    return [m for mod in model.modules() if isinstance(mod, (Fp8PackedWeight, Fp8Experts, Nvfp4PackedWeight,
                                                             Nvfp4Experts)) for m in mod.missing()]


def at_load_dequantizer(quant: WeightQuantConfig | None, dtype: torch.dtype):
    """The dequantizer of checkpoint tensors whose layers are held in the model dtype: NVFP4's or FP8's."""
    if quant is not None and quant.method == "nvfp4":
        return quantized_nvfp4.Nvfp4DequantizeAtLoad(dtype)
    return DequantizeAtLoad(quant, dtype)


class DequantizeAtLoad:
    """Pairs each FP8 checkpoint tensor whose layer is not FP8 with its scale, and hands the
    dequantized tensor (model dtype) on in its place; everything else passes through."""

    def __init__(self, quant: WeightQuantConfig | None, dtype: torch.dtype):
        self.quant, self.dtype = quant, dtype
        self.weights: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}
        self.count = 0

    def __call__(self, name: str, tensor: torch.Tensor, fp8_target: bool) -> list[tuple[str, torch.Tensor]]:
        base = next((name[: -len(s)] for s in SCALE_SUFFIXES if name.endswith(".weight" + s) or
                     name.endswith("_proj" + s)), None)
        if base is not None and not fp8_target:
            self.scales[base] = tensor
        elif tensor.dtype == FP8 and not fp8_target:
            self.weights[name] = tensor
            base = name
        else:
            return [(name, tensor)]
        if base in self.weights and base in self.scales:
            self.count += 1
            return [(base, self._dequantize(self.weights.pop(base), self.scales.pop(base)))]
        return []

    def _dequantize(self, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        if w.dim() == 3:  # fused experts [E, N, K] with per-expert scales [E, ...]
            return torch.stack([self._dequantize(w[e], s[e] if s.dim() == 3 else s) for e in range(w.shape[0])])
        if self.quant is not None and self.quant.scheme == "block":
            return dequantize_weight(w, s.reshape(-1, s.shape[-1]), 128).to(self.dtype)
        return (w.float() * s.float().reshape(-1, 1)).to(self.dtype)

    def finish(self) -> None:
        left = sorted(self.weights) + sorted(self.scales)
        if left:
            raise ValueError(f"model: FP8 checkpoint tensors without their weight / scale: {left[:5]}")
        if self.count:
            logger.warning("Qwen4Exp: %d FP8 checkpoint tensors of layers held in the model dtype (router, shared-"
                           "expert gate, MTP head, experts that do not stack by 128-row blocks) were dequantized to %s "
                           "at load", self.count, self.dtype)


__all__ = ["QUANTIZED_EXPERTS", "QUANTIZED_PACKED", "DequantizeAtLoad", "Fp8PackedWeight", "Fp8RoutedExperts",
           "Nvfp4PackedWeight", "Nvfp4RoutedExperts", "add_scale_targets", "at_load_dequantizer", "is_quantized_target",
           "missing_quantized_parts", "packed", "project"]
