"""A linear layer with NVFP4 weights (ModelOpt's layout; ops/nvfp4_gemm), run as W4A16: `weight`
uint8 [N, K/2] (packed E2M1), `weight_scale` E4M3 [N, K/16], `row_scale` float32 [N] (each
checkpoint tensor's `weight_scale_2`, repeated over its rows, so a fused q | k | v keeps three).
Loaders as fp8.Fp8Linear's: kinds weight (packed, or a float weight quantized here with
ModelOpt's recipe), scale, global (weight_scale_2) and bias; a rank's column range must start and
end on a 16-column group."""
from __future__ import annotations

import torch
from torch import nn

from qsaserve.errors import InvalidRequestError
from qsaserve.layers.quantization.shard import TensorShard, copy_part, take_shard
from qsaserve.layers.quantization.warm_up import warm_up_row_counts
from qsaserve.ops.nvfp4_gemm import GROUP, dequantize_nvfp4, nvfp4_linear, quantize_nvfp4


class Nvfp4Linear(nn.Module):
    def __init__(self, in_features: int, parts: list[int], bias: bool, name: str = ""):
        super().__init__()
        if in_features % GROUP:
            raise InvalidRequestError("quantization", f"{name}: NVFP4 needs in_features a multiple of {GROUP}, got "
                                      f"{in_features}")
        self.name, self.scheme = name, "nvfp4"
        self.in_features, self.parts = in_features, list(parts)
        self.out_features = n = sum(parts)
        self.offsets = [sum(parts[:i]) for i in range(len(parts))]
        self.weight = nn.Parameter(torch.empty(n, in_features // 2, dtype=torch.uint8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(n, in_features // GROUP, dtype=torch.float8_e4m3fn),
                                         requires_grad=False)
        self.row_scale = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n), requires_grad=False) if bias else None
        self.loaded: set[tuple[str, int]] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, N] in x's dtype."""
        return nvfp4_linear(x, self.weight, self.weight_scale, self.row_scale, self.bias)

    def warm_up(self, dtype: torch.dtype) -> int:
        """Builds this layer's NVFP4 kernels at every row count class a step may bring (launches made)."""
        return warm_up_row_counts(self, dtype)

    def linear_part(self, x: torch.Tensor, part: int) -> torch.Tensor:
        """x [T, K] -> x @ W_part^T [T, rows of the part]: one part's rows, alone."""
        a, rows = self.offsets[part], self.parts[part]
        bias = None if self.bias is None else self.bias[a:a + rows]
        return nvfp4_linear(x, self.weight[a:a + rows], self.weight_scale[a:a + rows], self.row_scale[a:a + rows], bias)

    def dequantized(self, part: int, dtype: torch.dtype) -> torch.Tensor:
        """One part's weight rows dequantized [rows, K] (for code that takes a weight tensor)."""
        a, rows = self.offsets[part], self.parts[part]
        return dequantize_nvfp4(self.weight[a:a + rows], self.weight_scale[a:a + rows], self.row_scale[a:a + rows]).to(dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme=nvfp4"

    def missing(self) -> list[str]:
        kinds = ("weight", "scale", "global") + (("bias",) if self.bias is not None else ())
        return [f"{self.name}.{k}#{p}" for k in kinds for p in range(len(self.parts)) if (k, p) not in self.loaded]

    def load(self, kind: str, tensor: torch.Tensor, part: int = 0, shard: TensorShard | None = None) -> None:
        """As Fp8Linear.load; kind global is the checkpoint's weight_scale_2."""
        if kind == "weight" and tensor.dtype != torch.uint8:
            packed, scale, glob = quantize_nvfp4(tensor)
            for k, t in (("weight", packed), ("scale", scale), ("global", glob)):
                self.load(k, t, part, shard)
            return
        a, rows = self.offsets[part], self.parts[part]
        if kind == "global":
            self.row_scale.data[a:a + rows] = tensor.float().reshape(()).to(self.row_scale.device)
            self.loaded.add((kind, part))
            return
        if kind == "bias":
            target, value = self.bias.data[a:a + rows], take_shard(tensor, shard)
        elif kind in ("weight", "scale"):
            per_col = 2 if kind == "weight" else GROUP  # checkpoint columns per stored column
            if shard is not None and shard.dim == 1:
                if any(e % GROUP for r in shard.ranges for e in r):
                    raise InvalidRequestError("tensor_parallel_size", f"{self.name}: this rank's columns "
                                              f"{shard.ranges} split a {GROUP}-column NVFP4 group")
                shard = TensorShard(1, tuple((s // per_col, e // per_col) for s, e in shard.ranges), shard.full // per_col)
            target = (self.weight if kind == "weight" else self.weight_scale).data[a:a + rows]
            value = take_shard(tensor, shard)
        else:
            raise ValueError(f"model: {self.name}: unknown tensor kind {kind!r}")
        copy_part(self.name, kind, part, target, value)
        self.loaded.add((kind, part))


__all__ = ["Nvfp4Linear"]
