"""A linear layer with FP8 E4M3 weights (vLLM's `Fp8LinearMethod` idea): the layer owns its
parameters and their loaders, so a model hands it checkpoint tensors (FP8 weights and their
scales, or float weights to quantize at load) and this rank's range of each, and never sees the
scale layout.

Parameters: `weight` [N, K] E4M3 and `weight_scale` [ceil(N/block_n), Sk] float32, the layout of
ops/fp8_gemm/reference.py (Sk = ceil(K/128) for block scales, 1 for channel / tensor scales).
A layer packing several checkpoint tensors by rows (q | k | v) has `parts` rows each; block_n is
128, or the largest divisor of 128 that divides every part (SmolLM2's k/v have 192 rows), each
checkpoint block scale then repeated 128 / block_n times, so every part keeps its own blocks.

Tensor parallel: a rank's input-column range of a block-scaled tensor must start and end on a 128
boundary (or at the tensor's end): the activations' 128-column groups must line up with the
weight's K blocks; such a layout is refused naming tensor_parallel_size. Output rows may cut a
block (GDN's one-row-per-head projections at any TP): the rank keeps that block's scale. Online quantization quantizes the full checkpoint
tensor first, then shards it, so every layout holds the same quantized model."""
from __future__ import annotations

import math

import torch
from torch import nn

from qsaserve.errors import InvalidRequestError
from qsaserve.layers.quantization.config import BLOCK, WeightQuantConfig
from qsaserve.layers.quantization.shard import TensorShard, copy_part, take_shard
from qsaserve.layers.quantization.warm_up import WARM_UP_ROWS, warm_up_row_counts
from qsaserve.ops.fp8_gemm import (FP8, GEMV_ROWS, RESIDUAL_ROWS, SummedResidual, dequantize_weight, fp8_linear,
                                   fp8_linear_prenormed, fp8_linear_prenormed_rope_kv, fp8_linear_residual,
                                   fp8_linear_rms_norm, fp8_linear_silu_mul, joins_residual, prenormed_joins,
                                   quantize_weight_block, quantize_weight_rows)


