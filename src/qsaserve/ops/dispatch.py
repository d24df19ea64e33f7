"""The one answer to "does this op run its Triton kernel?", asked by every dispatched op in
ops/<op>/__init__.py (model and layer code never choose between a kernel and its reference).

`use_triton(x)`: x is a CUDA tensor, Triton is installed and the kernels are on. They are on
unless QSASERVE_FUSED_KERNELS=0 is in the environment, read at import so that worker processes see
it too; tests flip `ENABLED` instead. Off, CUDA runs the torch references (for A/B measurements,
and as the fallback should a kernel misbehave on a GPU).

`triton_runs(x)`: the same without the switch. Only the paged KV write, the Llama paged
attention and the PLE host-table gather use it: their references read the step's host lists or
gather on the host, which a CUDA graph would freeze, so those kernels stay on with the switch off.

CPU tensors always take the reference, also under TRITON_INTERPRET=1: a test that wants one op's
kernel branch on CPU sets that op package's `use_triton` (e.g. `ops.qsa_indexer.use_triton`)."""
from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("QSASERVE_FUSED_KERNELS", "1") != "0"

try:  # CPU-only installs have no triton
    import triton  # noqa: F401

    TRITON_AVAILABLE = True
except ImportError:
    TRITON_AVAILABLE = False


def triton_runs(x: torch.Tensor) -> bool:
    """x's op can run as a Triton kernel: x is on CUDA and Triton is installed."""
    return TRITON_AVAILABLE and x.is_cuda


def use_triton(x: torch.Tensor) -> bool:
    """x's op runs as a Triton kernel: it can (`triton_runs`) and the kernels are on (`ENABLED`)."""
    return ENABLED and triton_runs(x)


__all__ = ["ENABLED", "TRITON_AVAILABLE", "triton_runs", "use_triton"]
