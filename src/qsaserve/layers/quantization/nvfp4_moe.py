"""Routed MoE experts with NVFP4 weights (ModelOpt's layout, run as W4A16; fp8_moe.Fp8Experts'
idea): the layer owns the stacked expert parameters and their loaders, so a model hands it each
expert's checkpoint tensors (packed E2M1 `weight`, E4M3 `weight_scale`, float32 `weight_scale_2`,
or a float weight quantized here) and never sees the layout.

Parameters, ops.moe's layout of NVFP4 experts (ops/moe/nvfp4.py): `gate_up_proj` uint8 [E, 2I, H/2]
(rows :I gate, I: up) with `gate_up_proj_scale` E4M3 [E, 2I, H/16] and `gate_up_proj_row_scale`
float32 [E, 2I] (gate's and up's own `weight_scale_2`, each repeated over its rows: the global
scales are kept per checkpoint tensor, not folded into the E4M3 group scales, which would round
them), `down_proj` [E, H, I/2] with `down_proj_scale` [E, H, I/16] and `down_proj_row_scale` [E, H].
Rows of gate / up may be cut anywhere (every row keeps its own group scales); a tensor-parallel
slice of down_proj's columns (this rank's intermediate range) must fall on 16-column groups, or
it is refused naming tensor_parallel_size. H and I must be multiples of 16 (`fits_groups`).

Online quantization quantizes each expert's full checkpoint tensor (ops.nvfp4_gemm.quantize_nvfp4,
ModelOpt's recipe) before taking this rank's slice."""
from __future__ import annotations

import torch
from torch import nn

from qsaserve.errors import InvalidRequestError
from qsaserve.ops.nvfp4_gemm import GROUP, quantize_nvfp4

PROJS = ("gate_proj", "up_proj", "down_proj")
KINDS = {"weight": "weight", "scale": "weight_scale", "global": "weight_scale_2"}  # kind -> checkpoint suffix


def fits_groups(hidden: int, intermediate_size: int) -> bool:
    """Whether experts of these sizes can be held in NVFP4 (both reductions in whole 16-groups)."""
    return hidden % GROUP == 0 and intermediate_size % GROUP == 0


