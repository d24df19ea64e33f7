"""Decode GEMV with unquantized weights (y = x @ W^T for a few rows): a Triton kernel (triton_gemv,
the FP8 GEMV's program over plain weights) beside its torch reference, and the one dispatch every
plain projection goes through (`linear`): the kernel for up to GEMV_ROWS rows of a CUDA tensor
without a bias when it is on, else F.linear (cuBLAS). On unless QSASERVE_TRITON_GEMV=0 (read at
import; tests flip `ENABLED`), from benchmarks/bench_gemv.py and `qsaserve bench latency` on an
H200 (docs/benchmarks.md) at 1 and 2 rows; at 3-4 rows (batches of 3-4, a batch-1 MTP3 verify)
only the narrow projections, where cuBLAS was measured slower."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from qsaserve.ops import fused
from qsaserve.ops.dispatch import use_triton

try:  # CPU-only installs: F.linear only
    from qsaserve.ops.gemv.triton_gemv import MAX_ROWS, gemv
except ImportError:
    gemv, MAX_ROWS = None, 0

ENABLED = os.environ.get("QSASERVE_TRITON_GEMV", "1") != "0" and gemv is not None
GEMV_ROWS = min(2, MAX_ROWS)  # rows every shape takes the GEMV at
# At 3-4 rows only narrow projections do: cuBLAS's small-row kernels read them slowly, the wide
# ones it reads faster than the GEMV (bench_gemv.py --rows 3,4 on an H200,
# gemv_decode_rows34_h200_2026-12-06_829651f.json: qwen4exp-small's MoE input projection,
# 1,793 x 2,048, 5.7 us against 11.5-23.1; llama-8b's gate_up 73.6 against 57.1)
NARROW_ROWS, NARROW_N, NARROW_K = min(4, MAX_ROWS), 2048, 2560


def runs_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The Triton GEMV can compute x @ weight^T: it is on, the kernels are (ops.dispatch), x holds
    1 to MAX_ROWS rows in weight's dtype and weight has a unit last stride."""
    return (ENABLED and use_triton(x) and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and weight.dim() == 2 and weight.stride(-1) == 1 and x.dtype == weight.dtype)


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x @ weight^T takes the Triton GEMV: runs_gemv, and x holds up to GEMV_ROWS rows, or up to
    NARROW_ROWS for a weight of at most NARROW_N x NARROW_K."""
    if not runs_gemv(x, weight):
        return False
    rows, (n, k) = x.shape[0], weight.shape
    return rows <= GEMV_ROWS or (rows <= NARROW_ROWS and n <= NARROW_N and k <= NARROW_K)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias), as F.linear. With a bias, cuBLAS: it adds the bias before its one rounding."""
    if bias is None and takes_gemv(x, weight):
        return gemv(x, weight)
    return F.linear(x, weight, bias)


def linear_partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T as `linear` without a bias, except that where the GEMV splits K the float32
    partials [split, M, N] come back unsummed (gemv's sum_split=False): the consumer adds them in
    plane order and rounds once to x's dtype, the GEMV's own sum. Else [M, N] in x's dtype."""
    if takes_gemv(x, weight):
        return gemv(x, weight, sum_split=False)
    return F.linear(x, weight)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [T, 2I] (gate | up), then @ weight^T [N, I]: at the GEMV's rows
    one launch (the GEMV computes the SiLU as it loads gate | up, rounded where ops.fused.silu_mul
    rounds), else ops.fused.silu_mul then linear."""
    if gate_up.stride(-1) == 1 and takes_gemv(gate_up[:, : weight.shape[-1]], weight):
        return gemv(gate_up, weight, gated=True)
    return linear(fused.silu_mul(gate_up), weight)


__all__ = ["GEMV_ROWS", "MAX_ROWS", "NARROW_ROWS", "gemv", "linear", "linear_partials", "runs_gemv", "silu_mul_linear",
           "takes_gemv"]
