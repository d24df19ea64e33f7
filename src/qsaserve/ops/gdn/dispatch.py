"""Gated delta rule entry point: fla-core's Triton kernels for CUDA tensors, the plain-torch
reference otherwise. Same arguments either way (fla-core's conventions)."""
from __future__ import annotations

import torch

from qsaserve.ops.gdn.reference import gdn_chunk_reference, gdn_recurrent_reference

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
except ImportError:  # CPU installs: fla-core is an optional GPU dependency
    chunk_gated_delta_rule = fused_recurrent_gated_delta_rule = None


def fla_available() -> bool:
    return chunk_gated_delta_rule is not None and torch.cuda.is_available()


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    single_token: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences ([1, T, H, D], boundaries in cu_seqlens), each continuing from its
    initial_state [N, Hv, Dk, Dv] fp32. q/k are L2-normalized inside. single_token: every
    sequence has one token (decode), where the recurrent form is cheapest."""
    # Keywords, not positions: fla's fused_recurrent takes (q, k, v, g, gk, gv, beta, ...), so a
    # positional beta would land in gk (per-key decay) and silently give wrong outputs.
    kwargs = dict(g=g, beta=beta, initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=cu_seqlens)
    if q.is_cuda and chunk_gated_delta_rule is not None:
        kernel = fused_recurrent_gated_delta_rule if single_token else chunk_gated_delta_rule
        return kernel(q, k, v, **kwargs)
    kernel = gdn_recurrent_reference if single_token else gdn_chunk_reference
    return kernel(q, k, v, **kwargs)