class Fp8Linear(nn.Module):
    def __init__(self, in_features: int, parts: list[int], bias: bool, quant: WeightQuantConfig, name: str = ""):
        super().__init__()
        self.name, self.scheme = name, quant.scheme
        self.in_features, self.parts = in_features, list(parts)
        self.out_features = sum(parts)
        self.offsets = [sum(parts[:i]) for i in range(len(parts))]
        self.block_n = 1 if self.scheme == "channel" else math.gcd(BLOCK, *parts)
        scale_cols = math.ceil(in_features / BLOCK) if self.scheme == "block" else 1
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(self.out_features // self.block_n, scale_cols,
                                                     dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        self.loaded: set[tuple[str, int]] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, N] in x's dtype."""
        return fp8_linear(x, self.weight, self.weight_scale, self.block_n, self.bias)

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2K] -> (SiLU(gate) * up) @ W^T [T, N]: at decode rows one kernel."""
        return fp8_linear_silu_mul(gate_up, self.weight, self.weight_scale, self.block_n, self.bias)

    def forward_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual) * norm_weight @ W^T, x + residual): at the GEMV's rows one kernel."""
        return fp8_linear_rms_norm(x, residual, norm_weight, eps, self.weight, self.weight_scale, self.block_n,
                                   self.bias)

    def joins_residual(self, x: torch.Tensor, residual: torch.Tensor | None, gated: bool = False) -> bool:
        """forward_residual takes this input in one kernel (ops.fp8_gemm.joins_residual)."""
        return joins_residual(x, self.weight, residual, self.bias, gated)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                         gated: bool = False) -> SummedResidual:
        """This layer's output (of SiLU(gate) * up when gated) added to the residual, with the next
        RMSNorm's numerator (norm_weight): one kernel; only where joins_residual."""
        return fp8_linear_residual(x, self.weight, self.weight_scale, self.block_n, residual, norm_weight, gated)

    def forward_prenormed(self, summed: SummedResidual, eps: float) -> torch.Tensor:
        """RMSNorm(summed.h) * summed.norm_weight @ W^T: at the GEMV's rows one kernel."""
        return fp8_linear_prenormed(summed, eps, self.weight, self.weight_scale, self.block_n, self.bias)

    def joins_prenormed_rope_kv(self, summed: SummedResidual) -> bool:
        """forward_prenormed_rope_kv takes this input (no bias, the prenormed GEMV's rows)."""
        return self.bias is None and prenormed_joins(summed, self.weight)

    def forward_prenormed_rope_kv(self, summed: SummedResidual, eps: float, num_q_heads: int, num_kv_heads: int,
                                  positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                  kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """forward_prenormed of a fused q | k | v layer with q and k rotated and k, v written to
        the pages in the same kernel (ops.fp8_gemm.fp8_linear_prenormed_rope_kv); only where
        joins_prenormed_rope_kv."""
        return fp8_linear_prenormed_rope_kv(summed, eps, self.weight, self.weight_scale, self.block_n, num_q_heads,
                                            num_kv_heads, positions, cos, sin, kv_cache, slot_mapping)

    def warm_up(self, dtype: torch.dtype) -> int:
        """Builds this layer's FP8 kernels at every row count class a step may bring, with SiLU *
        up joined in as well (the gated GEMV and quantization), the RMSNorm-joined GEMV (with
        and without a residual, norm weights in dtype or float32) at its rows, and at the
        residual-joined rows the GEMV adding its output to the residual (plain and gated) and the
        prenormed GEMV after it (launches made)."""
        launches = warm_up_row_counts(self, dtype)
        gate_up = torch.zeros(max(WARM_UP_ROWS), 2 * self.in_features, dtype=dtype, device=self.weight.device)
        for rows in WARM_UP_ROWS:
            self.forward_silu_mul(gate_up[:rows])
        launches += len(WARM_UP_ROWS)
        x = torch.zeros(GEMV_ROWS + 1, self.in_features, dtype=dtype, device=self.weight.device)
        for norm_dtype in dict.fromkeys((dtype, torch.float32)):
            g = torch.ones(self.in_features, dtype=norm_dtype, device=x.device)
            # the GEMV's rows, and one W8A8 row count (the norm's kernel quantizing: one build for all)
            for rows in range(1, GEMV_ROWS + 2):
                for residual in (None, x[:rows]):
                    self.forward_rms_norm(x[:rows], residual, g, 1e-6)
                    launches += 1
        residual = torch.zeros(RESIDUAL_ROWS, self.out_features, dtype=dtype, device=x.device)
        for norm_dtype in dict.fromkeys((dtype, torch.float32)):
            out_norm = torch.ones(self.out_features, dtype=norm_dtype, device=x.device)
            for rows in range(1, RESIDUAL_ROWS + 1):
                for gated, inp in ((False, x[:rows]), (True, gate_up[:rows])):
                    if self.joins_residual(inp, residual[:rows], gated):
                        self.forward_residual(inp, residual[:rows], out_norm, gated)
                        launches += 1
        # the prenormed GEMV reads no norm weight (its input carries it): one build per row count
        in_norm = torch.ones(self.in_features, dtype=dtype, device=x.device)
        for rows in range(1, RESIDUAL_ROWS + 1):
            self.forward_prenormed(SummedResidual(x[:rows], x[:rows], torch.zeros(1, 4, device=x.device), in_norm), 1e-6)
            launches += 1
        return launches

    def linear_part(self, x: torch.Tensor, part: int) -> torch.Tensor:
        """x [T, K] -> x @ W_part^T [T, rows of the part]: one part's rows, alone."""
        a, rows = self.offsets[part], self.parts[part]
        bias = None if self.bias is None else self.bias[a:a + rows]
        return fp8_linear(x, self.weight[a:a + rows], self.weight_scale[a // self.block_n:(a + rows) // self.block_n],
                          self.block_n, bias)

    def dequantized(self, part: int, dtype: torch.dtype) -> torch.Tensor:
        """One part's weight rows dequantized [rows, K] (for code that takes a weight tensor)."""
        a, rows = self.offsets[part], self.parts[part]
        w = dequantize_weight(self.weight[a:a + rows], self.weight_scale[a // self.block_n:(a + rows) // self.block_n],
                              self.block_n)
        return w.to(dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme}, block_n={self.block_n}"

    # ---- loading ----
    def missing(self) -> list[str]:
        kinds = ("weight", "scale") + (("bias",) if self.bias is not None else ())
        return [f"{self.name}.{k}#{p}" for k in kinds for p in range(len(self.parts)) if (k, p) not in self.loaded]

    def load(self, kind: str, tensor: torch.Tensor, part: int = 0, shard: TensorShard | None = None) -> None:
        """kind: weight (E4M3, or a float weight quantized here), scale (the checkpoint's
        weight_scale_inv / weight_scale) or bias; tensor: the full checkpoint tensor; part: its
        row range of this layer; shard: this rank's range of it (None: all of it)."""
        if kind == "weight" and tensor.dtype != FP8:
            q, s = self.quantize(tensor)
            self.load("weight", q, part, shard)
            self.load("scale", s, part, shard)
            return
        a, rows = self.offsets[part], self.parts[part]
        if kind == "bias":
            target, value = self.bias.data[a:a + rows], take_shard(tensor, shard)
        elif kind == "weight":
            self._check_blocks(shard)
            target, value = self.weight.data[a:a + rows], take_shard(tensor, shard)
        elif kind == "scale":
            target, value = self.weight_scale.data[a // self.block_n:(a + rows) // self.block_n], self._scale_rows(tensor, rows, shard)
        else:
            raise ValueError(f"model: {self.name}: unknown tensor kind {kind!r}")
        copy_part(self.name, kind, part, target, value)
        self.loaded.add((kind, part))

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A full float checkpoint weight -> (E4M3, its checkpoint-layout scale) in this layer's scheme."""
        if self.scheme == "block":
            return quantize_weight_block(w)
        return quantize_weight_rows(w, per_tensor=self.scheme == "tensor")

    def _check_blocks(self, shard: TensorShard | None) -> None:
        """A rank's input columns must fall on 128-blocks (activation groups line up with the weight's
        K blocks); its output rows may cut a block (the rank keeps that block's scale) if each range
        starts a whole number of block_n rows into it."""
        if self.scheme != "block" or shard is None:
            return
        for a, b in shard.ranges:
            if shard.dim == 1 and any(edge % BLOCK and edge != shard.full for edge in (a, b)):
                raise InvalidRequestError("tensor_parallel_size", f"{self.name}: this rank's input columns [{a}, {b}) "
                                          f"of {shard.full} split a {BLOCK}x{BLOCK} FP8 weight block; block-FP8 "
                                          f"weights shard their input dimension on multiples of {BLOCK}")
            if shard.dim == 0 and (a % BLOCK) % self.block_n:
                raise InvalidRequestError("tensor_parallel_size", f"{self.name}: this rank's rows start at {a}, "
                                          f"{a % BLOCK} rows into a {BLOCK}-row FP8 block, not a multiple of the "
                                          f"layer's {self.block_n}-row scale granularity")

    def _scale_rows(self, s: torch.Tensor, rows: int, shard: TensorShard | None) -> torch.Tensor:
        """A checkpoint scale -> this rank's rows of weight_scale for one part ([rows / block_n, Sk])."""
        s = s.float()
        if self.scheme == "tensor":
            return s.reshape(1, 1).expand(rows // self.block_n, 1)
        if self.scheme == "channel":
            s = s.reshape(-1, 1)
            return take_shard(s, shard) if shard is not None and shard.dim == 0 else s
        s = s.reshape(-1, s.shape[-1]) if s.dim() == 2 else s.reshape(1, -1)
        expand = BLOCK // self.block_n
        if shard is None:
            return s.repeat_interleave(expand, 0)[: rows // self.block_n]
        self._check_blocks(shard)
        blocks = [(a // BLOCK, -(-b // BLOCK)) for a, b in shard.ranges]
        if shard.dim == 1:
            return torch.cat([s[:, a:b] for a, b in blocks], 1).repeat_interleave(expand, 0)[: rows // self.block_n]
        # each range's blocks, repeated to block_n rows, cut to the range's own rows (a range may
        # start inside a block)
        bn = self.block_n
        return torch.cat([s[a:b].repeat_interleave(expand, 0)[(d % BLOCK) // bn:(d % BLOCK + e - d) // bn]
                          for (a, b), (d, e) in zip(blocks, shard.ranges)])


__all__ = ["Fp8Linear", "TensorShard"]
