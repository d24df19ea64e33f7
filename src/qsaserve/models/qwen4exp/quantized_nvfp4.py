"""Qwen4Exp with NVFP4 weights (ModelOpt's layout, run as W4A16; quantized.py is the FP8 counterpart):
the token mixers' projections (QSA's packed q | k | v | index_qk and o_proj, GDN's packed in_proj
and out_proj) and the shared expert (gate | up, down) as Nvfp4Linear layers with the PackedWeight /
Weight interface and weight loaders (Nvfp4PackedWeight), the routed experts as Nvfp4Experts
(Nvfp4RoutedExperts: the ExpertLoader interface), and the NVFP4 tensors of every other layer
(router, shared-expert gate, PLE projections, the MTP head, layers whose input size is not a
multiple of 16) dequantized to the model dtype as they load (Nvfp4DequantizeAtLoad).

Global scales: each checkpoint tensor's `weight_scale_2` stays its own, as a per-row float32
scale (Nvfp4Linear.row_scale), so a packed q | k | v | index_qk keeps four. Folding them into the
E4M3 group scales (one global for the packed weight, each group scale times its part's ratio)
would not be exact: the products are generally not E4M3 values, so each group scale would round
again (and could leave E4M3's range), and the loaded model would no longer be the checkpoint's."""
from __future__ import annotations

import logging

import torch

from qsaserve.errors import InvalidRequestError
from qsaserve.layers.quantization import Nvfp4Linear
from qsaserve.layers.quantization.nvfp4_moe import Nvfp4Experts
from qsaserve.models.qwen4exp.quantized_loaders import PackedPartLoader, QuantizedExpertLoader
from qsaserve.ops.nvfp4_gemm import GROUP, dequantize_nvfp4

logger = logging.getLogger("qsaserve")

# checkpoint suffix after `<name>.weight` -> the Nvfp4PackedWeight parameter it loads into
SCALE_SUFFIXES = {"_scale": "weight_scale", "_scale_2": "row_scale"}
_PER_COL = {"weight": None, "scale": GROUP}  # checkpoint columns per stored column (weight: by dtype)


class _Nvfp4Loader(PackedPartLoader):
    """weight_loader of an Nvfp4PackedWeight's weight, weight_scale or row_scale (kinds weight,
    scale, global)."""

    def view(self, param: torch.Tensor, shard_id=None) -> torch.Tensor:
        m = self.module
        i = m.ids.index(shard_id)
        return param[m.offsets[i]:m.offsets[i] + m.parts[i]]

    def full_extent(self, loaded: torch.Tensor, rule) -> int | None:
        if self.kind == "global":  # one value for every rank
            return None
        per_col = _PER_COL[self.kind] or (2 if loaded.dtype == torch.uint8 else 1)
        return loaded.shape[rule.dim] * (per_col if rule.dim == 1 else 1)  # in checkpoint columns / rows


class Nvfp4PackedWeight(Nvfp4Linear):
    """PackedWeight (and, with one part of shard id None, Weight) with NVFP4 weights: `weight`
    uint8 [sum of rows, in_features / 2], `weight_scale` E4M3 [rows, in_features / 16], `row_scale`
    float32 [rows], sizes(), part(shard id) (dequantized rows, for code that takes a weight tensor)
    and linear_part."""

    def __init__(self, in_features: int, parts: list[tuple[object, int, object]], name: str):
        for _, _, rule in parts:  # a row-parallel rank's input columns must be whole 16-column groups
            if rule.ranges is not None and rule.dim == 1 and any(edge % GROUP for r in rule.ranges for edge in r):
                raise InvalidRequestError("tensor_parallel_size", f"{name}: this rank's input columns "
                                          f"{list(rule.ranges)} split a {GROUP}-column NVFP4 group; NVFP4 weights "
                                          f"shard their input dimension on multiples of {GROUP}")
        super().__init__(in_features, [rows for _, rows, _ in parts], False, name)
        self.ids = [pid for pid, _, _ in parts]
        self.rules = [rule for _, _, rule in parts]
        self.dtype = torch.get_default_dtype()  # the model dtype (models are built under it)
        self.weight.weight_loader = _Nvfp4Loader(self, "weight")
        self.weight_scale.weight_loader = _Nvfp4Loader(self, "scale")
        self.row_scale.weight_loader = _Nvfp4Loader(self, "global")

    def sizes(self) -> list[int]:
        return list(self.parts)

    def part(self, shard_id) -> torch.Tensor:
        return self.dequantized(self.ids.index(shard_id), self.dtype)


