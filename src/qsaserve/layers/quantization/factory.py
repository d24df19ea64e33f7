"""Which linear layer a model module gets (float, FP8 or NVFP4), and the startup warm-up over a
model's quantized linears: the one place that knows every quantized layer type."""
from __future__ import annotations

import torch
from torch import nn

from qsaserve.layers.quantization.config import WeightQuantConfig
from qsaserve.layers.quantization.fp8 import Fp8Linear
from qsaserve.layers.quantization.nvfp4 import Nvfp4Linear

QUANTIZED_LINEARS = (Fp8Linear, Nvfp4Linear)


def make_linear(in_features: int, parts: list[int], bias: bool, quant: WeightQuantConfig | None,
                name: str) -> nn.Module:
    """nn.Linear, or an Fp8Linear / Nvfp4Linear when `quant` quantizes module `name` (HF name of its
    first part)."""
    if quant is not None and quant.is_quantized(name):
        if quant.method == "nvfp4":
            return Nvfp4Linear(in_features, parts, bias, name)
        return Fp8Linear(in_features, parts, bias, quant, name)
    return nn.Linear(in_features, sum(parts), bias=bias)


def warm_up_quantized_layers(model: nn.Module, dtype: torch.dtype) -> int:
    """Warms one quantized linear layer of each distinct shape and scale layout (the kernels
    specialize on these, not on the layer); returns the launches made."""
    seen, launches = set(), 0
    for m in model.modules():
        if isinstance(m, QUANTIZED_LINEARS):
            key = (type(m), m.out_features, m.in_features, getattr(m, "block_n", 0), tuple(m.weight_scale.shape),
                   m.bias is not None)
            if key not in seen:
                seen.add(key)
                launches += m.warm_up(dtype)
    return launches


__all__ = ["QUANTIZED_LINEARS", "make_linear", "warm_up_quantized_layers"]
