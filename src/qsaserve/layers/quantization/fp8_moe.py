"""Routed MoE experts with block-FP8 weights (vLLM's `Fp8MoEMethod` idea): the layer owns the stacked
expert parameters and their loaders, so a model hands it each expert's checkpoint tensors (E4M3
`weight` + `weight_scale_inv`, or a float weight quantized here) and never sees the scale layout.

Parameters, ops.moe's layout of block-FP8 experts: `gate_up_proj` [E, 2I, H] E4M3 (rows :I gate, I:
up) with `gate_up_proj_scale_inv` [E, 2I/128, ceil(H/128)] float32, `down_proj` [E, H, I] with
`down_proj_scale_inv` [E, ceil(H/128), I/128]. Gate and up are separate checkpoint tensors, each with
its own 128-row blocks, so stacking them keeps every block only when I (this rank's intermediate
slice) is a multiple of 128: `fits_blocks` says whether a model's experts can be held so, and a
tensor-parallel slice that cuts a block is refused naming tensor_parallel_size.

Online quantization quantizes each expert's full checkpoint tensor (ops.fp8_gemm.quantize_weight_block,
as `qsaserve quantize` writes it) before taking this rank's slice."""
from __future__ import annotations

import math

import torch
from torch import nn

from qsaserve.errors import InvalidRequestError
from qsaserve.layers.quantization.config import BLOCK
from qsaserve.ops.fp8_gemm import FP8, quantize_weight_block

PROJS = ("gate_proj", "up_proj", "down_proj")
SCALE_NAME = "weight_scale_inv"  # the checkpoint's per-expert scale, beside `weight`


def fits_blocks(intermediate_size: int) -> bool:
    """Whether experts of this intermediate size can be held as stacked block-FP8 gate | up."""
    return intermediate_size % BLOCK == 0


class Fp8Experts(nn.Module):
    """E routed experts of hidden size H, this rank keeping intermediate rows `inter` [a, b) of
    `intermediate_size`; `name` (HF module name, `model.layers.N.mlp.experts`) names errors."""

    def __init__(self, num_experts: int, hidden: int, inter: tuple[int, int], intermediate_size: int, name: str):
        super().__init__()
        a, b = inter
        if not fits_blocks(intermediate_size):
            raise InvalidRequestError("quantization", f"{name}: moe_intermediate_size {intermediate_size} is not a "
                                      f"multiple of {BLOCK}: block-FP8 experts stack gate and up by {BLOCK}-row blocks")
        if a % BLOCK or b % BLOCK:
            raise InvalidRequestError("tensor_parallel_size", f"{name}: this rank's expert intermediate rows "
                                      f"[{a}, {b}) of {intermediate_size} split a {BLOCK}x{BLOCK} FP8 weight block; block-FP8 "
                                      f"experts shard their intermediate dimension on multiples of {BLOCK}")
        self.name, self.num_experts, self.hidden = name, num_experts, hidden
        self.inter, self.intermediate_size = (a, b), intermediate_size
        rows, hidden_blocks = b - a, math.ceil(hidden / BLOCK)
        self.gate_up_proj = _param((num_experts, 2 * rows, hidden), FP8)
        self.gate_up_proj_scale_inv = _param((num_experts, 2 * rows // BLOCK, hidden_blocks), torch.float32)
        self.down_proj = _param((num_experts, hidden, rows), FP8)
        self.down_proj_scale_inv = _param((num_experts, hidden_blocks, rows // BLOCK), torch.float32)
        self.loaded: set[tuple[str, int, str]] = set()

    def scales(self) -> dict[str, torch.Tensor]:
        """ops.moe's keyword arguments for these experts' scales."""
        return {"w13_scale": self.gate_up_proj_scale_inv, "w2_scale": self.down_proj_scale_inv}

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, block={BLOCK}"

    # ---- loading ----
    def missing(self) -> list[str]:
        """Checkpoint names of the per-expert tensors not loaded yet."""
        return [f"{self.name}.{e}.{proj}.{'weight' if kind == 'weight' else SCALE_NAME}"
                for e in range(self.num_experts) for proj in PROJS for kind in ("weight", "scale")
                if (kind, e, proj) not in self.loaded]

    def load(self, kind: str, tensor: torch.Tensor, expert: int, proj: str) -> None:
        """kind: weight (E4M3, or a float weight quantized here) or scale (its weight_scale_inv);
        tensor: expert `expert`'s full checkpoint tensor of `proj` (gate_proj / up_proj [I, H],
        down_proj [H, I], or their block scales)."""
        if proj not in PROJS:
            raise ValueError(f"model: {self.name}.{expert}: unknown expert projection {proj!r}")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"model: {self.name}: expert {expert} out of range (the model has {self.num_experts})")
        if kind == "weight" and tensor.dtype != FP8:
            q, s = quantize_weight_block(tensor)
            self.load("weight", q, expert, proj)
            self.load("scale", s, expert, proj)
            return
        if kind not in ("weight", "scale"):
            raise ValueError(f"model: {self.name}: unknown tensor kind {kind!r}")
        full = (self.hidden, self.intermediate_size) if proj == "down_proj" else (self.intermediate_size, self.hidden)
        if kind == "scale":
            full = tuple(math.ceil(d / BLOCK) for d in full)
        if tuple(tensor.shape) != full:
            raise ValueError(f"model: {self.name}.{expert}.{proj}.{'weight' if kind == 'weight' else SCALE_NAME} has "
                             f"shape {tuple(tensor.shape)}, expected {full}")
        unit = 1 if kind == "weight" else BLOCK  # checkpoint rows / columns per stored one
        a, b = (edge // unit for edge in self.inter)
        if proj == "down_proj":
            target = (self.down_proj if kind == "weight" else self.down_proj_scale_inv).data[expert]
            value = tensor[:, a:b]
        else:
            stacked = (self.gate_up_proj if kind == "weight" else self.gate_up_proj_scale_inv).data[expert]
            target = stacked[:b - a] if proj == "gate_proj" else stacked[b - a:]
            value = tensor[a:b]
        target.copy_(value.to(target.device, target.dtype))
        self.loaded.add((kind, expert, proj))

    def load_stacked(self, kind: str, tensor: torch.Tensor, fused: str, first_expert: int = 0) -> None:
        """A fused checkpoint tensor of experts first_expert.. (`gate_up_proj` [e, 2I, H] or
        `down_proj` [e, H, I], or its `_scale_inv`), split into each expert's tensors."""
        for i, t in enumerate(tensor):
            e = first_expert + i
            if fused == "down_proj":
                self.load(kind, t, e, "down_proj")
            else:
                gate, up = t.chunk(2, dim=0)  # gate_up's block rows: :I/128 gate, I/128: up
                self.load(kind, gate, e, "gate_proj")
                self.load(kind, up, e, "up_proj")


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


__all__ = ["Fp8Experts", "PROJS", "SCALE_NAME", "fits_blocks"]