class Nvfp4Experts(nn.Module):
    """E routed experts of hidden size H, this rank keeping intermediate rows `inter` [a, b) of
    `intermediate_size`; `name` (HF module name, `model.layers.N.mlp.experts`) names errors."""

    def __init__(self, num_experts: int, hidden: int, inter: tuple[int, int], intermediate_size: int, name: str):
        super().__init__()
        a, b = inter
        if not fits_groups(hidden, intermediate_size):
            raise InvalidRequestError("quantization", f"{name}: NVFP4 experts need hidden_size {hidden} and "
                                      f"moe_intermediate_size {intermediate_size} multiples of {GROUP}")
        if a % GROUP or b % GROUP:
            raise InvalidRequestError("tensor_parallel_size", f"{name}: this rank's expert intermediate rows "
                                      f"[{a}, {b}) of {intermediate_size} split a {GROUP}-column NVFP4 group of "
                                      f"down_proj; NVFP4 experts shard their intermediate dimension on multiples of "
                                      f"{GROUP}")
        self.name, self.num_experts, self.hidden = name, num_experts, hidden
        self.inter, self.intermediate_size = (a, b), intermediate_size
        rows = b - a
        self.gate_up_proj = _param((num_experts, 2 * rows, hidden // 2), torch.uint8)
        self.gate_up_proj_scale = _param((num_experts, 2 * rows, hidden // GROUP), torch.float8_e4m3fn)
        self.gate_up_proj_row_scale = _param((num_experts, 2 * rows), torch.float32)
        self.down_proj = _param((num_experts, hidden, rows // 2), torch.uint8)
        self.down_proj_scale = _param((num_experts, hidden, rows // GROUP), torch.float8_e4m3fn)
        self.down_proj_row_scale = _param((num_experts, hidden), torch.float32)
        self.loaded: set[tuple[str, int, str]] = set()

    def scales(self) -> dict[str, torch.Tensor]:
        """ops.moe's keyword arguments for these experts' scales."""
        return {"w13_scale": self.gate_up_proj_scale, "w2_scale": self.down_proj_scale,
                "w13_row_scale": self.gate_up_proj_row_scale, "w2_row_scale": self.down_proj_row_scale}

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, nvfp4 group={GROUP}"

    # ---- loading ----
    def missing(self) -> list[str]:
        """Checkpoint names of the per-expert tensors not loaded yet."""
        return [f"{self.name}.{e}.{proj}.{suffix}" for e in range(self.num_experts) for proj in PROJS
                for kind, suffix in KINDS.items() if (kind, e, proj) not in self.loaded]

    def load(self, kind: str, tensor: torch.Tensor, expert: int, proj: str) -> None:
        """kind: weight (packed uint8, or a float weight quantized here), scale (weight_scale) or
        global (weight_scale_2); tensor: expert `expert`'s full checkpoint tensor of `proj`
        (gate_proj / up_proj [I, H], down_proj [H, I], as packed [., ./2] and scales [., ./16])."""
        if proj not in PROJS:
            raise ValueError(f"model: {self.name}.{expert}: unknown expert projection {proj!r}")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"model: {self.name}: expert {expert} out of range (the model has {self.num_experts})")
        if kind not in KINDS:
            raise ValueError(f"model: {self.name}: unknown tensor kind {kind!r}")
        if kind == "weight" and tensor.dtype != torch.uint8:
            for k, t in zip(KINDS, quantize_nvfp4(tensor)):
                self.load(k, t, expert, proj)
            return
        rows_full, cols_full = (self.hidden, self.intermediate_size) if proj == "down_proj" else \
            (self.intermediate_size, self.hidden)
        per_col = {"weight": 2, "scale": GROUP, "global": None}[kind]  # checkpoint columns per stored one
        full = (1,) if per_col is None else (rows_full, cols_full // per_col)
        if tuple(tensor.shape) != full and not (per_col is None and tensor.numel() == 1):
            raise ValueError(f"model: {self.name}.{expert}.{proj}.{KINDS[kind]} has shape {tuple(tensor.shape)}, "
                             f"expected {full}")
        a, b = self.inter
        r = b - a
        down = proj == "down_proj"
        if kind == "global":
            target = self.down_proj_row_scale.data[expert] if down else \
                self.gate_up_proj_row_scale.data[expert, :r] if proj == "gate_proj" else \
                self.gate_up_proj_row_scale.data[expert, r:]
            target.fill_(float(tensor.float().reshape(())))
        else:
            stacked = {("weight", True): self.down_proj, ("scale", True): self.down_proj_scale,
                       ("weight", False): self.gate_up_proj, ("scale", False): self.gate_up_proj_scale}[kind, down]
            if down:
                target, value = stacked.data[expert], tensor[:, a // per_col:b // per_col]
            else:
                target = stacked.data[expert, :r] if proj == "gate_proj" else stacked.data[expert, r:]
                value = tensor[a:b]
            target.copy_(value.to(target.device, target.dtype))
        self.loaded.add((kind, expert, proj))

    def load_stacked(self, kind: str, tensor: torch.Tensor, fused: str, first_expert: int = 0) -> None:
        """A fused float checkpoint tensor of experts first_expert.. (`gate_up_proj` [e, 2I, H] or
        `down_proj` [e, H, I]), split into each expert's tensors and quantized (gate and up each
        with its own global scale). NVFP4 checkpoints store experts one by one."""
        if kind != "weight" or tensor.dtype == torch.uint8:
            raise ValueError(f"model: {self.name}.{fused}: fused NVFP4 expert tensors are not served; NVFP4 "
                             "checkpoints hold experts.E.gate_proj / up_proj / down_proj one by one")
        for i, t in enumerate(tensor):
            e = first_expert + i
            if fused == "down_proj":
                self.load(kind, t, e, "down_proj")
            else:
                gate, up = t.chunk(2, dim=0)
                self.load(kind, gate, e, "gate_proj")
                self.load(kind, up, e, "up_proj")


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


__all__ = ["KINDS", "Nvfp4Experts", "PROJS", "fits_groups"]
