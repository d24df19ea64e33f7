"""Linear projections of the Llama-family model and every model's LM head (parallel/tp.py):
plain weights through ops.gemv.linear (the Triton GEMV for 1-2 rows on CUDA, else cuBLAS); layers
with FP8 / NVFP4 weights (layers/quantization) run their own ops.fp8_gemm / ops.nvfp4_gemm path."""
from __future__ import annotations

import torch
from torch import nn

from qsaserve.layers.quantization.fp8 import Fp8Linear
from qsaserve.layers.quantization.nvfp4 import Nvfp4Linear
from qsaserve.layers.rmsnorm import RMSNorm
from qsaserve.ops import fused
from qsaserve.ops.fp8_gemm import SummedResidual
from qsaserve.ops.gemv import linear as linear_weight
from qsaserve.ops.gemv import silu_mul_linear as silu_mul_linear_weight


def linear(x: torch.Tensor, layer: nn.Linear | Fp8Linear | Nvfp4Linear) -> torch.Tensor:
    if isinstance(layer, (Fp8Linear, Nvfp4Linear)):
        return layer(x)
    return linear_weight(x, layer.weight, layer.bias)


def silu_mul_linear(gate_up: torch.Tensor, layer: nn.Linear | Fp8Linear | Nvfp4Linear) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [T, 2I] (gate | up), then the layer: FP8 layers fuse the two at
    decode rows (ops.fp8_gemm.fp8_linear_silu_mul), plain weights without a bias at the GEMV's
    rows (ops.gemv.silu_mul_linear), the others run ops.fused.silu_mul first."""
    if isinstance(layer, Fp8Linear):
        return layer.forward_silu_mul(gate_up)
    if isinstance(layer, nn.Linear) and layer.bias is None:
        return silu_mul_linear_weight(gate_up, layer.weight)
    return linear(fused.silu_mul(gate_up), layer)


def linear_residual(x: torch.Tensor, layer: nn.Linear | Fp8Linear | Nvfp4Linear, residual: torch.Tensor,
                    next_norm: RMSNorm | None, gated: bool = False) -> tuple[torch.Tensor | SummedResidual,
                                                                             torch.Tensor | None]:
    """The layer's output (silu_mul_linear's when gated) and the residual it is to be added to,
    for rms_norm_linear with next_norm: (layer(x), residual); or, where an FP8 layer's GEMV adds
    its output to the residual and prepares next_norm in its epilogue (ops.fp8_gemm
    .fp8_linear_residual: decode rows), (SummedResidual, None). Only without a collective between
    the layer and the add (tensor parallel ranks all-reduce the output first)."""
    if next_norm is not None and isinstance(layer, Fp8Linear) and layer.joins_residual(x, residual, gated):
        return layer.forward_residual(x, residual, next_norm.weight, gated), None
    return (silu_mul_linear(x, layer) if gated else linear(x, layer)), residual


def rms_norm_linear(x: torch.Tensor | SummedResidual, residual: torch.Tensor | None, norm: RMSNorm,
                    layer: nn.Linear | Fp8Linear | Nvfp4Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer(norm(x + residual)), x + residual), or (layer(norm(x)), x) without a residual: FP8
    layers join the norm to the GEMV at its rows (ops.fp8_gemm.fp8_linear_rms_norm), the others
    run the norm first. x a SummedResidual (linear_residual's, made for this norm): the sum is
    done, and FP8 layers take its prepared numerator (one GEMV whose sums are scaled by 1 / rms)."""
    if isinstance(x, SummedResidual):
        if residual is not None or x.norm_weight is not norm.weight:
            raise ValueError("rms_norm_linear: a SummedResidual is made for its norm and carries the residual")
        if isinstance(layer, Fp8Linear):
            return layer.forward_prenormed(x, norm.eps), x.h
        return linear(fused.rms_norm(x.h, norm.weight, norm.eps), layer), x.h
    if isinstance(layer, Fp8Linear):
        return layer.forward_rms_norm(x, residual, norm.weight, norm.eps)
    h, residual = fused.rms_norm_residual(x, residual, norm.weight, norm.eps)
    return linear(h, layer), residual


__all__ = ["linear", "linear_residual", "linear_weight", "rms_norm_linear", "silu_mul_linear"]