def nvfp4_packed(in_features: int, parts: list, name: str, plain, full_in: int | None = None):
    """Nvfp4PackedWeight, or plain() (model dtype, with a warning) when the checkpoint tensor's
    input size `full_in` (default in_features: not split over ranks) is not a multiple of 16,
    which NVFP4 cannot hold (the tiny test configs' shared expert of 24 rows)."""
    full_in = in_features if full_in is None else full_in
    if full_in % GROUP:
        logger.warning("%s: input size %d is not a multiple of %d, so this layer stays in the model dtype (NVFP4 "
                       "groups of %d columns)", name, full_in, GROUP, GROUP)
        return plain()
    return Nvfp4PackedWeight(in_features, parts, name)


# per-expert checkpoint suffix (after `experts.E.<proj>.`) -> the stacked parameter's suffix
EXPERT_SUFFIXES = {"weight": "", "weight_scale": "_scale", "weight_scale_2": "_row_scale"}


class Nvfp4RoutedExperts(Nvfp4Experts):
    """Experts (moe.py) with NVFP4 weights: gate_up_proj / down_proj packed E2M1 beside their
    `_scale` group scales and `_row_scale` global scales, this rank keeping layout.expert_inter of
    every expert."""

    def __init__(self, cfg, layout, name: str):
        super().__init__(cfg.num_experts, cfg.hidden_size, layout.expert_inter, cfg.moe_intermediate_size, name)
        for fused, rule in (("gate_up_proj", layout.experts_gate_up()), ("down_proj", layout.experts_down())):
            for kind, suffix in (("weight", ""), ("scale", "_scale"), ("global", "_row_scale")):
                getattr(self, fused + suffix).weight_loader = QuantizedExpertLoader(self, kind, fused, rule)


class Nvfp4DequantizeAtLoad:
    """Gathers each NVFP4 checkpoint tensor whose layer is not NVFP4 (packed uint8 `<name>.weight`,
    `<name>.weight_scale`, `<name>.weight_scale_2`, in any order) and hands the dequantized weight
    (model dtype) on in its place; everything else passes through."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.parts: dict[str, dict[str, torch.Tensor]] = {}
        self.count = 0

    def __call__(self, name: str, tensor: torch.Tensor, quantized_target: bool) -> list[tuple[str, torch.Tensor]]:
        if quantized_target:
            return [(name, tensor)]
        if name.endswith(".weight_scale_2"):
            base, kind = name.removesuffix("_scale_2"), "global"
        elif name.endswith(".weight_scale"):
            base, kind = name.removesuffix("_scale"), "scale"
        elif name.endswith(".weight") and tensor.dtype == torch.uint8:
            base, kind = name, "weight"
        else:
            return [(name, tensor)]
        parts = self.parts.setdefault(base, {})
        parts[kind] = tensor
        if len(parts) < 3:
            return []
        del self.parts[base]
        self.count += 1
        w, s = parts["weight"], parts["scale"]
        glob = parts["global"].float().reshape(()).expand(w.shape[0])
        return [(base, dequantize_nvfp4(w, s, glob).to(self.dtype))]

    def finish(self) -> None:
        if self.parts:
            left = [f"{base} ({', '.join(sorted(p))})" for base, p in sorted(self.parts.items())]
            raise ValueError(f"model: NVFP4 checkpoint tensors without their weight / weight_scale / "
                             f"weight_scale_2: {left[:5]}")
        if self.count:
            logger.warning("Qwen4Exp: %d NVFP4 checkpoint tensors of layers held in the model dtype (router, shared-"
                           "expert gate, PLE, MTP head, inputs not a multiple of 16) were dequantized to %s at load",
                           self.count, self.dtype)


__all__ = ["EXPERT_SUFFIXES", "Nvfp4DequantizeAtLoad", "Nvfp4PackedWeight", "Nvfp4RoutedExperts", "SCALE_SUFFIXES",
           "nvfp4_packed"]
