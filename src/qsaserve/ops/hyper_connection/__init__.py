"""A Qwen4Exp hyper-connection step (inject the previous block's output, mix down to the next
block's input): `hc_step` runs the Triton kernels on CUDA (when the fused kernels are enabled,
`QSASERVE_FUSED_KERNELS`) and the torch reference elsewhere."""
from __future__ import annotations

from qsaserve.ops import fused
from qsaserve.ops.hyper_connection.reference import hc_step_reference

try:  # CPU-only installs keep the reference
    from qsaserve.ops.hyper_connection.triton_hc import hc_step_triton
except ImportError:
    hc_step_triton = None


def hc_step(hyper, block_out, inject, norm_weight, down_weight, up_weight, inject_weight, hc_count: int, eps: float):
    """-> (new hyper, mixed block input, next injection weights or None); see reference.py."""
    fast = hc_step_triton is not None and fused.use_fused(hyper) and hyper.dim() == 2
    fn = hc_step_triton if fast else hc_step_reference
    return fn(hyper, block_out, inject, norm_weight, down_weight, up_weight, inject_weight, hc_count, eps)


__all__ = ["hc_step", "hc_step_reference"]
